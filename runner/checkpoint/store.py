"""Sharded checkpoints, written atomically, loadable onto any grid and strategy, and checked
before anything is loaded from them.

    checkpoints/step-00000020/
        rank-00000.pt …   each rank's tensors (a flat dict of tensors, loaded `weights_only`)
        manifest.json     written last, by rename: only a checkpoint with a manifest exists

Every tensor is recorded by its placement in the sequential model (`runner.core.placement`):
kind (`model`, `centre`, `momentum`, `velocity`, a torch optimizer's `exp_avg`, ...), replica
(for optimizers whose replicas differ, the EASGD family; none when they agree), global name and
block: rows of dim 0 and, for a shard that splits them, columns of dim 1. A manifest entry is
[kind, replica, name, shape, start, stop] for a shard of whole columns (every shard before
column splits: such checkpoints, their manifests and hashes are unchanged) and [kind, replica,
name, shape, start, stop, col_start, col_stop] for one of some columns. The shards of each
tensor tile it: every element in exactly one. Of the ranks holding the same block, only the
lowest writes it, and a block inside a larger one that is written (a block of a column stripe
another rank holds whole) is not written again. Loading copies into each local tensor the
intersection of its block with each stored block, so a checkpoint written on one grid (rows,
blocks, columns) resumes on another.

Per-parameter optimizer state that is one value rather than rows (Adam's `step`, a 0-d tensor
on every shard of the parameter) cannot be split by rows: it is kept once per parameter name,
in rank 0's shard (`scalar/<kind>/<replica>/<name>`), listed in the manifest's `scalars`
([kind, replica, name] each), and every shard of that parameter gets it on load. The ranks
holding a parameter must agree on it, or the checkpoint is not written. A manifest without
`scalars` (written before them) has none: it loads as it always did.

Saving is collective over the world. Under `strategy.sparse=sharded` a rank holds only its
block of each embedding table (placed like any row shard) and replicas of the table's hot rows,
which took the steps while their owners' rows went stale: the replicas' weights and optimizer
state (momentum, Adam's moments) are written back into the owners' rows first
(`refresh_copies`, `refresh_state_copies`), so the blocks saved are true; the replicas and
their ids (`<table>.hot_weight`, `<table>.hot_ids`, no tensors of the sequential model) are
kept too, read back only by a resume with as many hot rows and ignored by any other. Then the
ranks agree on who writes what, each writes its file (temporary name, fsync, rename), they
share what went wrong, and rank 0 writes the manifest only when every file is in place. A failed
write leaves no manifest, so the previous checkpoint stays the latest.

A checkpoint proves itself (format 2): the manifest records each shard's size and the sha256 of
the bytes written (hashed as they are written, not re-read). A shard is named `rank-NNNNN.pt`
inside the checkpoint directory and nothing else, is opened without following a symlink, must be
a regular file, and is hashed from the very bytes that are then unpickled (`weights_only`).
Damage is one line naming the checkpoint, the file and the reason (`DamagedCheckpoint`).
`verify_resume` is the head's full check before any rank starts; `resume=auto` skips damaged
checkpoints for the newest one that verifies. Format 1 (before hashes) still loads, with a note
that its contents were not verified: every other check applies to it.

A checkpoint is device-independent: every tensor is copied to the host before it is written
(`_host_copy`), so a checkpoint of a model trained on a GPU holds the same bytes, and the same
hashes, as one trained on the CPU, and loads on a machine without a GPU (`map_location="cpu"`).
Loading copies the host tensors into the parameters and into state created on their device.
"""

from __future__ import annotations

import errno
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import shutil
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from runner.core import ProcessGrid
from runner.core.placement import Placement, global_cols, global_rows, placement_of
from runner.optim.sync import ReplicaOptimizer, UnsavableState
from runner.records.rundir import atomic_write_text, nearest_existing
from strategies import ParallelModel
from strategies.sparse_exchange import HOT_IDS, UnevenState, is_hot_row_tensor

# 2: shard sizes and sha256 in the manifest. Column-split entries (8 fields) need no new
# format: a reader that predates them refuses such an entry as malformed, it never misreads it.
FORMAT = 2
READABLE_FORMATS = (1, 2)  # 1: no hashes; loaded with a note that nothing was verified
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
SHARD_NAME = re.compile(r"rank-([0-9]{5,})\.pt")  # the only names a manifest may give a shard
WHOLE_KINDS = ("model", "centre")  # every parameter is in these (other kinds may lack some)
BUFFERS = "buffers"  # the model's running statistics (BatchNorm), placed like parameters
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, is damaged, or does not fit the model."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are not what its manifest says (or whose manifest is not one):
    one line naming the checkpoint, the file and the reason. `resume=auto` skips it."""

    def __init__(self, path: Path, file: str, reason: str) -> None:
        self.path, self.file, self.reason = path, file, reason
        super().__init__(f"checkpoint {path}: {file}: {reason}")


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{STEP_PREFIX}{step:08d}"


def shard_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    """A manifest was written (whatever it is: `Checkpoint` checks it is a regular file)."""
    return os.path.lexists(path / MANIFEST)


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
    """One tensor of a shard file: a block of the global tensor `name` (`place`)."""

    kind: str
    replica: int | None
    place: Placement

    @property
    def name(self) -> str:
        return self.place.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.place.shape

    @property
    def key(self) -> str:
        """Its tensor's key in the shard file (a shard of whole columns keeps the key it had
        before columns were split)."""
        replica = "-" if self.replica is None else str(self.replica)
        place = self.place
        key = f"{self.kind}/{replica}/{place.name}/{place.start}:{place.stop}"
        if place.splits_columns:
            low, high = place.col_range
            key += f",{low}:{high}"
        return key

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of its tensor in the shard: its block of the global tensor."""
        return self.place.local_shape

    def to_json(self) -> list[Any]:
        place = self.place
        item = [self.kind, self.replica, place.name, list(place.shape), place.start, place.stop]
        return [*item, *place.col_range] if place.splits_columns else item

    @classmethod
    def from_json(cls, item: list[Any]) -> Entry:
        """From either form `_entry_problem` accepts (6 fields: every column)."""
        kind, replica, name, shape, *block = item
        return cls(kind, replica, Placement(name, tuple(shape), *block))


