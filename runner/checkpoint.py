"""Sharded checkpoints, written atomically, loadable onto any grid and strategy.

    checkpoints/step-00000020/
        rank-00000.pt …   each rank's tensors (a flat dict of tensors, loaded `weights_only`)
        manifest.json     written last, by rename: only a checkpoint with a manifest exists

Every tensor is recorded by its placement in the sequential model (`runner.core.placement`):
kind (`model`, `centre`, `momentum`, `velocity`), replica (for optimizers whose replicas differ,
the EASGD family; none when they agree), global name and rows. Of the ranks holding the same
rows, only the lowest writes them. Loading copies into each local tensor the rows it needs from
the shards that hold them, so a checkpoint written on one grid resumes on another.

Saving is collective over the world: the ranks first agree on who writes what, then each writes
its file (temporary name, fsync, rename), then they share what went wrong, and rank 0 writes the
manifest only when every file is in place. A failed write leaves no manifest, so the previous
checkpoint stays the latest.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from runner.core import ProcessGrid
from runner.core.placement import Placement, as_rows, placement_of
from runner.optim import ReplicaOptimizer
from runner.rundir import atomic_write_text, nearest_existing
from strategies import ParallelModel

FORMAT = 1
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or does not fit the model."""


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{STEP_PREFIX}{step:08d}"


def shard_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """The complete checkpoints under `checkpoints`, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir()
             if p.name.startswith(STEP_PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(checkpoints: Path) -> Path | None:
    found = complete_checkpoints(checkpoints)
    return found[-1] if found else None


def resolve_resume(resume: str | None, checkpoints: Path | None) -> Path | None:
    """The checkpoint `trainer.resume` names: `auto` the run directory's latest (None when
    there is none yet: a fresh start), a checkpoint directory, or a run directory (its
    latest). Raises `CheckpointError` for a path without a complete checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        return None if checkpoints is None else latest_checkpoint(checkpoints)
    path = Path(resume).expanduser()
    if is_complete(path):
        return path
    latest = latest_checkpoint(path / "checkpoints")
    if latest is not None:
        return latest
    raise CheckpointError(f"trainer.resume={resume}: no complete checkpoint there (a "
                          f"checkpoint directory holds {MANIFEST}; a run directory holds "
                          f"checkpoints/{STEP_PREFIX}*)")


# -- what a rank holds -----------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One tensor of a shard file."""

    kind: str
    replica: int | None
    name: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def key(self) -> str:
        replica = "-" if self.replica is None else str(self.replica)
        return f"{self.kind}/{replica}/{self.name}/{self.start}:{self.stop}"

    def to_json(self) -> list[Any]:
        return [self.kind, self.replica, self.name, list(self.shape), self.start, self.stop]

    @classmethod
    def from_json(cls, item: list[Any]) -> Entry:
        kind, replica, name, shape, start, stop = item
        return cls(kind, replica, name, tuple(shape), start, stop)


def _placement(param: torch.Tensor) -> Placement:
    place = placement_of(param)
    if place is None:
        raise CheckpointError("a parameter of the parallel model has no placement: the "
                              "strategy made it without `place_rows`")
    return place


def _placements(model: ParallelModel) -> list[Placement]:
    return [_placement(param) for param in model.parameters()]


def _entries(kind: str, replica: int | None, places: list[Placement],
             tensors: Sequence[torch.Tensor | None]) -> Iterator[tuple[Entry, torch.Tensor]]:
    for place, tensor in zip(places, tensors, strict=True):
        if tensor is not None:
            entry = Entry(kind, replica, place.name, place.shape, place.start, place.stop)
            yield entry, tensor.detach().clone()  # a slice would save its whole storage


def _held_tensors(model: ParallelModel, optimizer: ReplicaOptimizer,
                  grid: ProcessGrid) -> list[tuple[Entry, torch.Tensor]]:
    """Everything this rank holds that a checkpoint keeps (collective: reads the centre)."""
    places = _placements(model)
    replica = grid.batch_index if optimizer.per_replica else None
    params = list(model.parameters())
    held = list(_entries("model", replica, places, params))
    for kind, tensors in optimizer.param_states().items():
        held += _entries(kind, replica, places, tensors)
    if optimizer.has_centre:
        with optimizer.centre_weights():
            held += _entries("centre", None, places, list(model.parameters()))
    return held


# -- saving ----------------------------------------------------------------------------------

@dataclass
class TrainingProgress:
    """What a checkpoint restores besides tensors: where training stands."""

    step: int
    time_s: float  # training seconds so far (metrics' `time_s` continues from it)
    sampler: dict[str, Any]  # EpochSampler.state(): epoch, position, generator, order


