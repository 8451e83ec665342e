"""Starting a run, fresh or from a checkpoint, in one call (`start_or_resume`).

Order matters, and it lives here rather than in the loop: the centre of an EASGD checkpoint goes
into the model before the optimizer is built (the optimizer takes its centre from the weights),
the weights, optimizer state and RNG after. A run never starts in a directory that holds another
run's checkpoints (`preflight.owner_problem`), so `resume=auto` never mixes two runs.

Which checkpoint: rank 0 resolves `trainer.resume` with the head's own verification
(`find_resume_checkpoint`: `auto` skips damaged checkpoints exactly as the head's
`verify_resume` did, so the ranks resume from the checkpoint the head checked) and the others
follow. Every rank then reads and verifies the shards it needs before anything collective; a
damaged shard or a checkpoint that does not fit is one line on every rank (`StepFailure`), not
a traceback per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from runner.checkpoint.layout import CheckpointError
from runner.checkpoint.read import Checkpoint
from runner.checkpoint.resume import (
    ResumePlan,
    find_resume_checkpoint,
    load_centre,
    load_training_state,
    prepare_resume,
    resume_plan,
    sampler_state,
)
from runner.core import ProcessGrid
from runner.optim.sync import ReplicaOptimizer
from runner.records.console import make_console
from runner.records.logs import get_logger
from runner.records.rundir import RunDir
from runner.training.state import Start
from runner.training.step import StepFailure
from runner.weights.safetensors_file import WeightsFileError
from strategies import ParallelModel

T = TypeVar("T")


def _on_every_rank(grid: ProcessGrid, action: Callable[[], T], what: str = "cannot resume"
                   ) -> T:
    """Collective over the world: `action`'s result on this rank; when it raised
    `CheckpointError` (or `WeightsFileError`) on any rank, `StepFailure` with that rank's one
    line on every rank."""
    results: list[T] = []
    error = None
    try:
        results.append(action())
    except (CheckpointError, WeightsFileError) as exc:
        error = str(exc)
    errors = grid.world.allgather_object(error)
    failed = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
    if failed is not None:
        where = f"rank {failed[0]}: " if grid.size > 1 else ""
        raise StepFailure(f"{what}: {where}{failed[1]}")
    return results[0]


def _resolve(resume: str | None, run_dir: RunDir) -> Path | None:
    """Rank 0: the checkpoint to resume from, by the head's verification."""
    log = get_logger()
    # A named checkpoint's shards are hashed as the ranks load them (the head verified them
    # already); `auto` reads every candidate, to skip exactly what the head skipped.
    found, notes = find_resume_checkpoint(resume, run_dir.checkpoints, read_named=False)
    for note in notes:
        log.warning("resume: %s", note)
    return found


def _find_checkpoint(resume: str | None, run_dir: RunDir, grid: ProcessGrid) -> Path | None:
    """Rank 0 resolves `trainer.resume`; every rank learns the answer."""
    found = _on_every_rank(grid, lambda: _resolve(resume, run_dir) if grid.rank == 0 else None)
    answer: Path | None = grid.world.allgather_object(found)[0]
    return answer


def _open_checkpoint(path: Path, grid: ProcessGrid, model: ParallelModel,
                     optimizer_cls: type[ReplicaOptimizer]) -> tuple[Checkpoint, ResumePlan]:
    """This rank's view of the checkpoint, its plan, and the shards it needs read and
    verified."""
    checkpoint = Checkpoint(path)
    plan = resume_plan(checkpoint, optimizer_cls.per_replica, optimizer_cls.has_centre, grid)
    prepare_resume(checkpoint, plan, model, grid)
    return checkpoint, plan


def start_or_resume(resume: str | None, total_steps: int, run_dir: RunDir, grid: ProcessGrid,
                    model: ParallelModel, optimizer_cls: type[ReplicaOptimizer],
                    make_optimizer: Callable[[], ReplicaOptimizer],
                    load_weights: Callable[[], object] | None = None
                    ) -> tuple[ReplicaOptimizer, Start]:
    """The replica optimizer (built by `make_optimizer` at the right moment) and where training
    starts; a fresh start first loads `load_weights` (`model.weights`: a resumed run has its
    checkpoint's). Raises `StepFailure` when the checkpoint already has every step."""
    path = _find_checkpoint(resume, run_dir, grid)
    if path is None:
        if load_weights is not None:  # before the optimizer: EASGD's centre is the weights
            _on_every_rank(grid, load_weights, "cannot load model.weights")
        return make_optimizer(), Start()
    checkpoint, plan = _on_every_rank(
        grid, lambda: _open_checkpoint(path, grid, model, optimizer_cls))
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
        make_console().print(f"resuming from {checkpoint.path} at step {checkpoint.step}",
                             markup=False)
    start = Start(checkpoint.step, float(checkpoint.manifest["time_s"]),
                  sampler_state(checkpoint), checkpoint,
                  checkpoint.path.parent == run_dir.checkpoints,
                  checkpoint.manifest.get("loss_scale"))
    checkpoint.release()  # the shards' tensors are copied out: training keeps none of them
    return optimizer, start
