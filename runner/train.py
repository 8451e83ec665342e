"""The training loop every rank runs (the same code at P = 1 and at P = 1000)."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from runner.board import TensorBoardWriter
from runner.checkpoint import (
    Checkpoint,
    CheckpointError,
    TrainingProgress,
    latest_checkpoint,
    load_centre,
    load_training_state,
    resolve_resume,
    resume_command,
    resume_plan,
    sampler_state,
    save_checkpoint,
)
from runner.config import RunConfig
from runner.console import ProgressReporter, make_console, summary_table
from runner.core import CountedComm, Partition, ProcessGrid
from runner.core.cost import step_bytes, step_time
from runner.core.placement import place_whole
from runner.datasets import ClassificationData
from runner.interrupt import StopRequest
from runner.logs import get_logger
from runner.models import dataset_arguments
from runner.optim import ReplicaOptimizer
from runner.plan.calibration import load_alpha_beta
from runner.plan.planner import loss_op
from runner.registry import DATASETS, MODELS, OPTIMIZERS, load_plugins
from runner.rundir import MetricsWriter, RunDir, git_commit, versions, write_json
from strategies import STRATEGIES, ParallelModel


class InjectedFailure(RuntimeError):
    """Raised on purpose by `debug.fail_at_step` (tests of failure handling)."""


def inject_failure(mode: str, rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
    """`debug.fail_mode` on this rank at this step: what a test of failure handling needs."""
    if mode == "raise":
        raise InjectedFailure(f"injected failure on rank {rank} at step {step} "
                              f"(debug.fail_at_step)")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":  # outside any collective: the other ranks wait in their next one
        while True:
            time.sleep(3600)
    if mode == "nan":
        return loss * float("nan")
    return loss


class EpochSampler:
    """Global batches from a seeded permutation per epoch: identical on every rank and for every
    grid, so a run's sample order does not depend on P. Drops the incomplete last batch."""

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position = 0, 0
        self._order = torch.randperm(num_samples, generator=self.generator)

    def state(self) -> dict[str, Any]:
        """Where the sample order stands: the epoch's permutation, the position in it, and
        the generator that draws the next one (restored exactly on resume)."""
        return {"epoch": self.epoch, "position": self.position,
                "generator": self.generator.get_state(), "order": self._order.clone()}

    def load_state(self, state: dict[str, Any]) -> None:
        if len(state["order"]) != self.num_samples:
            raise ValueError(f"the checkpoint's sample order covers {len(state['order'])} "
                             f"samples, this dataset has {self.num_samples}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.generator.set_state(state["generator"])
        self._order = state["order"].clone()

    def next_batch(self) -> torch.Tensor:
        if self.position + self.batch_size > self.num_samples:
            self.epoch += 1
            self.position = 0
            self._order = torch.randperm(self.num_samples, generator=self.generator)
        batch = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch


@dataclass
class Evaluation:
    loss: float
    accuracy: float


def _score(model: ParallelModel, x: torch.Tensor, targets: torch.Tensor,
           comm: CountedComm) -> Evaluation:
    """Loss and accuracy of `model` fed `x`, each rank scoring its output rows, summed over
    `comm`."""
    model.eval()
    with torch.no_grad():
        out = model(x)
        stats = torch.tensor([F.cross_entropy(out, targets, reduction="sum").item(),
                              (out.argmax(dim=1) == targets).sum().item(), float(len(targets))],
                             dtype=torch.float64)
    model.train()
    comm.allreduce_(stats, label="eval")
    loss_sum, correct, count = stats.tolist()
    return Evaluation(loss_sum / count, correct / count)


def evaluate(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
    """Validation loss and accuracy over the whole set, its rows split over all ranks."""
    return _score(model, x[model.input_rows(len(x))], y[model.output_rows(len(x))],
                  model.loss_comm)


def evaluate_replica(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
    """This replica's (model group's) own weights on the whole set, with no other replica
    taking part: the group is fed every row and each rank scores its sub-shard."""
    grid = model.grid
    return _score(model, x, y[Partition(len(x), grid.pr).slice(grid.model_index)], grid.model)


def validation(model: ParallelModel, optimizer: ReplicaOptimizer, x: torch.Tensor,
               y: torch.Tensor, everyone: bool) -> dict[str, float] | None:
    """The validation line: the model's loss and accuracy, or for an optimizer with a centre
    variable the centre's, next to the workers' mean (`everyone`: every replica takes part) or
    replica 0's own (asynchronous runs mid-way: replica 0 alone, so nobody waits; other
    replicas return None)."""
    if not optimizer.has_centre:
        result = evaluate(model, x, y)
        return {"loss": result.loss, "accuracy": result.accuracy}
    grid = model.grid
    if everyone:
        with optimizer.centre_weights():
            centre = evaluate(model, x, y)
        own = evaluate_replica(model, x, y)
        workers = torch.tensor([own.loss, own.accuracy], dtype=torch.float64)
        grid.batch.allreduce_(workers, label="eval")
        workers_loss, workers_accuracy = (workers / grid.pc).tolist()
        return {"loss": centre.loss, "accuracy": centre.accuracy, "workers_loss": workers_loss,
                "workers_accuracy": workers_accuracy}
    if grid.batch_index != 0:
        return None
    with optimizer.centre_weights():
        centre = evaluate_replica(model, x, y)
    own = evaluate_replica(model, x, y)
    return {"loss": centre.loss, "accuracy": centre.accuracy, "worker0_loss": own.loss,
            "worker0_accuracy": own.accuracy}


def sparse_line(model: ParallelModel) -> dict[str, Any]:
    """The metrics line's record of the sparse tables' exchange this step (nothing without)."""
    report = model.exchange_report()
    if not report:
        return {}
    return {"sparse": {name: {k: v for k, v in table.items() if k != "steps_by_mode"}
                       for name, table in report.items()}}


def mean_loss(loss: torch.Tensor, comm: CountedComm, stop: bool) -> tuple[float, bool]:
    """The mean over the rows of the ranks of `comm` (the mean of their (P/B)-scaled sums: over
    the world the global batch, over a model group that replica's rows), and whether any of
    them was asked to stop: one all-reduce, so they all stop after the same step."""
    buffer = torch.tensor([loss.item(), float(stop)], dtype=loss.dtype)
    comm.allreduce_(buffer, label="loss")
    return buffer[0].item() / comm.size, bool(buffer[1].item())


class StepFailure(RuntimeError):
    """A failure every rank meets at the same step (a non-finite loss, a checkpoint that could
    not be written): the job ends without any rank having to abort the others."""


def _anyone(grid: ProcessGrid, stopping: bool) -> bool:
    flag = torch.tensor([int(stopping)], dtype=torch.int32)
    grid.world.allreduce_(flag, label="stop")
    return bool(flag.item())


def _interrupted(run_dir: RunDir, grid: ProcessGrid, step: int, signal_name: str,
                 checkpoint: Path | None) -> dict[str, Any]:
    """The summary of a run stopped by a signal after writing its checkpoint."""
    command = resume_command(run_dir.path)
    message = (f"interrupted by {signal_name} after step {step}: checkpoint written to "
               f"{checkpoint}; to continue: {command}")
    summary = {"status": "interrupted", "step": step, "signal": signal_name,
               "checkpoint": str(checkpoint), "resume_command": command, "message": message,
               "run_dir": str(run_dir.path)}
    if grid.rank == 0:
        write_json(run_dir.summary, summary)
    get_logger().info("%s", message)
    return summary


def _setup_checkpoints(run: RunConfig, run_dir: RunDir, grid: ProcessGrid) -> Checkpoint | None:
    """The checkpoint to resume from (None: a fresh start). A run that does not continue this
    directory's own checkpoints moves them aside, so that `resume=auto` never mixes runs."""
    found = None
    if grid.rank == 0:
        found = resolve_resume(run.trainer.resume, run_dir.checkpoints)
        continues_here = found is not None and found.parent == run_dir.checkpoints
        if not continues_here and latest_checkpoint(run_dir.checkpoints) is not None:
            aside = run_dir.path / f"checkpoints.before-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir.checkpoints.rename(aside)
            get_logger().info("an earlier run's checkpoints moved to %s", aside)
    found = grid.world.allgather_object(found)[0]
    return None if found is None else Checkpoint(found)


def train(run: RunConfig, run_dir: RunDir, grid: ProcessGrid) -> dict[str, Any]:
    load_plugins()
    log = get_logger()
    is_rank0 = grid.rank == 0
    grid.counter.isolate = run.debug.isolate_comm
    started = time.perf_counter()
    torch.manual_seed(run.seed)
    # A file-size limit (ulimit -f) then fails the write with EFBIG, which is reported, instead
    # of killing the rank without a word.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    dataset = DATASETS.get(run.dataset.name)(**run.dataset.options)
    spec = dataset.spec()
    data: ClassificationData = dataset.load()
    dtype = getattr(torch, run.trainer.dtype)
    if data.train_x.is_floating_point():  # token ids stay integers
        data.train_x, data.val_x = data.train_x.to(dtype), data.val_x.to(dtype)
    # Built in float32 from the seed, then converted: the same initial values in either dtype.
    factory = MODELS.get(run.model.name)
    model = factory(spec.input_shape, spec.num_classes,
                    **dataset_arguments(factory, spec), **run.model.options)
    model = model.to(dtype)
    place_whole(model)  # every shard a strategy makes knows where it sits (checkpoints)
    strategy = STRATEGIES.get(run.strategy.name)(**run.strategy.options)
    alpha_beta = load_alpha_beta()
    strategy.alpha_beta = (alpha_beta.alpha, alpha_beta.beta)
    strategy.local_costs = (alpha_beta.table_pass, alpha_beta.sparse_row)
    strategy.rows_touched = getattr(dataset, "expected_unique_tokens", None)
    optimizer_cls = OPTIMIZERS.get(run.optimizer.name)
    # The planner models synchronous gradient exchange only: no prediction for other optimizers.
    predicted_ops = (strategy.predict_ops(model, spec.input_shape, grid.shape,
                                          run.trainer.batch_size) + loss_op(grid.shape, dtype)
                     if optimizer_cls.syncs_gradients else None)
    pmodel = strategy.parallelize(model, spec.input_shape, grid,
                                  sync_replica_gradients=optimizer_cls.syncs_gradients)
    checkpoint = _setup_checkpoints(run, run_dir, grid)
    plan = None
    if checkpoint is not None:
        plan = resume_plan(checkpoint, optimizer_cls.per_replica, optimizer_cls.has_centre, grid)
        load_centre(checkpoint, plan, pmodel)  # the optimizer takes its centre from the model
    optimizer: ReplicaOptimizer = optimizer_cls(pmodel, grid=grid,
                                                total_steps=run.trainer.steps,
                                                **run.optimizer.options)
    sampler = EpochSampler(spec.train_size, run.trainer.batch_size, run.seed)
    start_step, time_offset = 0, 0.0
    if checkpoint is not None and plan is not None:
        for note in load_training_state(checkpoint, plan, pmodel, optimizer, grid):
            log.info("resume: %s", note)
        sampler.load_state(sampler_state(checkpoint))
        start_step, time_offset = checkpoint.step, float(checkpoint.manifest["time_s"])
        if start_step >= run.trainer.steps:
            raise StepFailure(f"nothing to train: {checkpoint.path} is at step {start_step} and "
                              f"trainer.steps={run.trainer.steps} (raise trainer.steps to train "
                              f"on)")
        log.info("resumed from %s (step %d)", checkpoint.path, start_step)
        if is_rank0:
            make_console().print(f"resuming from {checkpoint.path} at step {start_step}")
    # An asynchronous optimizer's replicas never meet during a step: the loss shown is then
    # replica 0's (the mean over its rows), reduced over its model group only.
    loss_comm = grid.model if optimizer.asynchronous else pmodel.loss_comm
    log.info("grid %s, model %d parameters on this rank, dataset %s (%d train, %d val)", grid,
             sum(p.numel() for p in pmodel.parameters()), run.dataset.name, spec.train_size,
             spec.val_size)

    input_rows = pmodel.input_rows(run.trainer.batch_size)
    output_rows = pmodel.output_rows(run.trainer.batch_size)
    resumed_here = checkpoint is not None and checkpoint.path.parent == run_dir.checkpoints
    sinks: list[Any] = []
    if is_rank0:
        sinks.append(MetricsWriter(run_dir.metrics,
                                   continue_after=start_step if resumed_here else None))
        if run.logger == "tensorboard":
            sinks.append(TensorBoardWriter(run_dir.path / "tensorboard", start_step))
    run_info = {"config": OmegaConf.to_container(OmegaConf.load(run_dir.config)),
                "strategy": run.strategy.name, "optimizer": run.optimizer.name,
                "git_commit": git_commit() if is_rank0 else None}
    last_checkpoint = checkpoint.path if checkpoint is not None else None
    step_times: list[float] = []
    comm_bytes: list[int] = []
    comm_seconds: list[float] = []
    loss_value = float("nan")
    evaluation: dict[str, float] | None = None
    slow = run.debug.slow_seconds if grid.rank == run.debug.slow_rank else 0.0
    steps, title = run.trainer.steps, f"{run.strategy.name} {grid.pr}x{grid.pc}"
    batch_size, every = run.trainer.batch_size, run.trainer.checkpoint_every
    step, stopped_by = start_step, None

    def write(record: dict[str, Any]) -> None:
        for sink in sinks:
            sink.write(record)

    def checkpoint_now(at: int) -> Path:
        progress_state = TrainingProgress(at, time_offset + sum(step_times), sampler.state())
        try:
            return save_checkpoint(run_dir.checkpoints, progress_state, pmodel, optimizer, grid,
                                   run_info, run.trainer.keep_checkpoints)
        except CheckpointError as exc:
            kept = f"the latest complete one is {last_checkpoint}" if last_checkpoint else \
                "there is no earlier checkpoint"
            raise StepFailure(f"{exc}; {kept}") from None

    with StopRequest() as stop, ProgressReporter(is_rank0, steps, title) as progress:
        for step in range(start_step + 1, steps + 1):
            start = time.perf_counter()
            before = grid.counter.snapshot()
            if slow:  # debug.slow_rank: a straggler on purpose
                time.sleep(slow)
            batch = sampler.next_batch()
            x, y = data.train_x[batch[input_rows]], data.train_y[batch[output_rows]]
            pmodel.zero_grad()
            # (P/B) x this rank's sum: the mean over the P ranks is the global mean loss, for any
            # split of the rows (see strategies/base.py)
            loss = F.cross_entropy(pmodel(x), y, reduction="sum") * (grid.size / batch_size)
            if run.debug.fail_at_step == step and grid.rank == run.debug.fail_on_rank:
                loss = inject_failure(run.debug.fail_mode, grid.rank, step, loss)
            loss.backward()
            pmodel.finish_gradient_sync()
            optimizer.step(step - 1)
            loss_value, stopping = mean_loss(loss, loss_comm, stop.requested)
            elapsed = time.perf_counter() - start
            comm = grid.counter.since(before)
            step_times.append(elapsed)
            comm_bytes.append(comm.nbytes)
            comm_seconds.append(comm.seconds)
            rate = run.trainer.batch_size / elapsed
            if step % run.trainer.log_every == 0 or step == steps or not math.isfinite(loss_value):
                write({"step": step, "time_s": time_offset + sum(step_times),
                       "loss": loss_value, "lr": optimizer.lr,
                       "step_time_s": elapsed, "comm_time_s": comm.seconds,
                       "comm_bytes": comm.nbytes, "comm_share": comm.seconds / elapsed,
                       "samples_per_s": rate, **sparse_line(pmodel)})
            progress.step(step, loss_value, rate)
            if step % run.trainer.log_every == 0:
                log.info("step %d loss %.6f step_time %.4fs comm %.4fs %d B", step, loss_value,
                         elapsed, comm.seconds, comm.nbytes)
            if not math.isfinite(loss_value):  # every rank sees the same all-reduced loss
                kept = (f"the last good checkpoint is {last_checkpoint}" if last_checkpoint
                        else "no checkpoint was written (trainer.checkpoint_every)")
                raise StepFailure(f"the loss is {loss_value} at step {step}: training stopped; "
                                  f"{kept}. Lower optimizer.lr, or check the data")
            at_end = step == steps
            due = bool(every) and step % every == 0 and not at_end
            if stopping or due or at_end:
                # Asynchronous replicas each stop when they see the signal: meet over the world
                # (every rank comes here at its checkpoint steps, its last step, or its stop).
                if _anyone(grid, stopping):
                    stopped_by = stop.signal_name or "a signal to another rank"
                    break
                if due:
                    last_checkpoint = checkpoint_now(step)
            eval_every = run.trainer.eval_every
            if at_end or (eval_every and step % eval_every == 0):
                if at_end and optimizer.asynchronous:
                    grid.world.barrier()  # every worker's last exchange is in the centre
                result = validation(pmodel, optimizer, data.val_x, data.val_y,
                                    everyone=at_end or not optimizer.asynchronous)
                if result is not None:
                    evaluation = result
                    log.info("step %d val %s", step, json.dumps(result))
                    progress.evaluation(step, result["loss"], result["accuracy"])
                    write({"step": step, "split": "val",
                           "time_s": time_offset + sum(step_times), **result})
        if stopped_by is not None or every:
            last_checkpoint = checkpoint_now(step)
    for sink in sinks:
        sink.close()
    pmodel.refresh_copies()
    optimizer.close()
    if stopped_by is not None:
        return _interrupted(run_dir, grid, step, stopped_by, last_checkpoint)
    rates = grid.world.allgather_object(len(step_times) / sum(step_times))

    wall = time.perf_counter() - started
    param_bytes = pmodel.param_bytes()
    summary: dict[str, Any] = {
        "status": "completed",
        "strategy": run.strategy.name,
        "optimizer": run.optimizer.name,
        "grid": {"pr": grid.pr, "pc": grid.pc},
        "world_size": grid.size,
        "steps": steps,
        "final_loss": loss_value,
        "val_loss": evaluation["loss"] if evaluation else None,
        "val_accuracy": evaluation["accuracy"] if evaluation else None,
        # with a centre variable: val_* are the centre's, workers_val_* the replicas' mean
        "workers_val_loss": evaluation.get("workers_loss") if evaluation else None,
        "workers_val_accuracy": evaluation.get("workers_accuracy") if evaluation else None,
        "wall_time_s": wall,
        "mean_step_time_s": statistics.fmean(step_times),
        "median_step_time_s": statistics.median(step_times),
        "samples_per_s": run.trainer.batch_size / statistics.median(step_times),
        "comm_bytes_per_step": statistics.fmean(comm_bytes),
        "predicted_comm_bytes_per_step": (step_bytes(predicted_ops)
                                          if predicted_ops is not None else None),
        "comm_time_s_per_step": statistics.fmean(comm_seconds),
        "predicted_comm_time_s_per_step": (
            step_time(predicted_ops, alpha_beta.alpha, alpha_beta.beta)
            if predicted_ops is not None else None),
        "alpha_beta": {"alpha": alpha_beta.alpha, "beta": alpha_beta.beta,
                       "source": alpha_beta.source},
        "comm_time_share": sum(comm_seconds) / sum(step_times),
        "steps_per_s_by_rank": rates,
        "sparse_exchange": pmodel.exchange_report() or None,
        "param_bytes_per_rank": param_bytes,
        "seed": run.seed,
        "versions": versions(),
        "git_commit": git_commit() if is_rank0 else None,
        "run_dir": str(run_dir.path),
        "resumed_from": ({"checkpoint": str(checkpoint.path), "step": start_step}
                         if checkpoint is not None else None),
        "checkpoint": str(last_checkpoint) if last_checkpoint is not None else None,
    }
    if is_rank0:
        write_json(run_dir.summary, summary)
        make_console().print(summary_table(summary))
    log.info("done: final loss %.6f, wall %.2fs", loss_value, wall)
    return summary

