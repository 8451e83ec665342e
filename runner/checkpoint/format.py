"""What a checkpoint holds and how its manifest says so: every tensor by its placement, the
one-value optimizer state, the shards' records, and the checks that a manifest is one.

Every tensor is recorded by its placement in the sequential model (`runner.core.placement`):
kind (`model`, `centre`, `momentum`, `velocity`, a torch optimizer's `exp_avg`, ...), replica
(for optimizers whose replicas differ, the EASGD family; none when they agree), global name and
block: rows of dim 0 and, for a shard that splits them, columns of dim 1. A manifest entry is
[kind, replica, name, shape, start, stop] for a shard of whole columns (every shard before
column splits: such checkpoints, their manifests and hashes are unchanged) and [kind, replica,
name, shape, start, stop, col_start, col_stop] for one of some columns. The shards of each
tensor tile it: every element in exactly one (`tiling_problem`).

Per-parameter optimizer state that is one value rather than rows (Adam's `step`, a 0-d tensor
on every shard of the parameter) cannot be split by rows: it is kept once per parameter name,
in rank 0's shard (`scalar/<kind>/<replica>/<name>`), listed in the manifest's `scalars`
([kind, replica, name] each). A manifest without `scalars` (written before them) has none.

A checkpoint proves itself (format 2): the manifest records each shard's size and the sha256 of
the bytes written (`ShardRecord`). Format 1 (before hashes) is still read: every other check
applies to it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from runner.checkpoint.layout import CheckpointError, shard_rank
from runner.core.placement import Placement, global_cols, global_rows, placement_of
from strategies import ParallelModel

# 2: shard sizes and sha256 in the manifest. Column-split entries (8 fields) need no new
# format: a reader that predates them refuses such an entry as malformed, it never misreads it.
FORMAT = 2
READABLE_FORMATS = (1, 2)  # 1: no hashes; loaded with a note that nothing was verified
WHOLE_KINDS = ("model", "centre")  # every parameter is in these (other kinds may lack some)
BUFFERS = "buffers"  # the model's running statistics (BatchNorm), placed like parameters


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


@dataclass(frozen=True)
class ShardRecord:
    """What the manifest keeps of a shard file to recognise it: its size and content hash."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}


def tensor_placement(param: torch.Tensor) -> Placement:
    """Where a parameter or buffer of the parallel model sits in the sequential model: what its
    entries are keyed by."""
    place = placement_of(param)
    if place is None:
        raise CheckpointError("a parameter of the parallel model has no placement: the "
                              "strategy made it without `place_rows`")
    return place


def model_placements(model: ParallelModel) -> list[Placement]:
    """The placements of the model's parameters, in `parameters()` order."""
    return [tensor_placement(param) for param in model.parameters()]


def placed_buffers(model: ParallelModel) -> list[torch.Tensor]:
    """The buffers a checkpoint keeps (a BatchNorm's running statistics), by placement like the
    parameters (`runner.core.placement.place_whole` tags them)."""
    return [buffer for buffer in model.buffers() if placement_of(buffer) is not None]


# -- how the blocks of a tensor tile it ------------------------------------------------------

def first_overlap(blocks: Sequence[Placement]) -> Placement | None:
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


def block_text(block: Placement) -> str:
    """`rows 4:8`, and `, columns 3:6` for a block of some columns."""
    low, high = block.col_range
    columns = f", columns {low}:{high}" if block.splits_columns else ""
    return f"rows {block.start}:{block.stop}{columns}"


def tiling_problem(kind: str, name: str, shape: tuple[int, ...],
                    blocks: Sequence[Placement]) -> str | None:
    """Why `blocks` (inside the tensor: the entries were checked) do not hold every element
    of `kind`'s tensor `name` exactly once: two that overlap, or where a gap starts. No
    overlap and areas summing to the whole is an exact tiling."""
    shared = first_overlap(blocks)
    if shared is not None:
        return f"its {kind} shards of {name} overlap: both hold {block_text(shared)}"
    if sum(block.area for block in blocks) != global_rows(shape) * global_cols(shape):
        gap = _first_gap(blocks, shape)
        assert gap is not None  # disjoint blocks inside the tensor, short of its area
        row, column = gap
        where = f"row {row}, column {column}" if len(shape) >= 2 else f"row {row}"
        return f"its {kind} shards of {name} leave a gap at {where}"
    return None


# -- a manifest this version can trust its files to ------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def manifest_problem(manifest: Any) -> str | None:
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
