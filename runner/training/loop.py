"""The training loop every rank runs (the same code at P = 1 and at P = 1000).

`build_training` puts this rank's run together: the parts from `runner.training.assembly`, the
strategy's parallel model, the start (fresh or resumed, `runner.training.resume`), as the setup
and state the step and the summary read (`runner.training.state`). `train` keeps only the order
of things: step (`runner.training.step.train_step`), log, the stop protocol, checkpoint timing,
evaluation. A step's loss is read on the host only on the steps `Training.reads_loss` names
(logged, first, last, checkpoint), and the check for a non-finite loss runs there (and on a
stop): between them the host never waits for the device (fp16 aside, see `runner.training.step`).
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from runner.checkpoint.layout import CheckpointError
from runner.checkpoint.write import TrainingProgress, save_checkpoint
from runner.config.machine import load_compute_rates, load_machine_costs
from runner.config.schema import RunConfig
from runner.core import ProcessGrid
from runner.core.placement import place_whole
from runner.cost.collectives import CommOp, MachineCosts, loss_op
from runner.cost.compute import ComputeRates, oversubscription
from runner.records.board import TensorBoardWriter
from runner.records.console import ProgressReporter, make_console, summary_table
from runner.records.logs import get_logger
from runner.records.process import start_up_done
from runner.records.rundir import MetricsWriter, RunDir, git_commit, write_json
from runner.training.assembly import RunParts, assemble, dtype_of
from runner.training.devices import describe_device
from runner.training.evaluation import validation
from runner.training.feeding import BatchFeeder
from runner.training.interrupt import StopRequest
from runner.training.memory import SavedTensorMeter
from runner.training.precision import Precision
from runner.training.resume import start_or_resume
from runner.training.sampling import EpochSampler
from runner.training.state import DeviceStepTimes, RunSetup, TrainingState
from runner.training.step import (
    Feed,
    HostCopy,
    ReplicaFailure,
    StepFailure,
    host_values,
    train_step,
)
from runner.training.summary import completed_summary, interrupted_summary, sparse_line
from runner.weights.export import ExportError, ExportRequest, export_checkpoint
from runner.weights.load import load_weights, open_bound
from runner.weights.model_card import (
    MODEL_CONFIG,
    STATE_NAMES,
    kept_tensors,
    transformers_config,
)
from runner.weights.safetensors_file import WeightsFileError
from runner.zoo.datasets import ClassificationData
from strategies import ParallelModel
from strategies.base import StepPrediction, accumulated_ops, predict_step
from strategies.compiled import compile_modules, compile_targets
from strategies.recompute import checkpoint_modules, checkpoint_targets

__all__ = ["StepFailure", "Training", "build_training", "train"]


@dataclass
class Training(RunSetup):
    """This rank's assembled run (its setup), what feeds it and records it, and the state the
    loop moves forward."""

    data: ClassificationData
    sampler: EpochSampler
    state: TrainingState
    sinks: list[Any] = field(default_factory=list)  # metrics.jsonl, TensorBoard (rank 0)
    meter: SavedTensorMeter = field(default_factory=SavedTensorMeter)  # activation memory
    run_info: dict[str, Any] = field(default_factory=dict)  # what each checkpoint records
    feeder: BatchFeeder | None = None  # made on the first step, from where the sampler stands

    @property
    def time_s(self) -> float:
        """Training time so far, before this start included."""
        return self.start.time_s + self.state.history.total_s

    def batch(self) -> list[Feed]:
        """This rank's rows of the next global batch, micro-batch by micro-batch
        (`trainer.accumulate_steps`): its inputs and its outputs' targets, read ahead
        (`runner.training.feeding`)."""
        trainer = self.run.trainer
        micro = self.model.micro_batches(trainer.batch_size, trainer.accumulate_steps)
        if self.feeder is None:  # the sampler stands where this start resumes it
            self.feeder = BatchFeeder(self.data, self.sampler, micro, self.device,
                                      self.run.data.workers, self.run.data.prefetch,
                                      steps=trainer.steps - self.start.step)
        return self.feeder.next(micro)

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    def log_step(self, step: int, loss: float | None, seconds: float, comm: Any,
                 progress: ProgressReporter, replica_loss: bool = False) -> None:
        """`loss`: the step's mean loss, None where the step did not read it (`reads_loss`);
        `replica_loss`: the loss is replica 0's own rows' (the replicas did not meet)."""
        self.state.history.add(seconds, comm.nbytes, comm.seconds, self.meter.peak)
        rate = self.run.trainer.batch_size / seconds
        every, steps = self.run.trainer.log_every, self.run.trainer.steps
        progress.step(step, self.state.loss, rate)  # the latest loss read
        if loss is None:
            return
        if step % every == 0 or step == steps or not math.isfinite(loss):
            self.write({"step": step, "time_s": self.time_s, "loss": loss,
                        "lr": self.optimizer.lr, "step_time_s": seconds,
                        "comm_time_s": comm.seconds, "comm_bytes": comm.nbytes,
                        "comm_share": comm.seconds / seconds, "samples_per_s": rate,
                        **({"replica_loss": True} if replica_loss else {}),
                        **({"tokens_per_s": rate * self.targets_per_sample}
                           if self.targets_per_sample > 1 else {}),
                        **sparse_line(self.model)})
        if step % every == 0:
            get_logger().info("step %d loss %.6f step_time %.4fs comm %.4fs %d B", step, loss,
                              seconds, comm.seconds, comm.nbytes)
        if not math.isfinite(loss):
            message = self.diverged(f"the loss is {loss} at step {step}")
            # Reduced over the world every rank stops here alike; over one replica, the others
            # are elsewhere, and this rank's failure must end the job (an abort).
            raise ReplicaFailure(message) if replica_loss else StepFailure(message)

    def diverged(self, what: str) -> str:
        """The message of a run stopped by a non-finite loss."""
        last = self.state.last_checkpoint
        kept = (f"the last good checkpoint is {last}" if last
                else "no checkpoint was written (trainer.checkpoint_every)")
        return f"{what}: training stopped; {kept}. Lower optimizer.lr, or check the data"

    def reads_loss(self, step: int) -> bool:
        """Whether step `step` reads its loss on the host (the same on every rank): the first
        step of this start (the console's first line, and an early check), the logged steps
        (`trainer.log_every`), the last step (the summary's final loss), and the steps that
        write a checkpoint (`trainer.checkpoint_every`: never one after a non-finite loss).
        The non-finite-loss check runs on these steps, and on a step that stops on a signal
        (`anyone_stopping`). Elsewhere the loss stays on the device, unread."""
        trainer = self.run.trainer
        every = trainer.checkpoint_every
        return (step == self.start.step + 1 or step % trainer.log_every == 0
                or step == trainer.steps or (every is not None and step % every == 0))

    def stop_request(self, requested: bool, meets: bool) -> bool:
        """Whether this step carries a stop request. On a step where the replicas do not meet
        (their loss is reduced over each replica alone), replicas of a synchronous optimizer
        hold the request for the next step where they do, so that they all stop there
        together; an asynchronous optimizer's replicas each act on it at once."""
        return requested and (meets or self.optimizer.asynchronous)

    def anyone_stopping(self, stopping: bool, step: int,
                        unread: torch.Tensor | None = None) -> bool:
        """Collective over the world: asynchronous replicas each stop when they see the signal,
        so they meet here (at checkpoint steps, the last step, or a stop). `unread`: this
        step's loss where the step did not read it (a stop between logged steps): read now,
        and a non-finite one on any rank fails the step before its stop checkpoint is
        written."""
        diverged = unread is not None and not math.isfinite(HostCopy([unread]).values()[0])
        flag = torch.tensor([int(stopping), int(diverged)], dtype=torch.int32)  # host: flags
        self.grid.world.allreduce_(flag, label="stop")
        anyone, nonfinite = host_values(flag)
        if nonfinite:
            raise StepFailure(self.diverged(f"the loss is not finite at step {step}"))
        return bool(anyone)

    def checkpoint(self, step: int) -> None:
        progress = TrainingProgress(step, self.time_s, self.sampler.state(),
                                    None if self.scaler is None else self.scaler.state())
        try:
            self.state.last_checkpoint = save_checkpoint(
                self.run_dir.checkpoints, progress, self.model, self.optimizer, self.grid,
                self.run_info, self.run.trainer.keep_checkpoints)
        except CheckpointError as exc:
            last = self.state.last_checkpoint
            kept = (f"the latest complete one is {last}" if last
                    else "there is no earlier checkpoint")
            raise StepFailure(f"{exc}; {kept}") from None

    def evaluate(self, step: int, at_end: bool, progress: ProgressReporter) -> None:
        asynchronous = self.optimizer.asynchronous
        if at_end and asynchronous:
            self.grid.world.barrier()  # every worker's last exchange is in the centre
        with self.precision.autocast():
            count = self.run.trainer.eval_samples
            val_x, val_y = ((self.data.val_x, self.data.val_y) if count is None else
                            (self.data.val_x[:count], self.data.val_y[:count]))
            result = validation(self.model, self.optimizer, val_x, val_y,
                                everyone=at_end or not asynchronous,
                                batch_size=self.run.trainer.batch_size)
        if result is not None:
            self.state.evaluation = result
            get_logger().info("step %d val %s", step, json.dumps(result))
            progress.evaluation(step, result["loss"], result["accuracy"],
                                result.get("perplexity"))
            self.write({"step": step, "split": "val", "time_s": self.time_s, **result})

    def close(self) -> None:
        if self.feeder is not None:
            self.feeder.close()
        for sink in self.sinks:
            sink.close()
        self.model.refresh_copies()
        self.optimizer.close()


def load_data(run: RunConfig, parts: RunParts, device: torch.device,
              precision: Precision) -> ClassificationData:
    """The dataset, floating inputs in the run's dtype (the half type under bf16/fp16), on the
    run's device when it is held in memory (a user's lazily read one moves batch by batch)."""
    data: ClassificationData = parts.dataset.load()
    if data.train_x.is_floating_point():  # token ids stay integers
        dtype = precision.input_dtype(dtype_of(run))
        data.train_x, data.val_x = data.train_x.to(dtype), data.val_x.to(dtype)
    if device.type != "cpu":
        for name in ("train_x", "train_y", "val_x", "val_y"):
            value = getattr(data, name)
            if isinstance(value, torch.Tensor):
                setattr(data, name, value.to(device))
    return data


def compute_slowdown(grid: ProcessGrid) -> float:
    """How much slower this rank computes than the calibrated rates say: ranks (and their
    threads) sharing this node's cores."""
    import os
    import socket

    hosts = grid.world.allgather_object(socket.gethostname())
    local_ranks = hosts.count(hosts[grid.rank])
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    # Threads beyond the rates' own are not counted as speed: at the sizes a rank works on,
    # dispatch and memory bound most operations, which more threads do not shorten.
    return oversubscription(local_ranks * threads, cores)


def _calibration(run: RunConfig, device: torch.device) -> tuple[MachineCosts, ComputeRates]:
    """The machine's communication costs and compute rates: a GPU run's priced with its GPU's
    calibration, where the calibration holds it."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return load_machine_costs(device=gpu), load_compute_rates(gpu, run.trainer.precision)


def _predictions(run: RunConfig, parts: RunParts, grid: ProcessGrid, precision: Precision
                 ) -> tuple[list[CommOp] | None, StepPrediction | None, dict[str, int] | None]:
    """What the planner predicts of a step on this grid: its collectives, its time and rank
    0's memory. It models synchronous gradient exchange only: no collectives and no time for
    other optimizers."""
    syncs = parts.optimizer_cls.syncs_gradients
    shape, batch_size = parts.spec.input_shape, run.trainer.batch_size
    itemsize = torch.empty((), dtype=dtype_of(run)).element_size()  # host: a dtype's size
    with torch.random.fork_rng(devices=[]):  # what is priced leaves the run's draws alone
        ops = (accumulated_ops(parts.strategy, parts.model, shape, grid.shape, batch_size,
                               run.trainer.accumulate_steps)
               + loss_op(grid.size, itemsize, overflow_flag=precision.name == "fp16")
               if syncs else None)
        step = (predict_step(parts.strategy, parts.model, shape, grid.shape, batch_size)
                if syncs else None)
        memory = parts.strategy.predict_memory(
            parts.model, shape, grid.shape, parts.optimizer_cls.state_copies(run.optimizer.options))
    return ops, step, memory


def _parallel_model(run: RunConfig, parts: RunParts, grid: ProcessGrid) -> ParallelModel:
    """The strategy's parallel model of this rank, its modules of `trainer.compile` compiled
    (`strategies.compiled`), those of `trainer.activation_checkpointing` recomputed in
    backward (those a strategy rebuilt are named in a warning, and in the model's
    `recomputed`)."""
    recomputed, problem = checkpoint_targets(parts.model, run.trainer.activation_checkpointing)
    if problem is not None:  # validation refuses it before any rank starts
        raise ValueError(problem)
    by_name = dict(parts.model.named_modules())
    model = parts.strategy.parallelize(parts.model, parts.spec.input_shape, grid,
                                       sync_replica_gradients=parts.optimizer_cls.syncs_gradients)
    compiling, problem = compile_targets(model, parts.model, run.trainer.compile)
    if problem is not None:  # validation refuses it before any rank starts
        raise ValueError(problem)
    if compiling:  # inside the recomputed forwards: a recomputation runs the compiled graph
        model.compiled = compile_modules(model, parts.model, compiling, run.trainer.compile,
                                         cache=run.trainer.compile_cache)
    wrapped, rebuilt = checkpoint_modules(model, {name: by_name[name] for name in recomputed})
    if rebuilt:
        get_logger().warning("trainer.activation_checkpointing: %s rebuilt by strategy=%s, "
                             "not recomputed", ", ".join(rebuilt), run.strategy.name)
    model.recomputed = {"modules": wrapped, "rebuilt": rebuilt} if recomputed else None
    return model


EXPORT_DIR = "export"  # trainer.export's folder in the run directory


def _attach_records(training: Training) -> None:
    """What records the run: the activation meter's hooks, rank 0's metrics.jsonl (and
    TensorBoard), and what each checkpoint records of the run."""
    run, run_dir, grid, start = training.run, training.run_dir, training.grid, training.start
    training.model.outer_saved_hooks = (training.meter.pack, training.meter.unpack)
    if grid.rank == 0:
        training.sinks.append(MetricsWriter(
            run_dir.metrics, continue_after=start.step if start.continues_here else None))
        if run.logger == "tensorboard":
            training.sinks.append(TensorBoardWriter(run_dir.path / "tensorboard", start.step))
    training.run_info = {"config": OmegaConf.to_container(OmegaConf.load(run_dir.config)),
                         "strategy": run.strategy.name, "optimizer": run.optimizer.name,
                         "git_commit": git_commit() if grid.rank == 0 else None}


def build_training(run: RunConfig, run_dir: RunDir, grid: ProcessGrid,
                   device: torch.device | None = None) -> Training:
    """This rank's run on `device` (cpu when None), ready for its first step (fresh, or resumed
    from a checkpoint)."""
    torch.manual_seed(run.seed)  # every rank builds the same initial model
    device = torch.device("cpu") if device is None else device
    precision = Precision(run.trainer.precision, device.type)
    costs, rates = _calibration(run, device)
    parts = assemble(run, costs, rates=rates, slowdown=compute_slowdown(grid))
    data = load_data(run, parts, device, precision)
    parts.model.to(device)  # initialised on the host: the same values on every device
    place_whole(parts.model)  # every shard a strategy makes knows where it sits (checkpoints)
    model_config = transformers_config(parts.model)
    state_names = list(kept_tensors(parts.model).tensors)
    starting_weights = _starting_weights(run, parts.model)  # bound before the strategy splits
    predicted, predicted_step, predicted_memory = _predictions(run, parts, grid, precision)
    model = _parallel_model(run, parts, grid)
    optimizer, start = start_or_resume(
        run.trainer.resume, run.trainer.steps, run_dir, grid, model, parts.optimizer_cls,
        lambda: parts.optimizer_cls(model, grid=grid, total_steps=run.trainer.steps,
                                    **run.optimizer.options),
        None if starting_weights is None else lambda: starting_weights(model))
    sampler = EpochSampler(parts.spec.train_size, run.trainer.batch_size, run.seed)
    if start.sampler_state is not None:
        sampler.load_state(start.sampler_state)
    get_logger().info("grid %s, model %d parameters on this rank, dataset %s (%d train, %d val)",
                      grid, sum(p.numel() for p in model.parameters()), run.dataset.name,
                      parts.spec.train_size, parts.spec.val_size)
    scaler = precision.loss_scale()
    if scaler is not None and start.loss_scale is not None:  # a checkpoint of an fp16 run
        scaler.load_state(start.loss_scale)
    training = Training(
        run=run, run_dir=run_dir, grid=grid, model=model, optimizer=optimizer, start=start,
        loss_comm=model.loss_comm, predicted_ops=predicted, predicted_step=predicted_step,
        costs=costs, device=device, precision=precision, scaler=scaler,
        targets_per_sample=math.prod(parts.spec.target_shape), data=data, sampler=sampler,
        state=TrainingState(step=start.step, last_checkpoint=start.checkpoint_path),
        predicted_memory=predicted_memory, meter=SavedTensorMeter(model.parameters()))
    _attach_records(training)
    # what `python -m runner.export` writes: the tensors a state_dict keeps, a config.json
    training.run_info[STATE_NAMES] = state_names
    if model_config is not None:
        training.run_info[MODEL_CONFIG] = model_config
    return training


def _starting_weights(run: RunConfig, plain: nn.Module) -> Callable[[nn.Module], None] | None:
    """How the split model takes `model.weights` (None: it starts from its seed), bound to the
    plain model's names now, before the strategy rebuilds it; a problem is raised when the
    weights are loaded, on a fresh start (a resumed run reads its checkpoint instead)."""
    weights = run.model.weights
    if weights is None:
        return None
    try:
        source, binding = open_bound(weights, plain)
    except WeightsFileError as exc:
        problem = str(exc)

        def refuse(model: nn.Module) -> None:
            raise WeightsFileError(problem)
        return refuse

    def load(model: nn.Module) -> None:
        read = load_weights(source, binding, model)
        get_logger().info("model.weights: %d bytes (%.1f MiB) read from %s", read,
                          read / (1 << 20), weights)
    return load


def _set_up_rank(run: RunConfig, grid: ProcessGrid) -> None:
    """The rank's settings from `debug` (communication isolation, the watchdog's deadline
    floor), and a file-size limit (ulimit -f) made to fail the write with EFBIG, which is
    reported, instead of killing the rank without a word."""
    grid.counter.isolate = run.debug.isolate_comm
    if run.debug.deadline_floor_s is not None:
        grid.counter.pace.floor_s = run.debug.deadline_floor_s
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _train_one_step(t: Training, step: int, stop: StopRequest, progress: ProgressReporter,
                    device_times: DeviceStepTimes) -> tuple[torch.Tensor | None, bool]:
    """Step `step`, timed and logged: its loss where the step left it on the device unread
    (None where it was read), and whether the step carries a stop request."""
    grid, trainer, state = t.grid, t.run.trainer, t.state
    meets = t.optimizer.meets_replicas(step - 1)
    # asynchronous replicas never wait for each other in a step: each step is a round
    grid.counter.pace.begin_step(step, ends_round=meets or t.optimizer.asynchronous)
    # a step that reads its loss waits for the device anyway: its communication seconds are
    # read whole; another's as far as the device has reported them
    reads = t.reads_loss(step)
    began, before = time.perf_counter(), grid.counter.snapshot(wait=reads)
    device_times.begin(len(state.history.seconds))
    # activation memory is measured on the first step and the logged ones (the hooks cost a
    # few microseconds per saved tensor: a quarter of a small MLP's step)
    measured = (step == t.start.step + 1 or step % trainer.log_every == 0
                or step == trainer.steps)
    loss, stopping = train_step(t, t.batch(), step, t.loss_comm if meets else grid.model,
                                t.stop_request(stop.requested, meets),
                                meter=t.meter if measured else None, read_loss=reads,
                                device_times=device_times)
    unread: torch.Tensor | None = None  # the loss, left on the device
    if isinstance(loss, torch.Tensor):
        unread = loss
    else:
        state.loss = loss
    seconds = time.perf_counter() - began
    if reads:  # the device's own times of this step and the unread ones before it
        seconds = device_times.resolve(state.history).get(len(state.history.seconds), seconds)
    t.log_step(step, state.loss if unread is None else None, seconds,
               grid.counter.since(before, wait=reads), progress,
               replica_loss=not meets and grid.pc > 1)
    return unread, stopping


def _stops_here(t: Training, step: int, stopping: bool, stop: StopRequest,
                unread: torch.Tensor | None) -> bool:
    """At a checkpoint step, the last step or a step that carries a stop, the ranks meet
    (collective): whether any of them stops. A checkpoint due on this step is then written."""
    every, pace = t.run.trainer.checkpoint_every, t.grid.counter.pace
    at_end = step == t.run.trainer.steps
    due = every is not None and step % every == 0 and not at_end
    if not (stopping or due or at_end):
        return False
    pace.begin("a stop check", step)  # asynchronous replicas meet here
    if t.anyone_stopping(stopping or stop.requested, step, unread):  # a held request too
        return True
    if due:
        pace.begin("a checkpoint", step)
        t.checkpoint(step)
    return False


def _evaluate_when_due(t: Training, step: int, progress: ProgressReporter) -> None:
    """Evaluate on the steps of `trainer.eval_every` and on the last step."""
    at_end, eval_every = step == t.run.trainer.steps, t.run.trainer.eval_every
    if at_end or (eval_every is not None and step % eval_every == 0):
        t.grid.counter.pace.begin("evaluation", step)
        t.evaluate(step, at_end, progress)


def _export(checkpoint: Path, run_dir: RunDir) -> Path:
    """`trainer.export`: the final checkpoint's model written to RUN_DIR/export (rank 0)."""
    out = run_dir.path / EXPORT_DIR
    try:
        exported = export_checkpoint(ExportRequest(checkpoint, out, force=True))
    except (ExportError, WeightsFileError, OSError) as exc:
        raise StepFailure(f"trainer.export: {exc}") from None
    get_logger().info("exported %d tensors (%.1f MiB) to %s", exported.tensors,
                      exported.total_bytes / (1 << 20), out)
    return out


