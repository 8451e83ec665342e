"""The `Pr × Pc` process grid with named dimensions.

`Pr` ranks split the model (or each sample's domain): DESIGN.md calls them the *row group*,
here `grid.model`. `Pc` ranks split the batch: the *column group*, here `grid.batch`.
World rank = batch_index · Pr + model_index, so a model group is a block of consecutive ranks
(the heavier model-parallel traffic stays between neighbours, usually on one node).

The groups are MPI Cartesian communicators; `backend` says how their collectives travel:
"mpi" (mpi4py on those communicators) or "torch" (torch.distributed process groups over the same
ranks, in the same order: `runner.core.torchdist`, which needs `init_torch_distributed` first).
Under either backend the grid keeps its MPI communicators (`CountedComm.communicator`): the
one-sided windows of `runner.core.rma` (the EASGD family's centre) are MPI's and stay on MPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.core.comm import BACKENDS, Backend, CommCounter, CountedComm, Transport


@dataclass(frozen=True)
class GridShape:
    pr: int
    pc: int

    @property
    def size(self) -> int:
        return self.pr * self.pc


class ProcessGrid:
    """Process grid over a world communicator; `mpi_comm=None` means a 1 × 1 grid, no MPI.

    Collective over `mpi_comm` (and, under backend "torch", the first grid over some ranks
    creates their process groups: collective over those ranks)."""

    def __init__(self, pr: int, pc: int, mpi_comm: Any | None = None,
                 counter: CommCounter | None = None, backend: Backend = "mpi") -> None:
        if pr < 1 or pc < 1:
            raise ValueError(f"grid dimensions must be >= 1, got pr={pr}, pc={pc}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown communication backend {backend!r}; one of "
                             f"{', '.join(BACKENDS)}")
        self.shape = GridShape(pr, pc)
        self.backend: Backend = backend
        self.counter = counter if counter is not None else CommCounter()
        world_size = 1 if mpi_comm is None else mpi_comm.Get_size()
        if world_size != pr * pc:
            raise ValueError(f"grid {pr}x{pc} needs {pr * pc} ranks, the communicator has "
                             f"{world_size}")
        if mpi_comm is not None and world_size > 1:
            # Cartesian topology: dims ordered (batch, model) so model groups are contiguous.
            cart = mpi_comm.Create_cart([pc, pr], periods=[False, False], reorder=False)
            self.batch_index, self.model_index = cart.Get_coords(cart.Get_rank())
            model, batch = cart.Sub([False, True]), cart.Sub([True, False])
            transports: list[Transport | None] = [None, None, None]  # None: mpi4py on each
            if backend == "torch":
                from runner.core.torchdist import grid_transports

                transports = list(grid_transports([cart, model, batch]))
            self.world = CountedComm(cart, self.counter, "world", transports[0])
            self.model = CountedComm(model, self.counter, "model", transports[1])
            self.batch = CountedComm(batch, self.counter, "batch", transports[2])
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
                f"model_index={self.model_index}, batch_index={self.batch_index}"
                f"{', backend=torch' if self.backend == 'torch' else ''})")
