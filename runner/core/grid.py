"""The `Pr × Pc` process grid with named dimensions.

`Pr` ranks split the model (or each sample's domain): docs/design.md calls them the *row group*,
here `grid.model`. `Pc` ranks split the batch: the *column group*, here `grid.batch`.
World rank = batch_index · Pr + model_index, so a model group is a block of consecutive ranks
(the heavier model-parallel traffic stays between neighbours, usually on one node).

The groups are MPI Cartesian communicators; `backend` says how their collectives travel:
"mpi" (mpi4py on those communicators) or "torch" (torch.distributed process groups over the same
ranks, in the same order: `runner.core.torch_transport`, which needs
`runner.core.torchdist.init_torch_distributed` first). Under either backend the grid keeps its
MPI communicators (`CountedComm.communicator`): the one-sided windows of `runner.core.rma` (the
EASGD family's centre) are MPI's and stay on MPI.

Device tensors (`devices`, a `DevicePaths`): a transport that moves host memory only (an MPI
without CUDA support; gloo) is wrapped in `runner.core.staging.StagedTransport`, which copies
device buffers through pinned host buffers; with `direct` the device buffers go to the
transport as they are (a CUDA-aware MPI; NCCL groups under "torch", one GPU per rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.core.comm import CommCounter, CountedComm
from runner.core.mpi_transport import BACKENDS, Backend, MpiTransport, Transport


@dataclass(frozen=True)
class GridShape:
    pr: int
    pc: int

    @property
    def size(self) -> int:
        return self.pr * self.pc


@dataclass(frozen=True)
class DevicePaths:
    """How a grid's collectives reach tensors that live on a device."""

    device_type: str = "cpu"
    """Where the run's tensors live: "cpu" (nothing to arrange), "cuda"."""
    direct: bool = False
    """Device buffers go to the transport as they are (CUDA-aware MPI; NCCL under "torch");
    otherwise they are staged through host buffers."""
    stage_host: bool = False
    """Stage host tensors too (`debug.stage_host_tensors`: the staged path without a GPU)."""
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """The GPUs several ranks share, each as (the GPU: its UUID and node, the ranks on it)."""

    SHOWN_SHARED = 4  # GPUs named one by one in `sharing`; the rest counted

    @property
    def staged(self) -> bool:
        return self.stage_host or (self.device_type != "cpu" and not self.direct)

    def path(self, backend: Backend) -> str:
        """How device buffers travel between several ranks, in a phrase."""
        if self.device_type == "cpu" and not self.stage_host:
            return "host"
        if self.staged:
            return f"staged through host buffers ({'gloo' if backend == 'torch' else 'MPI'})"
        return "direct (NCCL)" if backend == "torch" else "direct (CUDA-aware MPI)"

    def sharing(self) -> str:
        """The GPUs several ranks share, in words ("" when none)."""
        shown = [f"{len(ranks)} ranks share {gpu} (ranks {', '.join(map(str, ranks))})"
                 for gpu, ranks in self.shared[:self.SHOWN_SHARED]]
        if len(self.shared) > self.SHOWN_SHARED:
            shown.append(f"and {len(self.shared) - self.SHOWN_SHARED} more GPUs are shared")
        return "; ".join(shown)

    def describe(self, backend: Backend, ranks: int) -> str:
        """One phrase for the summary: how device buffers travelled between the grid's `ranks`
        ranks (one rank: no collective ran, whatever the backend), and which GPUs ranks
        shared."""
        if ranks == 1:
            return "none: one rank"
        path = self.path(backend)
        return f"{path}; {self.sharing()}" if self.shared else path


class ProcessGrid:
    """Process grid over a world communicator; `mpi_comm=None` means a 1 × 1 grid, no MPI.

    Collective over `mpi_comm` (and, under backend "torch", the first grid over some ranks
    creates their process groups: collective over those ranks)."""

    def __init__(self, pr: int, pc: int, mpi_comm: Any | None = None,
                 counter: CommCounter | None = None, backend: Backend = "mpi",
                 devices: DevicePaths | None = None) -> None:
        if pr < 1 or pc < 1:
            raise ValueError(f"grid dimensions must be >= 1, got pr={pr}, pc={pc}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown communication backend {backend!r}; one of "
                             f"{', '.join(BACKENDS)}")
        self.shape = GridShape(pr, pc)
        self.backend: Backend = backend
        self.devices = devices if devices is not None else DevicePaths()
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
            comms = [cart, model, batch]
            transports: list[Transport]
            if backend == "torch":
                from runner.core.torch_transport import grid_transports

                nccl = self.devices.direct and self.devices.device_type == "cuda"
                transports = list(grid_transports(comms, device_types=(
                    ("cpu", "cuda") if nccl else ("cpu",))))
            else:
                transports = [MpiTransport(comm) for comm in comms]
            if self.devices.staged:
                from runner.core.staging import StagedTransport

                transports = [StagedTransport(t, force=self.devices.stage_host)
                              for t in transports]
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