def _completed(t: Training, started: float) -> dict[str, Any]:
    """The summary of a run that trained every step (collective: every rank's rates and
    devices); rank 0 writes it and prints its table."""
    state, world = t.state, t.grid.world
    rates = world.allgather_object(len(state.history.seconds) / state.history.total_s)
    devices = world.allgather_object(describe_device(t.device))
    summary = completed_summary(t, state, rates, devices, time.perf_counter() - started)
    if t.grid.rank == 0 and t.run.trainer.export and state.last_checkpoint is not None:
        summary["export"] = str(_export(state.last_checkpoint, t.run_dir))
    if t.grid.rank == 0:
        write_json(t.run_dir.summary, summary)
        make_console().print(summary_table(summary))
    get_logger().info("done: final loss %.6f, wall %.2fs", state.loss, summary["wall_time_s"])
    return summary


def train(run: RunConfig, run_dir: RunDir, grid: ProcessGrid,
          device: torch.device | None = None, ends_process: bool = False) -> dict[str, Any]:
    """Train `run` as this rank of `grid` on `device` (cpu when None); returns the summary
    (rank 0 also writes it). `ends_process`: the process ends with the run (a rank's), and
    after a stop ignores the stop signals still on their way (`StopRequest`)."""
    started = time.perf_counter()
    _set_up_rank(run, grid)
    t = build_training(run, run_dir, grid, device)
    start_up_done()  # torch's, the model's and the data's objects: out of later collections
    state, steps = t.state, run.trainer.steps
    stopped_by = None
    title = f"{run.strategy.name} {grid.pr}x{grid.pc}"
    pace = grid.counter.pace  # what the watchdog's deadlines derive from
    device_times = DeviceStepTimes(t.device.type == "cuda")
    with (StopRequest(ends_process) as stop,
          ProgressReporter(grid.rank == 0, steps, title) as progress):
        for step in range(t.start.step + 1, steps + 1):
            state.step = step
            unread, stopping = _train_one_step(t, step, stop, progress, device_times)
            if _stops_here(t, step, stopping, stop, unread):
                stopped_by = stop.signal_name or "a signal to another rank"
                break
            _evaluate_when_due(t, step, progress)
        if stopped_by is not None or run.checkpoints_at_end:
            pace.begin("a checkpoint", state.step)
            t.checkpoint(state.step)
    pace.begin("the end of training", state.step)
    device_times.finish(state.history)
    t.close()
    if stopped_by is not None:
        return interrupted_summary(t, state, stopped_by)
    return _completed(t, started)
