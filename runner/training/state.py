"""A rank's training state, read by the step and the summary alike: what is fixed once the run
is built (`RunSetup`, with the `Start` it began from) and what the loop moves forward
(`TrainingState`: the step, the loss, each step's record, the last checkpoint, the evaluation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint.read import Checkpoint
from runner.config.schema import DebugConfig, RunConfig
from runner.core import CountedComm, ProcessGrid
from runner.cost.collectives import CommOp, MachineCosts
from runner.optim.sync import ReplicaOptimizer
from runner.records.rundir import RunDir
from runner.training.precision import DynamicLossScale, Precision
from strategies import ParallelModel
from strategies.base import StepPrediction


@dataclass(frozen=True)
class Start:
    """Where training starts: step 0, or a checkpoint's step with its time and sample order."""

    step: int = 0
    time_s: float = 0.0  # training time before this start (the metrics' time_s continues)
    sampler_state: dict[str, Any] | None = None
    checkpoint: Checkpoint | None = None
    continues_here: bool = False  # from this run directory's own checkpoint: metrics continue
    loss_scale: dict[str, Any] | None = None  # fp16's loss scale as the checkpoint left it

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint is not None else None


@dataclass
class RunSetup:
    """This rank's run as built: the same from its first step to its last."""

    run: RunConfig
    run_dir: RunDir
    grid: ProcessGrid
    model: ParallelModel
    optimizer: ReplicaOptimizer
    start: Start
    loss_comm: CountedComm  # over whose rows the logged loss is the mean, when replicas meet
    predicted_ops: list[CommOp] | None  # a step's collectives (synchronous exchange only)
    predicted_step: StepPrediction | None  # and its time: compute + communication
    costs: MachineCosts
    device: torch.device
    precision: Precision
    scaler: DynamicLossScale | None  # fp16's loss scale
    targets_per_sample: int  # 1: a class per sample; T: a token id per position (next-token)
    # rank 0's bytes for the model by what holds them (`Strategy.predict_memory`)
    predicted_memory: dict[str, int] | None

    @property
    def rank(self) -> int:
        return self.grid.rank

    @property
    def debug(self) -> DebugConfig:
        return self.run.debug

    @property
    def loss_scale(self) -> float:
        """What a rank's loss sum is multiplied by, P/B per target: the mean over the ranks is
        then the global mean loss (a class per sample, or a token id per position)."""
        return self.grid.size / (self.run.trainer.batch_size * self.targets_per_sample)


@dataclass
class StepHistory:
    """Each step's wall time, the bytes and seconds of the collectives rank 0 issued, and the
    peak bytes of the tensors it kept for backward (`runner.training.memory`)."""

    seconds: list[float] = field(default_factory=list)
    comm_bytes: list[int] = field(default_factory=list)
    comm_seconds: list[float] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)

    def add(self, seconds: float, comm_bytes: int, comm_seconds: float,
            activation_bytes: int = 0) -> None:
        self.seconds.append(seconds)
        self.comm_bytes.append(comm_bytes)
        self.comm_seconds.append(comm_seconds)
        self.activation_bytes.append(activation_bytes)

    @property
    def total_s(self) -> float:
        return sum(self.seconds)


class DeviceStepTimes:
    """A GPU step's time from CUDA events recorded on the current stream at its start and its
    end (after its update): the host runs ahead of the device between the steps that read their
    loss, so its clock says when a step was queued, not how long the device took. The events
    are read, without waiting, where a step reads its loss: that step's wait for its loss's copy
    (queued after the update) has seen every event before it complete. A step whose end the
    device has not reached there (fp16 reads its overflow flag before the update) is read at a
    later one, or at `finish`. On the CPU (`enabled` False) nothing is recorded."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._start: Any = None
        self._index = 0
        self._pending: list[tuple[int, Any, Any]] = []  # (history index, start, end)

    def begin(self, index: int) -> None:
        """The step that will be the history's entry `index` begins."""
        if self.enabled:
            self._index = index
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def end(self) -> None:
        """The step's work, its update included, has been queued."""
        if self.enabled and self._start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._index, self._start, end))
            self._start = None

    def resolve(self, history: StepHistory, wait: bool = False) -> dict[int, float]:
        """Each pending step's seconds, by history index, for the steps the device has
        completed (all of them with `wait`); set into the history where its entry exists."""
        found: dict[int, float] = {}
        left: list[tuple[int, Any, Any]] = []
        for index, start, end in self._pending:
            if not (wait or end.query()):
                left.append((index, start, end))
                continue
            if wait:
                end.synchronize()
            found[index] = start.elapsed_time(end) / 1000
            if index < len(history.seconds):
                history.seconds[index] = found[index]
        self._pending = left
        return found

    def finish(self, history: StepHistory) -> None:
        """After the last step: the steps not yet read, waiting for the device."""
        self.resolve(history, wait=True)


@dataclass
class TrainingState:
    """Where the loop is: the last step begun and its loss (the start's step and NaN before the
    first), each step's record, the last checkpoint written (or resumed from), the last
    evaluation."""

    step: int = 0
    loss: float = float("nan")
    history: StepHistory = field(default_factory=StepHistory)
    last_checkpoint: Path | None = None
    evaluation: dict[str, float] | None = None