class _KeepFirstError:
    """A file whose first write error survives torch.save, which reports any failed write as
    a RuntimeError about stream positions."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.file.flush()


def _write_shard(path: Path, payload: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        writer = _KeepFirstError(f)
        try:
            torch.save(payload, cast("IO[bytes]", writer))
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(checkpoints: Path, progress: TrainingProgress, model: ParallelModel,
                    optimizer: ReplicaOptimizer, grid: ProcessGrid, run_info: dict[str, Any],
                    keep: int | None = None) -> Path:
    """Collective over the world: write a checkpoint and return its path. Raises
    `CheckpointError` on every rank when any rank's write failed.

    Its step is the least step of the ranks: they agree under synchronous optimizers, while
    asynchronous replicas stopped by a signal may stand at different steps (each keeps its own
    weights; a resume continues from the least)."""
    model.refresh_copies()  # rows a parameter-server exchange left stale on non-owners
    held = _held_tensors(model, optimizer, grid)
    # Agree on the step and on who writes what (the lowest rank holding the same rows).
    everyone = grid.world.allgather_object(([e for e, _ in held], progress.step))
    step = min(s for _, s in everyone)
    path = step_dir(checkpoints, step)
    error = None
    if grid.rank == 0:
        error = _attempt(lambda: _fresh_directory(path))
    _raise_first(grid.world.allgather_object(error), step)
    writer: dict[str, int] = {}
    for rank, (entries, _) in enumerate(everyone):
        for entry in entries:
            writer.setdefault(entry.key, rank)
    payload = {e.key: t for e, t in held if writer[e.key] == grid.rank}
    payload["rng"] = torch.get_rng_state()
    if grid.rank == 0:
        payload["sampler/generator"] = progress.sampler["generator"]
        payload["sampler/order"] = progress.sampler["order"]
    error = _attempt(lambda: _write_shard(path / shard_file(grid.rank), payload))
    _raise_first(grid.world.allgather_object(error), step, path if grid.rank == 0 else None)
    if grid.rank == 0:
        manifest = {
            "format": FORMAT, "step": step, "time_s": progress.time_s,
            "world_size": grid.size, "grid": {"pr": grid.pr, "pc": grid.pc},
            "per_replica": optimizer.per_replica, "rank_steps": [s for _, s in everyone],
            "sampler": {"epoch": progress.sampler["epoch"],
                        "position": progress.sampler["position"]},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"), **run_info,
            "files": {shard_file(rank): [e.to_json() for e in entries if writer[e.key] == rank]
                      for rank, (entries, _) in enumerate(everyone)}}
        error = _attempt(lambda: atomic_write_text(path / MANIFEST,
                                                   json.dumps(manifest, indent=1) + "\n"))
    _raise_first(grid.world.allgather_object(error), step, path if grid.rank == 0 else None)
    if grid.rank == 0 and keep:
        for old in complete_checkpoints(checkpoints)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _fresh_directory(path: Path) -> None:
    """An empty directory for this step's files (a crash may have left a partial one)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _attempt(write: Any) -> str | None:
    """Run a filesystem action; its error as one line, or None."""
    try:
        write()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _raise_first(errors: list[str | None], step: int, incomplete: Path | None = None) -> None:
    """Every rank raises the same error when any rank failed (`incomplete`: remove it)."""
    failure = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
    if failure is None:
        return
    if incomplete is not None:
        shutil.rmtree(incomplete, ignore_errors=True)  # best effort: it has no manifest anyway
    raise CheckpointError(f"checkpoint at step {step} not written: rank {failure[0]}: "
                          f"{failure[1]}")


# -- loading ---------------------------------------------------------------------------------

class Checkpoint:
    """A complete checkpoint, read lazily: shard files are memory-mapped when first needed and
    only the rows a rank asks for are copied."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: not a complete checkpoint ({exc})") from None
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{path}: checkpoint format {self.manifest.get('format')}, "
                                  f"this version reads {FORMAT}")
        self.entries = [(file, Entry.from_json(item))
                        for file, items in self.manifest["files"].items() for item in items]
        self._open: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def _file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._open:
            # weights_only: tensors and plain containers, never arbitrary pickled objects
            self._open[name] = torch.load(self.path / name, map_location="cpu", mmap=True,
                                          weights_only=True)
        return self._open[name]

    def has(self, kind: str) -> bool:
        return any(entry.kind == kind for _, entry in self.entries)

    def read_into(self, kind: str, replica: int | None, place: Placement,
                  out: torch.Tensor, optional: bool = False) -> bool:
        """Copy rows [place.start, place.stop) of `kind`'s tensor `place.name` into `out`;
        `optional`: False instead of an error when the checkpoint has none of it."""
        covered = 0
        target = as_rows(out)
        for file, entry in self.entries:
            if entry.kind != kind or entry.replica != replica or entry.name != place.name:
                continue
            if entry.shape != place.shape:
                raise CheckpointError(
                    f"{self.path.name}: {place.name} has shape {list(entry.shape)} in the "
                    f"checkpoint and {list(place.shape)} in this model (a different model or "
                    f"dataset?)")
            rows = Placement(entry.name, entry.shape, entry.start, entry.stop).overlap(
                place.start, place.stop)
            if rows is None:
                continue
            source = as_rows(self._file(file)[entry.key])
            target[rows[0] - place.start:rows[1] - place.start].copy_(
                source[rows[0] - entry.start:rows[1] - entry.start])
            covered += rows[1] - rows[0]
        if covered != place.rows and not (optional and covered == 0):
            raise CheckpointError(f"{self.path.name}: no {kind} rows {place.start}:{place.stop} "
                                  f"of {place.name} (a different model?)")
        return covered > 0

    def read_tensors(self, kind: str, replica: int | None,
                     like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`kind`'s values for tensors shaped and placed like the parameters `like`."""
        return [value for value in self.read_states(kind, replica, like, optional=False)
                if value is not None]

    def read_states(self, kind: str, replica: int | None, like: Sequence[torch.Tensor],
                    optional: bool = True) -> list[torch.Tensor | None]:
        """As `read_tensors`; `optional`: None for a parameter the optimizer kept no state for."""
        out: list[torch.Tensor | None] = []
        for param in like:
            value = torch.empty_like(param.detach())
            found = self.read_into(kind, replica, _placement(param), value, optional=optional)
            out.append(value if found else None)
        return out

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        return self._file(shard_file(rank))


