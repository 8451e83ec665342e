"""Starting a run, fresh or from a checkpoint, in one call (`start_or_resume`).

Order matters, and it lives here rather than in the loop: the centre of an EASGD checkpoint goes
into the model before the optimizer is built (the optimizer takes its centre from the weights),
the weights, optimizer state and RNG after. A run that does not continue this directory's own
checkpoints moves them aside first, so that `resume=auto` never mixes two runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    load_centre,
    load_training_state,
    resolve_resume,
    resume_plan,
    sampler_state,
)
from runner.console import make_console
from runner.core import ProcessGrid
from runner.logs import get_logger
from runner.optim import ReplicaOptimizer
from runner.rundir import RunDir
from runner.step import StepFailure
from strategies import ParallelModel


@dataclass(frozen=True)
class Start:
    """Where training starts: step 0, or a checkpoint's step with its time and sample order."""

    step: int = 0
    time_s: float = 0.0  # training time before this start (the metrics' time_s continues)
    sampler_state: dict[str, Any] | None = None
    checkpoint: Checkpoint | None = None
    continues_here: bool = False  # from this run directory's own checkpoint: metrics continue

    @property
    def checkpoint_path(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint is not None else None


def _find_checkpoint(resume: str | None, run_dir: RunDir, grid: ProcessGrid) -> Checkpoint | None:
    """Rank 0 resolves `trainer.resume` and clears the way; every rank learns the answer."""
    found = None
    if grid.rank == 0:
        found = resolve_resume(resume, run_dir.checkpoints)
        continues_here = found is not None and found.parent == run_dir.checkpoints
        if not continues_here and latest_checkpoint(run_dir.checkpoints) is not None:
            aside = run_dir.path / f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir.checkpoints.rename(aside)
            get_logger().info("an earlier run's checkpoints moved to %s", aside)
    found = grid.world.allgather_object(found)[0]
    return None if found is None else Checkpoint(found)


def start_or_resume(resume: str | None, total_steps: int, run_dir: RunDir, grid: ProcessGrid,
                    model: ParallelModel, optimizer_cls: type[ReplicaOptimizer],
                    make_optimizer: Callable[[], ReplicaOptimizer]
                    ) -> tuple[ReplicaOptimizer, Start]:
    """The replica optimizer (built by `make_optimizer` at the right moment) and where training
    starts. Raises `StepFailure` when the checkpoint already has every step."""
    checkpoint = _find_checkpoint(resume, run_dir, grid)
    if checkpoint is None:
        return make_optimizer(), Start()
    plan = resume_plan(checkpoint, optimizer_cls.per_replica, optimizer_cls.has_centre, grid)
    load_centre(checkpoint, plan, model)
    optimizer = make_optimizer()
    log = get_logger()
    for note in load_training_state(checkpoint, plan, model, optimizer, grid):
        log.info("resume: %s", note)
    if checkpoint.step >= total_steps:
        raise StepFailure(f"nothing to train: {checkpoint.path} is at step {checkpoint.step} "
                          f"and trainer.steps={total_steps} (raise trainer.steps to train on)")
    log.info("resumed from %s (step %d)", checkpoint.path, checkpoint.step)
    if grid.rank == 0:
        make_console().print(f"resuming from {checkpoint.path} at step {checkpoint.step}")
    return optimizer, Start(checkpoint.step, float(checkpoint.manifest["time_s"]),
                            sampler_state(checkpoint), checkpoint,
                            checkpoint.path.parent == run_dir.checkpoints)
