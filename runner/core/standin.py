"""Rank 0 of a grid, alone: for building rank 0's part of a model (its local shapes) where the
other ranks are not running — a prediction before any rank starts.

A strategy's `parallelize` reads of its grid only the ranks' sizes and indices while it splits
a model; what it moves in a forward or backward goes through the grid's communicators. A
stand-in grid has the shape of the real one and communicators that say their sizes and move
nothing (`ShapeOnlyTransport`): a build on it, of a copy of the model on the meta device, is
exactly rank 0's, and costs no memory.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from runner.core.comm import CountedComm, GroupName
from runner.core.grid import GridShape, ProcessGrid
from runner.core.mpi_transport import Backend, Transport


class _Done:
    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class ShapeOnlyTransport:
    """Rank 0 of a group of `size` ranks whose operations complete at once and move nothing
    (their outputs keep what they held: on the meta device, only their shapes)."""

    backend: Backend = "mpi"

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size

    def allreduce_(self, tensor: torch.Tensor) -> None:
        return None

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        return None

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        return None

    def iallreduce_(self, tensor: torch.Tensor) -> _Done:
        return _Done()

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> _Done:
        return _Done()

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> _Done:
        return _Done()

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        return None

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        return None

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        return None

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        return None

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.size

    def barrier(self) -> None:
        return None


def rank_zero_grid(shape: GridShape) -> ProcessGrid:
    """Rank 0 of a grid of `shape` (model index 0, batch index 0), its communicators
    `ShapeOnlyTransport`s of the groups' sizes."""
    grid = ProcessGrid(1, 1)
    grid.shape = shape
    def comm(name: GroupName, size: int) -> CountedComm:
        transport = cast(Transport, ShapeOnlyTransport(size)) if size > 1 else None
        return CountedComm(None, grid.counter, name, transport)

    grid.world = comm("world", shape.size)
    grid.model = comm("model", shape.pr)
    grid.batch = comm("batch", shape.pc)
    return grid
