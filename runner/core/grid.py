"""The `Pr × Pc` process grid with named dimensions.

`Pr` ranks split the model (or each sample's domain): DESIGN.md calls them the *row group*,
here `grid.model`. `Pc` ranks split the batch: the *column group*, here `grid.batch`.
World rank = batch_index · Pr + model_index, so a model group is a block of consecutive ranks
(the heavier model-parallel traffic stays between neighbours, usually on one node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.core.comm import CommCounter, CountedComm


@dataclass(frozen=True)
class GridShape:
    pr: int
    pc: int

    @property
    def size(self) -> int:
        return self.pr * self.pc


class ProcessGrid:
    """Process grid over a world communicator; `mpi_comm=None` means a 1 × 1 grid, no MPI."""

    def __init__(self, pr: int, pc: int, mpi_comm: Any | None = None,
                 counter: CommCounter | None = None) -> None:
        if pr < 1 or pc < 1:
            raise ValueError(f"grid dimensions must be >= 1, got pr={pr}, pc={pc}")
        self.shape = GridShape(pr, pc)
        self.counter = counter if counter is not None else CommCounter()
        world_size = 1 if mpi_comm is None else mpi_comm.Get_size()
        if world_size != pr * pc:
            raise ValueError(f"grid {pr}x{pc} needs {pr * pc} ranks, the communicator has "
                             f"{world_size}")
        if mpi_comm is not None and world_size > 1:
            # Cartesian topology: dims ordered (batch, model) so model groups are contiguous.
            cart = mpi_comm.Create_cart([pc, pr], periods=[False, False], reorder=False)
            self.world = CountedComm(cart, self.counter, "world")
            self.batch_index, self.model_index = cart.Get_coords(cart.Get_rank())
            self.model = CountedComm(cart.Sub([False, True]), self.counter, "model")
            self.batch = CountedComm(cart.Sub([True, False]), self.counter, "batch")
        else:
            self.world = CountedComm(None, self.counter, "world")
            self.batch_index, self.model_index = 0, 0
            self.model = CountedComm(None, self.counter, "model")
            self.batch = CountedComm(None, self.counter, "batch")

    @property
    def pr(self) -> int:
        return self.shape.pr

    @property
    def pc(self) -> int:
        return self.shape.pc

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.shape.size

    def __repr__(self) -> str:
        return (f"ProcessGrid({self.pr}x{self.pc}, rank={self.rank}, "
                f"model_index={self.model_index}, batch_index={self.batch_index})")