def _placement(param: torch.Tensor) -> Placement:
    place = placement_of(param)
    if place is None:
        raise CheckpointError("a parameter of the parallel model has no placement: the "
                              "strategy made it without `place_rows`")
    return place


def _placements(model: ParallelModel) -> list[Placement]:
    return [_placement(param) for param in model.parameters()]


def _placed_buffers(model: ParallelModel) -> list[torch.Tensor]:
    """The buffers a checkpoint keeps (a BatchNorm's running statistics), by placement like the
    parameters (`runner.core.placement.place_whole` tags them)."""
    return [buffer for buffer in model.buffers() if placement_of(buffer) is not None]


def _buffers_source(plan: ResumePlan) -> tuple[str, int | None]:
    """Whose buffers a resume reads: the replica whose weights it reads, replica 0's where it
    reads the centre (which has none of its own)."""
    kind, replica = plan.weights
    return BUFFERS, replica if kind == "model" else 0


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of its own (not a view: a slice would save its whole storage): what a
    checkpoint holds, wherever `tensor` lives (torch.save records a tensor's device, so a
    device tensor would make the bytes, and the hash, depend on it)."""
    return tensor.detach().to("cpu", copy=True)


def _entries(kind: str, replica: int | None, places: list[Placement],
             tensors: Sequence[torch.Tensor | None]) -> Iterator[tuple[Entry, torch.Tensor]]:
    for place, tensor in zip(places, tensors, strict=True):
        if tensor is not None:
            yield Entry(kind, replica, place), _host_copy(tensor)


@dataclass(frozen=True)
class Scalar:
    """One value of a parameter's optimizer state (Adam's step count) for its global name,
    whichever rows of it a rank holds: kept in rank 0's shard."""

    kind: str
    replica: int | None
    name: str

    @property
    def key(self) -> str:
        replica = "-" if self.replica is None else str(self.replica)
        return f"scalar/{self.kind}/{replica}/{self.name}"

    def to_json(self) -> list[Any]:
        return [self.kind, self.replica, self.name]

    @classmethod
    def from_json(cls, item: list[Any]) -> Scalar:
        kind, replica, name = item
        return cls(kind, replica, name)


def _optimizer_states(optimizer: ReplicaOptimizer,
                      step: int) -> dict[str, list[torch.Tensor | None]]:
    """The optimizer's per-parameter state; state it cannot give is one line (the same on
    every rank: it depends on the optimizer's class and options alone)."""
    try:
        return optimizer.param_states()
    except UnsavableState as exc:
        raise CheckpointError(f"checkpoint at step {step} not written: {exc}") from None


def _refresh_states(model: ParallelModel, optimizer: ReplicaOptimizer,
                    states: Mapping[str, Sequence[torch.Tensor | None]], step: int) -> None:
    """Collective: the optimizer's state shaped like the parameters made whole from the rows'
    owners, as `refresh_copies` makes the weights (under `strategy.sparse=sharded` only a row's
    owner holds its true momentum or moments; the lowest rank writes every row). A state some
    ranks lack cannot be: one line on every rank, nothing written."""
    scalar_kinds = optimizer.scalar_kinds()
    try:
        model.refresh_state_copies({kind: tensors for kind, tensors in states.items()
                                    if kind not in scalar_kinds})
    except UnevenState as exc:
        raise CheckpointError(f"checkpoint at step {step} not written: {exc}") from None


def _held_tensors(model: ParallelModel, optimizer: ReplicaOptimizer, grid: ProcessGrid,
                  states: Mapping[str, Sequence[torch.Tensor | None]]
                  ) -> list[tuple[Entry, torch.Tensor]]:
    """Everything this rank holds that a checkpoint keeps by rows (collective: reads the
    centre); `states`: the optimizer's (`param_states`)."""
    places = _placements(model)
    replica = grid.batch_index if optimizer.per_replica else None
    params = list(model.parameters())
    held = list(_entries("model", replica, places, params))
    buffers = _placed_buffers(model)
    held += _entries(BUFFERS, replica, [_placement(b) for b in buffers], buffers)
    scalar_kinds = optimizer.scalar_kinds()
    for kind, tensors in states.items():
        if kind not in scalar_kinds:
            held += _entries(kind, replica, places, tensors)
    if optimizer.has_centre:
        with optimizer.centre_weights():
            held += _entries("centre", None, places, list(model.parameters()))
    return held


def _held_scalars(model: ParallelModel, optimizer: ReplicaOptimizer, grid: ProcessGrid,
                  states: Mapping[str, Sequence[torch.Tensor | None]]
                  ) -> list[tuple[Scalar, torch.Tensor]]:
    """This rank's one-value optimizer state, by parameter name (`optimizer.scalar_kinds`)."""
    replica = grid.batch_index if optimizer.per_replica else None
    places = _placements(model)
    held = []
    for kind in optimizer.scalar_kinds():
        for place, value in zip(places, states.get(kind, [None] * len(places)), strict=True):
            if value is not None:
                held.append((Scalar(kind, replica, place.name), _host_copy(value)))
    return held


def _agreed_scalars(reported: Sequence[Sequence[tuple[Scalar, torch.Tensor]]]
                    ) -> tuple[dict[Scalar, torch.Tensor], str | None]:
    """One value per parameter name from what every rank reported, and why not when ranks
    holding the same parameter disagree or a value is not one value (every rank sees the same
    reports, so all raise together). Disagreement would be a bug: the shards of a parameter
    take the same steps."""
    agreed: dict[Scalar, torch.Tensor] = {}
    for rank, held in enumerate(reported):
        for scalar, value in held:
            if value.dim() != 0:
                return {}, (f"rank {rank}: optimizer state '{scalar.kind}' of {scalar.name} "
                            f"has shape {list(value.shape)}, not one value")
            first = agreed.setdefault(scalar, value)
            if first.dtype != value.dtype or not torch.equal(first, value):
                return {}, (f"rank {rank}: optimizer state '{scalar.kind}' of {scalar.name} "
                            f"is {value.item()!r}, a lower rank holds {first.item()!r}")
    return agreed, None


