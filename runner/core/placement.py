"""Where a rank's tensor sits in the sequential model: the key to re-sharding checkpoints.

Before a strategy transforms the sequential model, every parameter is tagged with its name in
the model's `state_dict` and its whole extent. A strategy that keeps a layer whole reuses the
parameter object, tag and all; one that splits a layer tags the new, smaller parameter with the
block of the global tensor it holds (`place_rows`, `place_block`). A checkpoint records every
shard by its placement, and loading on any other grid copies the block each rank needs from
whichever shards hold parts of it (DistDL's view: a partition is an object, a data movement a
block intersection).

A placement is a block: rows [start, stop) of dim 0 (rows of W, output channels of a
convolution, rows of a bias) and columns [col_start, col_stop) of dim 1 (columns of W, input
channels of a convolution), every later dim whole. Most shards split rows alone and hold every
column (`col_stop` None); only a tensor of two dims or more has columns to split. A scalar is
one row of one column (`as_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_ATTRIBUTE = "gridrun_placement"


def global_rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1  # a scalar is one row


def global_cols(shape: tuple[int, ...]) -> int:
    return shape[1] if len(shape) >= 2 else 1  # a vector or a scalar: one column


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed with a leading row dim (a scalar becomes one row)."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


@dataclass(frozen=True)
class Placement:
    """Rows [start, stop) of dim 0 and columns [col_start, col_stop) of dim 1 of the global
    tensor `name` of shape `shape`; `col_stop` None: through its last column. Every column
    range that spans the whole of dim 1 is stored as (0, None), so equal blocks compare (and
    hash) equal however they were written."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    col_start: int = 0
    col_stop: int | None = None

    def __post_init__(self) -> None:
        if self.col_start == 0 and self.col_stop == global_cols(self.shape):
            object.__setattr__(self, "col_stop", None)  # frozen: the one spelling of "all"

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def col_range(self) -> tuple[int, int]:
        """Its columns [low, high) of the global tensor, resolved."""
        return self.col_start, global_cols(self.shape) if self.col_stop is None else self.col_stop

    @property
    def cols(self) -> int:
        low, high = self.col_range
        return high - low

    @property
    def splits_columns(self) -> bool:
        """It holds some columns of dim 1, not all."""
        return self.col_stop is not None or self.col_start != 0

    @property
    def area(self) -> int:
        """Rows x columns: how many elements of the first two dims it holds."""
        return self.rows * self.cols

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor that holds it (a scalar's placement: a scalar)."""
        if not self.shape:
            return ()
        if len(self.shape) == 1:
            return (self.rows,)
        return (self.rows, self.cols, *self.shape[2:])

    def overlap(self, start: int, stop: int) -> tuple[int, int] | None:
        """The global rows this placement shares with [start, stop), if any."""
        low, high = max(self.start, start), min(self.stop, stop)
        return (low, high) if low < high else None

    def intersection(self, other: Placement) -> Placement | None:
        """The block of the global tensor both hold (None: none, or an empty one). Both are
        placements of the same tensor."""
        rows = self.overlap(other.start, other.stop)
        (low, high), (other_low, other_high) = self.col_range, other.col_range
        col_low, col_high = max(low, other_low), min(high, other_high)
        if rows is None or col_low >= col_high:
            return None
        return Placement(self.name, self.shape, *rows, col_low, col_high)

    def view(self, tensor: torch.Tensor, block: Placement) -> torch.Tensor:
        """The part of `tensor`, which holds this placement, that holds `block` (a block
        inside this one): a view, to read from or copy into."""
        part = as_rows(tensor)[block.start - self.start:block.stop - self.start]
        if part.dim() < 2:
            return part  # one column: nothing to cut
        low, _ = self.col_range
        block_low, block_high = block.col_range
        return part[:, block_low - low:block_high - low]


def place_whole(model: nn.Module) -> None:
    """Tag every parameter and buffer (a BatchNorm's running statistics) of `model` with its
    name and whole extent."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        place_whole_tensor(tensor, name)


def place_whole_tensor(tensor: torch.Tensor, name: str) -> None:
    """Tag `tensor` as the whole global tensor `name` (what a checkpoint keys it by)."""
    shape = tuple(tensor.shape)
    setattr(tensor, _ATTRIBUTE, Placement(name, shape, 0, global_rows(shape)))


def _within(part: slice, length: int, what: str) -> tuple[int, int]:
    """[start, stop) of `part` of a dim of `length` (None: from its start, to its end)."""
    start = 0 if part.start is None else part.start
    stop = length if part.stop is None else part.stop
    if part.step not in (None, 1) or not 0 <= start <= stop <= length:
        step = "" if part.step is None else f":{part.step}"
        raise ValueError(f"{what} {start}:{stop}{step} are not a contiguous range of the "
                         f"{length} {what} of the source")
    return start, stop


def place_block(shard: torch.Tensor, source: torch.Tensor, rows: slice, cols: slice) -> None:
    """Tag `shard`, made of `source[rows, cols]` (rows of dim 0, columns of dim 1 of the
    source: a slice of None means all of them), with its place in the global tensor; the
    source may itself be a shard. Only a tensor of two dims or more has columns to split: a
    vector's `cols` is slice(None). Raises ValueError for a range outside the source."""
    origin = placement_of(source)
    if origin is None:
        return  # an untagged model (built outside the runner): nothing to record
    if len(origin.shape) < 2 and (cols.start, cols.stop, cols.step) != (None, None, None):
        raise ValueError(f"{origin.name} has shape {list(origin.shape)}: no columns to split "
                         f"(its columns are slice(None))")
    row_low, row_high = _within(rows, origin.rows, "rows")
    col_low, col_high = _within(cols, origin.cols, "columns")
    first_col = origin.col_start
    setattr(shard, _ATTRIBUTE, Placement(origin.name, origin.shape, origin.start + row_low,
                                         origin.start + row_high, first_col + col_low,
                                         first_col + col_high))


def place_rows(shard: torch.Tensor, source: torch.Tensor, rows: slice) -> None:
    """Tag `shard`, made of `rows` of `source` (every column the source holds), with its
    place in the global tensor."""
    place_block(shard, source, rows, slice(None))


def placement_of(param: torch.Tensor) -> Placement | None:
    return getattr(param, _ATTRIBUTE, None)
