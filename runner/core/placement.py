"""Where a rank's tensor sits in the sequential model: the key to re-sharding checkpoints.

Before a strategy transforms the sequential model, every parameter is tagged with its name in
the model's `state_dict` and its whole extent. A strategy that keeps a layer whole reuses the
parameter object, tag and all; one that splits a layer tags the new, smaller parameter with the
rows of the global tensor it holds (`place_rows`). A checkpoint records every shard by its
placement, and loading on any other grid copies the rows each rank needs from whichever shards
hold them (DistDL's view: a partition is an object, a data movement a slice intersection).

Only dim 0 is ever split (rows of W, output channels of a convolution, rows of a bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_ATTRIBUTE = "gridrun_placement"


@dataclass(frozen=True)
class Placement:
    """Rows [start, stop) of dim 0 of the global tensor `name` of shape `shape`."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def overlap(self, start: int, stop: int) -> tuple[int, int] | None:
        """The global rows this placement shares with [start, stop), if any."""
        low, high = max(self.start, start), min(self.stop, stop)
        return (low, high) if low < high else None


def global_rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1  # a scalar is one row


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed with a leading row dim (a scalar becomes one row)."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def place_whole(model: nn.Module) -> None:
    """Tag every parameter and buffer (a BatchNorm's running statistics) of `model` with its
    name and whole extent."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shape = tuple(tensor.shape)
        setattr(tensor, _ATTRIBUTE, Placement(name, shape, 0, global_rows(shape)))


def place_rows(shard: torch.Tensor, source: torch.Tensor, rows: slice) -> None:
    """Tag `shard`, made of `rows` of `source`, with its place in the global tensor."""
    origin = placement_of(source)
    if origin is None:
        return  # an untagged model (built outside the runner): nothing to record
    setattr(shard, _ATTRIBUTE, Placement(origin.name, origin.shape, origin.start + rows.start,
                                         origin.start + rows.stop))


def placement_of(param: torch.Tensor) -> Placement | None:
    return getattr(param, _ATTRIBUTE, None)