# -- saving ----------------------------------------------------------------------------------

@dataclass
class TrainingProgress:
    """What a checkpoint restores besides tensors: where training stands."""

    step: int
    time_s: float  # training seconds so far (metrics' `time_s` continues from it)
    sampler: dict[str, Any]  # EpochSampler.state(): epoch, position, generator, order
    loss_scale: dict[str, float | int] | None = None  # fp16's DynamicLossScale.state()


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest keeps of a shard file to recognise it: its size and content hash."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}


class _HashingWriter:
    """The shard file as torch.save writes it (sequentially: it never seeks): hashes and counts
    the bytes written, and keeps the first write error, which torch.save would report as a
    RuntimeError about stream positions."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        accepted = memoryview(data).cast("B")[:written]  # all of it, for a buffered file
        self.sha256.update(accepted)
        self.size += len(accepted)
        return int(written)

    def flush(self) -> None:
        self.file.flush()


def _write_shard(path: Path, payload: dict[str, torch.Tensor]) -> ShardRecord:
    """Write `payload` to `path` atomically; its record hashes the bytes as written."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(payload, cast("IO[bytes]", writer))
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return ShardRecord(writer.size, writer.sha256.hexdigest())


def save_checkpoint(checkpoints: Path, progress: TrainingProgress, model: ParallelModel,
                    optimizer: ReplicaOptimizer, grid: ProcessGrid, run_info: dict[str, Any],
                    keep: int | None = None) -> Path:
    """Collective over the world: write a checkpoint and return its path. Raises
    `CheckpointError` on every rank when any rank's write failed.

    Its step is the least step of the ranks: they agree under synchronous optimizers, while
    asynchronous replicas stopped by a signal may stand at different steps (each keeps its own
    weights; a resume continues from the least)."""
    model.refresh_copies()  # rows a parameter-server exchange left stale on non-owners
    states = _optimizer_states(optimizer, progress.step)
    _refresh_states(model, optimizer, states, progress.step)
    held = _held_tensors(model, optimizer, grid, states)
    # Agree on the step, on who writes what (the lowest rank holding the same rows), and on
    # the one-value state (rank 0 writes it).
    everyone = grid.world.allgather_object(([e for e, _ in held], progress.step,
                                            _held_scalars(model, optimizer, grid, states)))
    step = min(s for _, s, _ in everyone)
    scalars, problem = _agreed_scalars([reported for _, _, reported in everyone])
    if problem is not None:
        raise CheckpointError(f"checkpoint at step {step} not written: {problem}")
    path = step_dir(checkpoints, step)
    error = None
    if grid.rank == 0:
        error = _attempt(lambda: _fresh_directory(path))
    _raise_first(grid.world.allgather_object(error), step)
    writer = _writers([entries for entries, _, _ in everyone])
    payload = {e.key: t for e, t in held if writer.get(e.key) == grid.rank}
    payload["rng"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a run on a GPU: its draws
        payload["cuda_rng"] = torch.cuda.get_rng_state()
    if grid.rank == 0:
        payload["sampler/generator"] = _host_copy(progress.sampler["generator"])
        payload["sampler/order"] = _host_copy(progress.sampler["order"])
        payload.update({scalar.key: value for scalar, value in scalars.items()})
    records: list[ShardRecord] = []
    error = _attempt(lambda: records.append(_write_shard(path / shard_file(grid.rank), payload)))
    written = grid.world.allgather_object((error, records[0] if records else None))
    _raise_first([e for e, _ in written], step, path if grid.rank == 0 else None)
    if grid.rank == 0:
        manifest = {
            "format": FORMAT, "step": step, "time_s": progress.time_s,
            "world_size": grid.size, "grid": {"pr": grid.pr, "pc": grid.pc},
            "per_replica": optimizer.per_replica, "rank_steps": [s for _, s, _ in everyone],
            "sampler": {"epoch": progress.sampler["epoch"],
                        "position": progress.sampler["position"]},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"), **run_info,
            "files": {shard_file(rank): [e.to_json() for e in entries
                                         if writer.get(e.key) == rank]
                      for rank, (entries, _, _) in enumerate(everyone)},
            "scalars": [scalar.to_json() for scalar in scalars],
            **({} if progress.loss_scale is None else {"loss_scale": progress.loss_scale}),
            "shards": {shard_file(rank): record.to_json()
                       for rank, (_, record) in enumerate(written) if record is not None}}
        error = _attempt(lambda: atomic_write_text(path / MANIFEST,
                                                   json.dumps(manifest, indent=1) + "\n"))
    _raise_first(grid.world.allgather_object(error), step, path if grid.rank == 0 else None)
    if grid.rank == 0 and keep:
        for old in complete_checkpoints(checkpoints)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _writers(reported: Sequence[Sequence[Entry]]) -> dict[str, int]:
    """Which rank writes each block, by entry key (`reported`: every rank's entries; a key
    left out is written by none): the lowest rank holding it, so that the blocks written of
    each tensor hold every element once. Where the distinct blocks of a tensor overlap (a rank
    holds a column stripe W[:, c0:c1], others blocks inside it), the larger blocks go first
    and a block overlapping one already chosen is left out: for blocks nested in each other,
    as partitions that refine each other make, every element is still written once."""
    lowest: dict[str, tuple[int, Entry]] = {}
    for rank, entries in enumerate(reported):
        for entry in entries:
            lowest.setdefault(entry.key, (rank, entry))
    by_tensor: dict[tuple[str, int | None, str], list[tuple[int, Entry]]] = {}
    for rank, entry in lowest.values():
        by_tensor.setdefault((entry.kind, entry.replica, entry.name), []).append((rank, entry))
    writer: dict[str, int] = {}
    for held in by_tensor.values():
        if _first_overlap([entry.place for _, entry in held]) is not None:
            chosen: list[Placement] = []
            kept = []
            for rank, entry in sorted(held, key=lambda item: (-item[1].place.area, item[0])):
                if all(entry.place.intersection(other) is None for other in chosen):
                    chosen.append(entry.place)
                    kept.append((rank, entry))
            held = kept
        writer.update((entry.key, rank) for rank, entry in held)
    return writer


def _first_overlap(blocks: Sequence[Placement]) -> Placement | None:
    """A block of a tensor that two of `blocks` (its placements) both hold, if any. Blocks
    sorted by their first row need only be compared with those starting above their last
    row: linear for row shards, the blocks of one row band for a grid of blocks."""
    ordered = sorted(blocks, key=lambda block: (block.start, block.col_range))
    for i, block in enumerate(ordered):
        for other in ordered[i + 1:]:
            if other.start >= block.stop:
                break
            shared = block.intersection(other)
            if shared is not None:
                return shared
    return None


def _first_gap(blocks: Sequence[Placement], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The first (row, column) of a tensor of `shape` that none of `blocks` holds, if any.
    The rows are cut into bands at every block's first and last row: a block holds all of a
    band or none of it, so a band's columns are the union of its blocks' column ranges."""
    rows = global_rows(shape)
    cuts = sorted({0, rows, *(b.start for b in blocks), *(b.stop for b in blocks)})
    for low, high in itertools.pairwise(cuts):
        reached = 0
        spans = sorted(b.col_range for b in blocks if b.start <= low and high <= b.stop)
        for first, last in spans:
            if first > reached:
                break
            reached = max(reached, last)
        if reached < global_cols(shape):
            return low, reached
    return None


def _block_text(block: Placement) -> str:
    """`rows 4:8`, and `, columns 3:6` for a block of some columns."""
    low, high = block.col_range
    columns = f", columns {low}:{high}" if block.splits_columns else ""
    return f"rows {block.start}:{block.stop}{columns}"


def _tiling_problem(kind: str, name: str, shape: tuple[int, ...],
                    blocks: Sequence[Placement]) -> str | None:
    """Why `blocks` (inside the tensor: the entries were checked) do not hold every element
    of `kind`'s tensor `name` exactly once: two that overlap, or where a gap starts. No
    overlap and areas summing to the whole is an exact tiling."""
    shared = _first_overlap(blocks)
    if shared is not None:
        return f"its {kind} shards of {name} overlap: both hold {_block_text(shared)}"
    if sum(block.area for block in blocks) != global_rows(shape) * global_cols(shape):
        gap = _first_gap(blocks, shape)
        assert gap is not None  # disjoint blocks inside the tensor, short of its area
        row, column = gap
        where = f"row {row}, column {column}" if len(shape) >= 2 else f"row {row}"
        return f"its {kind} shards of {name} leave a gap at {where}"
    return None


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


# -- reading what a manifest names ----------------------------------------------------------

class _Refused(Exception):
    """Why a file of a checkpoint is not read (the caller names the checkpoint and the file)."""


def _not_regular(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    kind = next((name for test, name in kinds if test(mode)), "of an unknown type")
    return f"not a regular file ({kind}): refused"


def _read_regular(path: Path, size: int | None = None) -> bytes:
    """The bytes of the regular file `path`, opened without following a symlink and without
    waiting (a FIFO or a device in its place is refused at once, never read). `size`: the size
    the manifest records (a file of another size is refused before it is read)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise _Refused("missing") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # Linux, the BSDs: the last part links
            raise _Refused("a symbolic link: refused (only regular files inside the "
                           "checkpoint directory are read)") from None
        if exc.errno == errno.ENXIO:
            raise _Refused("not a regular file (a socket): refused") from None
        raise _Refused(f"cannot be opened ({exc.strerror})") from None
    with open(fd, "rb", closefd=True) as file:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _Refused(_not_regular(status.st_mode))
        if size is not None and status.st_size < size:
            raise _Refused(f"truncated: {status.st_size} of {size} bytes")
        if size is not None and status.st_size > size:
            raise _Refused(f"{status.st_size} bytes where {size} were written: altered")
        data = file.read() if size is None else file.read(size + 1)
    if size is not None and len(data) != size:
        raise _Refused(f"{len(data)} bytes read where {size} were written: changed while read")
    return data


def _load_problem(exc: Exception) -> str:
    """torch.load's multi-paragraph errors as the one reason that matters."""
    text = str(exc)
    if "Weights only load failed" in text:
        detail = (text.rsplit("WeightsUnpickler error:", 1)[-1]
                  if "WeightsUnpickler error:" in text else text.split("\n\n", 1)[-1])
        line = next((x.strip() for x in detail.splitlines() if x.strip()), "")
        return f"refused by weights_only loading: {line.split('. ')[0].rstrip('.')}"
    first = text.strip().split(". ")[0] or type(exc).__name__
    return f"not a readable shard ({type(exc).__name__}: {first})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def shard_rank(name: Any) -> int | None:
    """The rank whose shard `name` is, when it is exactly `rank-NNNNN.pt` (no directory, no
    `..`, no other spelling); None otherwise."""
    match = SHARD_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    rank = int(match.group(1))
    return rank if shard_file(rank) == name else None


def _entry_problem(item: Any, replicas: int) -> str | None:
    """What is wrong with a manifest entry: [kind, replica, name, shape, start, stop] (every
    column) or [..., col_start, col_stop] (some columns of a tensor of two dims or more)."""
    if not (isinstance(item, list) and len(item) in (6, 8)):
        return (f"entry {item!r} is not [kind, replica, name, shape, start, stop] or [kind, "
                f"replica, name, shape, start, stop, col_start, col_stop]")
    kind, replica, name, shape, start, stop, *columns = item
    if not (isinstance(kind, str) and kind and isinstance(name, str) and name):
        return f"entry {item!r}: kind and name must be non-empty strings"
    if replica is not None and not (_is_int(replica) and 0 <= replica < replicas):
        return f"entry {name}: replica {replica!r} is not one of the {replicas} replicas"
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        return f"entry {name}: shape {shape!r} is not a list of sizes"
    rows = global_rows(tuple(shape))
    if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= rows):
        return f"entry {name}: rows {start!r}:{stop!r} outside its {rows} rows"
    if columns:
        col_start, col_stop = columns
        if len(shape) < 2:
            return (f"entry {name}: columns {col_start!r}:{col_stop!r} of a tensor of shape "
                    f"{shape!r}, which has no columns to split")
        cols = global_cols(tuple(shape))
        if not (_is_int(col_start) and _is_int(col_stop) and 0 <= col_start <= col_stop <= cols):
            return f"entry {name}: columns {col_start!r}:{col_stop!r} outside its {cols} columns"
    return None


def _scalars_problem(scalars: Any, replicas: int) -> str | None:
    """What is wrong with a manifest's `scalars` (absent: written before them, none)."""
    if not isinstance(scalars, list):
        return "'scalars' is not a list of [kind, replica, name]"
    for item in scalars:
        if not (isinstance(item, list) and len(item) == 3):
            return f"scalar {item!r} is not [kind, replica, name]"
        kind, replica, name = item
        if not (isinstance(kind, str) and kind and isinstance(name, str) and name):
            return f"scalar {item!r}: kind and name must be non-empty strings"
        if replica is not None and not (_is_int(replica) and 0 <= replica < replicas):
            return f"scalar {name}: replica {replica!r} is not one of the {replicas} replicas"
    if len({tuple(item) for item in scalars}) != len(scalars):
        return "'scalars' lists a value twice"
    return None


def _shards_problem(shards: Any, files: dict[str, Any]) -> str | None:
    if not (isinstance(shards, dict) and set(shards) == set(files)):
        return "'shards' does not record every file of 'files'"
    for name, record in shards.items():
        if not (isinstance(record, dict) and _is_int(record.get("bytes"))
                and record["bytes"] >= 0 and isinstance(record.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", record["sha256"])):
            return f"'shards' record of {name} is not {{bytes, sha256}}"
    return None


def _manifest_problem(manifest: Any) -> str | None:
    """What makes `manifest` not a manifest this version can trust its files to (None: fine)."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if manifest.get("format") not in READABLE_FORMATS or not _is_int(manifest["format"]):
        return (f"format {manifest.get('format')!r}: this version reads formats "
                f"{', '.join(map(str, READABLE_FORMATS))}")
    checks = (("step", lambda v: _is_int(v) and 0 <= v < 2 ** 63, "a step"),
              ("time_s", lambda v: _is_int(v) or isinstance(v, float), "a number"),
              ("world_size", lambda v: _is_int(v) and v >= 1, "a number of ranks"),
              ("per_replica", lambda v: isinstance(v, bool), "true or false"))
    for key, valid, what in checks:
        if not valid(manifest.get(key)):
            return f"'{key}' is {manifest.get(key)!r}, not {what}"
    size, grid, sampler = manifest["world_size"], manifest.get("grid"), manifest.get("sampler")
    if not (isinstance(grid, dict) and all(_is_int(grid.get(k)) and grid[k] >= 1
                                           for k in ("pr", "pc"))
            and grid["pr"] * grid["pc"] == size):
        return f"'grid' is {grid!r}, not pr x pc = {size} ranks"
    if not (isinstance(sampler, dict) and all(_is_int(sampler.get(k)) and sampler[k] >= 0
                                              for k in ("epoch", "position"))):
        return f"'sampler' is {sampler!r}, not an epoch and a position"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return "'files' is not a mapping of shard names to tensors"
    for name in files:
        if shard_rank(name) is None:
            return (f"shard name {name!r} refused: a shard is rank-NNNNN.pt inside the "
                    f"checkpoint directory")
    if len(files) != size or any(cast(int, shard_rank(name)) >= size for name in files):
        return f"'files' does not name one shard per rank of {size}: {sorted(files)}"
    for name, items in files.items():
        if not isinstance(items, list):
            return f"'files' of {name} is not a list of entries"
        problem = next(filter(None, (_entry_problem(i, grid["pc"]) for i in items)), None)
        if problem is not None:
            return f"{name}: {problem}"
    problem = _scalars_problem(manifest.get("scalars", []), grid["pc"])
    if problem is not None:
        return problem
    if manifest["format"] >= 2:
        return _shards_problem(manifest.get("shards"), files)
    return None


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(_read_regular(path / MANIFEST))
    except _Refused as exc:
        raise DamagedCheckpoint(path, MANIFEST, str(exc)) from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise DamagedCheckpoint(path, MANIFEST, f"not JSON ({exc})") from None
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise DamagedCheckpoint(path, MANIFEST, problem)
    return cast("dict[str, Any]", manifest)


def _short(path: Path) -> str:
    """`checkpoints/step-00000040`: enough to tell a run's checkpoints apart in a note."""
    return f"{path.parent.name}/{path.name}"


# -- loading ---------------------------------------------------------------------------------

class Checkpoint:
    """A complete checkpoint whose manifest has been checked (its format, shard names confined
    to the directory, entries within their tensors' extents). Shard files are read when first
    needed, each verified as it is read (`read_shard`), and only the rows a rank asks for are
    copied out of them. Raises `DamagedCheckpoint` for a manifest that is not one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest: dict[str, Any] = _read_manifest(path)
        self.files: dict[str, list[Entry]] = {
            name: [Entry.from_json(item) for item in items]
            for name, items in self.manifest["files"].items()}
        self.entries = [(file, entry) for file, entries in self.files.items()
                        for entry in entries]
        self.scalars = [Scalar.from_json(item) for item in self.manifest.get("scalars", [])]
        self.records: dict[str, ShardRecord] = {
            name: ShardRecord(record["bytes"], record["sha256"])
            for name, record in self.manifest.get("shards", {}).items()}
        self._open: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def hashed(self) -> bool:
        """Its manifest records its shards' sizes and hashes (format 2 onwards)."""
        return int(self.manifest["format"]) >= 2

    @property
    def notes(self) -> list[str]:
        """What a resume from it should say besides where it starts."""
        if self.hashed:
            return []
        return [f"{_short(self.path)}: format {self.manifest['format']} (written before shard "
                f"hashes): no hashes, its contents are not verified"]

    def _damaged(self, file: str, reason: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(self.path, file, reason)

    def look_at_shards(self) -> None:
        """Cheap: every shard is there as a regular file of its recorded size (nothing read).
        Raises `DamagedCheckpoint`."""
        for name in self.files:
            record = self.records.get(name)
            try:
                status = os.lstat(self.path / name)
            except FileNotFoundError:
                raise self._damaged(name, "missing") from None
            except OSError as exc:
                raise self._damaged(name, f"cannot be examined ({exc.strerror})") from None
            if stat.S_ISLNK(status.st_mode):
                raise self._damaged(name, "a symbolic link: refused (only regular files "
                                          "inside the checkpoint directory are read)")
            if not stat.S_ISREG(status.st_mode):
                raise self._damaged(name, _not_regular(status.st_mode))
            if record is not None and status.st_size != record.size:
                how = "truncated: " if status.st_size < record.size else ""
                raise self._damaged(name, f"{how}{status.st_size} of {record.size} bytes")

    def read_shard(self, name: str) -> dict[str, torch.Tensor]:
        """One shard, verified: read whole (a regular file, no symlink), its bytes hashed
        against the manifest, unpickled from those same bytes with `weights_only` (tensors
        and plain containers, never arbitrary objects), and its tensors checked against the
        manifest's entries. Not kept (`_file` keeps what a rank loads from)."""
        if name not in self.files:
            raise self._damaged(name, "not a shard of this checkpoint")
        record = self.records.get(name)
        try:
            data = _read_regular(self.path / name, record.size if record else None)
        except _Refused as exc:
            raise self._damaged(name, str(exc)) from None
        if record is not None and hashlib.sha256(data).hexdigest() != record.sha256:
            raise self._damaged(name, "sha256 mismatch (damaged or altered since written)")
        try:
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises anything from pickle, zip and its own checks
            raise self._damaged(name, _load_problem(exc)) from None
        problem = self._payload_problem(name, payload)
        if problem is not None:
            raise self._damaged(name, problem)
        return cast("dict[str, torch.Tensor]", payload)

    def _payload_problem(self, name: str, payload: Any) -> str | None:
        if not isinstance(payload, dict):
            return f"holds a {type(payload).__name__}, not a dict of tensors"
        for key, value in payload.items():
            if not (isinstance(key, str) and isinstance(value, torch.Tensor)
                    and value.layout == torch.strided):
                return f"item {key!r} is not a dense tensor"
        needed = ["rng", *(["sampler/generator", "sampler/order"]
                           if name == shard_file(0) else [])]
        for key in needed:
            if key not in payload:
                return f"no {key!r} tensor"
        rng = payload["rng"]
        if rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
            return "its 'rng' is not a random state of this PyTorch"
        for entry in self.files[name]:
            tensor = payload.get(entry.key)
            if tensor is None:
                return f"no tensor {entry.key}, which the manifest lists"
            if tuple(tensor.shape) != entry.stored_shape:
                return (f"tensor {entry.key} has shape {list(tensor.shape)}, the manifest "
                        f"says {list(entry.stored_shape)}")
        for scalar in self.scalars if name == shard_file(0) else ():
            tensor = payload.get(scalar.key)
            if tensor is None:
                return f"no tensor {scalar.key}, which the manifest lists"
            if tensor.dim() != 0:
                return (f"tensor {scalar.key} has shape {list(tensor.shape)}, the manifest "
                        f"says one value")
        return None

    def verify(self) -> None:
        """Every shard read and verified (`read_shard`), nothing kept. Raises
        `DamagedCheckpoint`."""
        for name in self.files:
            self.read_shard(name)

    def model_problem(self, shapes: Mapping[str, tuple[int, ...]],
                      buffers: Mapping[str, tuple[int, ...]] | None = None) -> str | None:
        """Why this checkpoint is not one of the model whose parameters have `shapes` and
        whose buffers `buffers` (by `state_dict` name): a tensor that is not one of them, or of
        another shape, or blocks that do not tile it exactly (weights and centre: every
        parameter)."""
        spans: dict[tuple[str, int | None, str], list[Placement]] = {}
        known = {**(buffers or {}), **shapes}
        for _, entry in self.entries:
            if is_hot_row_tensor(entry.name):
                continue  # a sharded table's hot-row replicas: no tensor of the sequential model
            shape = (buffers or {}).get(entry.name) if entry.kind == BUFFERS else \
                shapes.get(entry.name)
            if shape is None:
                return f"its {entry.kind} tensor {entry.name!r} is not a parameter of this model"
            if entry.shape != shape:
                return (f"{entry.name} has shape {list(entry.shape)} in the checkpoint and "
                        f"{list(shape)} in this model")
            spans.setdefault((entry.kind, entry.replica, entry.name), []).append(entry.place)
        for scalar in self.scalars:
            if scalar.name not in shapes and not is_hot_row_tensor(scalar.name):
                return (f"its {scalar.kind} value for {scalar.name!r} is not a parameter of "
                        f"this model")
        for (kind, _, name), blocks in spans.items():
            problem = _tiling_problem(kind, name, known[name], blocks)
            if problem is not None:
                return problem
        whole = {(kind, replica) for kind, replica, _ in spans if kind in WHOLE_KINDS}
        if not any(kind == "model" for kind, _ in whole):
            return "it holds no model weights"
        for kind, replica in sorted(whole, key=str):
            missing = [name for name in shapes if (kind, replica, name) not in spans]
            if missing:
                return f"it has no {kind} tensor for {missing[0]}"
        return None

    def _file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._open:
            self._open[name] = self.read_shard(name)
        return self._open[name]

    def load_shards(self, names: Sequence[str]) -> None:
        """Read, verify and keep these shards for the reads that follow."""
        for name in names:
            self._file(name)

    def release(self) -> None:
        """Forget the shards read so far (a rank keeps none once it has loaded)."""
        self._open.clear()

    def has(self, kind: str) -> bool:
        return (any(entry.kind == kind for _, entry in self.entries)
                or any(scalar.kind == kind for scalar in self.scalars))

    def _covering(self, kind: str, replica: int | None, place: Placement,
                  optional: bool) -> list[tuple[str, Entry, Placement]]:
        """The entries holding parts of `place` for `kind` and `replica`, with the block of it
        each holds; an error when they do not cover it (`optional`: unless none does)."""
        found = []
        for file, entry in self.entries:
            if entry.kind != kind or entry.replica != replica or entry.name != place.name:
                continue
            if entry.shape != place.shape and is_hot_row_tensor(place.name):
                continue  # another number of hot rows: none for this run (the table is whole)
            if entry.shape != place.shape:
                raise CheckpointError(
                    f"checkpoint {self.path}: {place.name} has shape {list(entry.shape)} in "
                    f"the checkpoint and {list(place.shape)} in this model (a different model "
                    f"or dataset?)")
            shared = entry.place.intersection(place)
            if shared is not None:
                found.append((file, entry, shared))
        covered = sum(shared.area for _, _, shared in found)
        if covered != place.area and not (optional and covered == 0):
            raise CheckpointError(f"checkpoint {self.path}: no {kind} {_block_text(place)} "
                                  f"of {place.name} (a different model?)")
        return found

    def files_for(self, kind: str, replica: int | None, places: Sequence[Placement],
                  optional: bool = False) -> set[str]:
        """The shards that `read_into` would read for these placements."""
        return {file for place in places
                for file, _, _ in self._covering(kind, replica, place, optional)}

    def read_into(self, kind: str, replica: int | None, place: Placement,
                  out: torch.Tensor, optional: bool = False) -> bool:
        """Copy block `place` (its rows, and columns) of `kind`'s tensor `place.name` into
        `out`, from each stored block its intersection with it; `optional`: False instead of
        an error when the checkpoint has none of it."""
        found = self._covering(kind, replica, place, optional)
        for file, entry, shared in found:
            stored = self._file(file)[entry.key]
            place.view(out, shared).copy_(entry.place.view(stored, shared))
        return bool(found)

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

    def read_scalars(self, kind: str, replica: int | None,
                     like: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """`kind`'s one value for each of the parameters `like` (by its global name; None where
        the checkpoint has none), each a copy of its own: every shard of a parameter is given
        one, and an optimizer updates it in place."""
        keys = {s.name: s.key for s in self.scalars if s.kind == kind and s.replica == replica}
        rank0 = self.rank_state(0)
        names = [_placement(param).name for param in like]
        return [rank0[keys[name]].clone() if name in keys else None for name in names]

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        return self._file(shard_file(rank))


def _copy_into(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
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


def _is_hot(tensor: torch.Tensor) -> bool:
    return is_hot_row_tensor(_placement(tensor).name)


def _read_weights(checkpoint: Checkpoint, kind: str, replica: int | None,
                  params: Sequence[torch.Tensor]) -> None:
    """Copy `kind`'s values into `params`; a sharded table's hot-row replicas only when the
    checkpoint has them (one written under another exchange has its rows in the table)."""
    for param in params:
        checkpoint.read_into(kind, replica, _placement(param), param.data,
                             optional=_is_hot(param))


def _hot_rows_without_checkpoint(checkpoint: Checkpoint, buffers: Sequence[torch.Tensor],
                                 plan: ResumePlan) -> list[str]:
    """A sharded table resumed from a checkpoint without hot rows keeps none (every slot
    empty): replicas chosen now would start their optimizer state from zero, while their
    owners' rows hold the true state."""
    kind, replica = _buffers_source(plan)
    notes = []
    for buffer in buffers:
        place = _placement(buffer)
        if place.name.rsplit(".", 1)[-1] != HOT_IDS:
            continue
        if not checkpoint.files_for(kind, replica, [place], optional=True):
            buffer.fill_(-1)
            notes.append(f"{place.name}: no hot rows in the checkpoint, so none this run")
    return notes


def load_centre(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel) -> None:
    """Before the optimizer is built (it takes its centre from the model's weights)."""
    if plan.centre is not None:
        _read_weights(checkpoint, *plan.centre, list(model.parameters()))


def load_training_state(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel,
                        optimizer: ReplicaOptimizer, grid: ProcessGrid) -> list[str]:
    """The weights, the optimizer's per-parameter state (rows re-sharded, one-value state by
    parameter name; given to the optimizer in one call, so that it can restore a parameter's
    state whole) and this rank's RNG; returns what could not be restored exactly (for the
    log)."""
    params = list(model.parameters())
    _read_weights(checkpoint, *plan.weights, params)
    notes = []
    buffers = _placed_buffers(model)
    if buffers and checkpoint.has(BUFFERS):
        kind, replica = _buffers_source(plan)
        saved = checkpoint.read_states(kind, replica, buffers)
        _copy_into([b for b, v in zip(buffers, saved, strict=True) if v is not None],
                   [v for v in saved if v is not None])
    elif any(not _is_hot(buffer) for buffer in buffers):
        notes.append("running statistics start afresh (the checkpoint has none)")
    notes += _hot_rows_without_checkpoint(checkpoint, buffers, plan)
    states: dict[str, list[torch.Tensor | None]] = {}
    scalar_kinds = optimizer.scalar_kinds()
    for kind in (*optimizer.state_kinds(), *scalar_kinds):
        if plan.same_replicas and checkpoint.has(kind):
            read = checkpoint.read_scalars if kind in scalar_kinds else checkpoint.read_states
            states[kind] = read(kind, plan.states_replica, params)
        else:
            notes.append(f"optimizer state '{kind}' starts from zero (not in the checkpoint "
                         f"for these replicas)")
    if states:
        optimizer.load_param_states(states)
    same_grid = checkpoint.manifest["grid"] == {"pr": grid.pr, "pc": grid.pc}
    state = checkpoint.rank_state(grid.rank if same_grid else 0)
    torch.set_rng_state(state["rng"])
    cuda_rng = state.get("cuda_rng")  # written on a GPU; a CPU resume has no use for it
    if (isinstance(cuda_rng, torch.Tensor) and cuda_rng.dtype == torch.uint8
            and torch.cuda.is_available()):
        torch.cuda.set_rng_state(cuda_rng)
    if not same_grid:
        notes.append("random state taken from rank 0 (the checkpoint's grid differs)")
    return notes


def sampler_state(checkpoint: Checkpoint) -> dict[str, Any]:
    rank0 = checkpoint.rank_state(0)
    return {**checkpoint.manifest["sampler"], "generator": rank0["sampler/generator"],
            "order": rank0["sampler/order"]}


def prepare_resume(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel,
                   grid: ProcessGrid) -> None:
    """Read and verify every shard this rank's resume will read, and check that they cover
    its parameters, before anything collective happens: a damaged shard or another model's
    checkpoint is then a `CheckpointError` every rank can share (one line, no rank left
    waiting). Only these shards are hashed here (the head verified the whole checkpoint): the
    bytes hashed are the bytes loaded, so a file changed since the head's check is caught."""
    places = _placements(model)
    hot = [place for place in places if is_hot_row_tensor(place.name)]
    places = [place for place in places if not is_hot_row_tensor(place.name)]
    files = checkpoint.files_for(*plan.weights, places)
    files |= checkpoint.files_for(*plan.weights, hot, optional=True)
    if checkpoint.has(BUFFERS):
        files |= checkpoint.files_for(*_buffers_source(plan),
                                      [_placement(b) for b in _placed_buffers(model)],
                                      optional=True)
    if plan.centre is not None:
        files |= checkpoint.files_for(*plan.centre, places)
    if plan.same_replicas:  # the optimizer's state: read only for the same replicas
        for kind in {entry.kind for _, entry in checkpoint.entries} - set(WHOLE_KINDS):
            files |= checkpoint.files_for(kind, plan.states_replica, places + hot,
                                          optional=True)
    same_grid = checkpoint.manifest["grid"] == {"pr": grid.pr, "pc": grid.pc}
    files |= {shard_file(0), shard_file(grid.rank if same_grid else 0)}  # sampler, RNG
    checkpoint.load_shards(sorted(files))


# -- before a resume: which checkpoint, verified ---------------------------------------------

def find_resume_checkpoint(resume: str | None, checkpoints: Path | None,
                           read_named: bool = True) -> tuple[Path | None, list[str]]:
    """The checkpoint `trainer.resume` names, verified, and notes on what was skipped or could
    not be verified.

    `auto`: the newest complete checkpoint under `checkpoints` whose every shard verifies
    (read, hashed, unpickled, checked: `Checkpoint.verify`), skipping damaged ones with a note
    each; None when none verifies (a fresh start). A path: that checkpoint, or a run
    directory's newest; a damaged one raises `DamagedCheckpoint` (it was named: no fallback).
    `read_named=False` only looks at a named checkpoint's shards (there, regular files of the
    recorded sizes): for the ranks, which hash what they load. `auto` always reads, so that
    every caller picks the same checkpoint."""
    if resume is None:
        return None, []
    if resume == "auto":
        notes: list[str] = []
        for candidate in reversed(complete_checkpoints(checkpoints) if checkpoints else []):
            try:
                checkpoint = Checkpoint(candidate)
                checkpoint.verify()
            except DamagedCheckpoint as exc:
                notes.append(f"skipped {_short(candidate)}: {exc.file}: {exc.reason}")
                continue
            return candidate, notes + checkpoint.notes
        return None, notes
    path = resolve_resume(resume, None)
    assert path is not None
    checkpoint = Checkpoint(path)
    if read_named:
        checkpoint.verify()
    else:
        checkpoint.look_at_shards()
    return path, checkpoint.notes


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's parameters by `state_dict` name: what a checkpoint's entries name
    (`runner.core.placement.place_whole`)."""
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def buffer_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's buffers (running statistics) by `state_dict` name."""
    return {name: tuple(buffer.shape) for name, buffer in model.named_buffers()}


def verify_resume(resume: str | None, checkpoints: Path, model: torch.nn.Module
                  ) -> tuple[Path | None, list[str]]:
    """The head's check before any rank starts: the checkpoint `trainer.resume` names (None,
    `auto` under the run directory's `checkpoints`, or a path), fully verified
    (`find_resume_checkpoint`) and checked against the sequential `model` (it may live on the
    meta device: only names and shapes are used). Returns the checkpoint to resume from (None:
    a fresh start) and notes (checkpoints skipped and why; no hashes to verify). Raises
    `CheckpointError`, one line naming the checkpoint, the file and the reason, for a damaged
    named checkpoint or one of another model (also under `auto`: that is not damage, and an
    older checkpoint of the same run would not fit either)."""
    path, notes = find_resume_checkpoint(resume, checkpoints)
    if path is not None:
        problem = Checkpoint(path).model_problem(parameter_shapes(model), buffer_shapes(model))
        if problem is not None:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST}: not a checkpoint of this "
                                  f"model: {problem} (another model or dataset?)")
    return path, notes


# -- after an interruption -------------------------------------------------------------------

def hydra_quoted(value: str) -> str:
    """`value` as a double-quoted Hydra override value that reads back as exactly `value`.
    Unquoted, Hydra's grammar gives `( ) [ ] { } , = '` spaces and more a meaning, and reads
    `null`, `1` or `true` as other types. Inside the quotes a `"` is escaped `\\"`, and the
    backslashes before a quote (or before the closing one) are doubled. OmegaConf resolves
    `${...}` even in quoted values: escaped `\\${` (the backslashes before it doubled)."""
    literal = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    inner = re.sub(r'(\\*)("|\Z)',
                   lambda m: m.group(1) * 2 + ('\\"' if m.group(2) else ""), literal)
    return f'"{inner}"'


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its own overrides, its directory, resume=auto.
    It pastes into a POSIX shell whatever the directory is called (quoted for Hydra, then for
    the shell)."""
    overrides: list[str] = []
    try:
        from runner.records.rundir_files import load_yaml

        saved = load_yaml(run_dir / ".hydra" / "overrides.yaml") or []
        overrides = [str(o) for o in saved
                     if not str(o).startswith(("trainer.resume=", "hydra.run.dir="))]
    except (OSError, ValueError, TypeError):  # unreadable, beyond the bounds, not a list
        pass
    words = [*overrides, f"hydra.run.dir={hydra_quoted(str(run_dir))}", "trainer.resume=auto"]
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