def _copy_into(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, value in zip(params, values, strict=True):
            param.copy_(value)


@dataclass(frozen=True)
class ResumePlan:
    """Which of a checkpoint's tensors become this rank's weights, centre and state."""

    weights: tuple[str, int | None]
    centre: tuple[str, int | None] | None
    states_replica: int | None
    same_replicas: bool


def resume_plan(checkpoint: Checkpoint, per_replica: bool, has_centre: bool,
                grid: ProcessGrid) -> ResumePlan:
    """Replicas' own weights when the checkpoint has them for the same replicas; otherwise the
    weights all replicas agree on (the centre of an EASGD checkpoint)."""
    saved_per_replica = bool(checkpoint.manifest["per_replica"])
    same_replicas = (saved_per_replica and per_replica
                     and checkpoint.manifest["grid"]["pc"] == grid.pc)
    if same_replicas:
        weights: tuple[str, int | None] = ("model", grid.batch_index)
    elif saved_per_replica:
        weights = ("centre", None)
    else:
        weights = ("model", None)
    centre = None
    if has_centre:
        centre = ("centre", None) if checkpoint.has("centre") else ("model", None)
    return ResumePlan(weights, centre, grid.batch_index if same_replicas else None,
                      same_replicas or not saved_per_replica)


def load_centre(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel) -> None:
    """Before the optimizer is built (it takes its centre from the model's weights)."""
    if plan.centre is not None:
        params = list(model.parameters())
        _copy_into(params, checkpoint.read_tensors(*plan.centre, params))


def load_training_state(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel,
                        optimizer: ReplicaOptimizer, grid: ProcessGrid) -> list[str]:
    """The weights, the optimizer's per-parameter state and this rank's RNG; returns what
    could not be restored exactly (for the log)."""
    params = list(model.parameters())
    _copy_into(params, checkpoint.read_tensors(*plan.weights, params))
    notes = []
    for kind in optimizer.state_kinds():
        if plan.same_replicas and checkpoint.has(kind):
            optimizer.load_param_states(
                {kind: checkpoint.read_states(kind, plan.states_replica, params)})
        else:
            notes.append(f"optimizer state '{kind}' starts from zero (not in the checkpoint "
                         f"for these replicas)")
    same_grid = checkpoint.manifest["grid"] == {"pr": grid.pr, "pc": grid.pc}
    torch.set_rng_state(checkpoint.rank_state(grid.rank if same_grid else 0)["rng"])
    if not same_grid:
        notes.append("random state taken from rank 0 (the checkpoint's grid differs)")
    return notes


def sampler_state(checkpoint: Checkpoint) -> dict[str, Any]:
    rank0 = checkpoint.rank_state(0)
    return {**checkpoint.manifest["sampler"], "generator": rank0["sampler/generator"],
            "order": rank0["sampler/order"]}


# -- after an interruption -------------------------------------------------------------------

def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its own overrides, its directory, resume=auto."""
    overrides: list[str] = []
    try:
        import yaml

        saved = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
        overrides = [str(o) for o in saved
                     if not str(o).startswith(("trainer.resume=", "hydra.run.dir="))]
    except (OSError, ImportError, ValueError):
        pass
    words = [*overrides, f"hydra.run.dir={run_dir}", "trainer.resume=auto"]
    return " ".join(["python -m runner", *map(shlex.quote, words)])


# -- before training: room for the checkpoints -----------------------------------------------

def checkpoint_bytes(param_bytes: int, replicas: int, per_replica: bool, has_centre: bool,
                     state_kinds: int) -> int:
    """Bytes of one checkpoint: the weights (each replica's own when they differ), the centre,
    and the optimizer's per-parameter state alongside the weights."""
    copies = replicas if per_replica else 1
    return param_bytes * (copies * (1 + state_kinds) + int(has_centre))


def space_problem(directory: Path, needed: int, what: str) -> str | None:
    """One line when the filesystem of `directory` (or its nearest existing ancestor) has less
    than `needed` bytes free."""
    existing = nearest_existing(directory)
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return (f"not enough disk space under {existing}: {what} need about {_mib(needed)}, "
            f"{_mib(free)} free")


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"
