"""Which device a rank trains on, and how its collectives reach that device's memory.

`trainer.device=cuda`: each rank takes one of the GPUs it sees. A site may bind GPUs any way:
every rank of a node sees all of the node's GPUs, each rank sees only its own (Slurm's
`--gpus-per-task`, a `CUDA_VISIBLE_DEVICES` per rank), or each sees a subset. A rank that sees
one GPU takes it; one that sees several takes GPU `k % count`, `k` being its place among the
ranks of its node that see the same GPUs (its local rank when every rank sees all of them).
`auto` is cuda where torch sees a GPU; under `cpu` nothing here asks torch.cuda anything.

Whether ranks share a GPU is read from the GPUs' identities, not from counts (a rank bound to
one GPU sees a count of 1 whatever the node holds): each rank reads the UUID of the GPU it took
(`torch.cuda.get_device_properties(i).uuid`), the UUIDs are all-gathered over the job, and
"one rank per GPU" holds when no two ranks have the same. Ranks that share a GPU still run:
rank 0 warns once at start how many ranks share which GPU, and `summary.json`'s
`device_buffers` says so too.

How device buffers travel (`runner.core.grid.DevicePaths`):
- `comm.backend=mpi`: straight to MPI when it is CUDA-aware (`comm.cuda_aware=true`, or `auto`
  and the library's version string says it was built with CUDA), else staged through pinned host
  buffers;
- `comm.backend=torch`: NCCL when one rank per GPU holds (NCCL refuses two ranks on one GPU),
  else staged through host buffers into gloo. Decided by every rank from the same all-gathered
  facts, so all agree.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runner.config.schema import RunConfig
from runner.core import Backend, DevicePaths
from runner.records.logs import get_logger


class CudaQueries(Protocol):
    """What placement asks torch.cuda (a stand-in in unit tests)."""

    def visible(self) -> list[str]:
        """The UUIDs of the GPUs this process sees, by device index (none: no GPU)."""
        ...

    def set_device(self, index: int) -> None:
        ...


class TorchCuda:
    """`CudaQueries` answered by torch.cuda."""

    def visible(self) -> list[str]:
        if not torch.cuda.is_available():
            return []
        return [str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())]

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)


@dataclass(frozen=True)
class Placement:
    """This rank's device and its place on its node."""

    device: torch.device
    local_rank: int = 0
    local_size: int = 1  # ranks on this node
    gpus: int = 0  # GPUs this rank sees (under CUDA_VISIBLE_DEVICES, its share of the node's)
    uuid: str | None = None  # the UUID of this rank's GPU
    node: str = ""  # the host's name, to say where a shared GPU is


def _node_comm(mpi_comm: Any | None) -> Any | None:
    """The ranks of this rank's node (a split: collective over `mpi_comm`); None for one
    process. The caller frees it."""
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        return None
    from mpi4py import MPI

    return mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)


def place_rank(setting: str, mpi_comm: Any | None,
               cuda: CudaQueries | None = None) -> Placement:
    """This rank's device for `trainer.device` (validated: cpu, cuda or auto). Collective over
    `mpi_comm` unless the setting is cpu (its node's ranks are found with a split)."""
    if setting == "cpu":
        return Placement(torch.device("cpu"), node=socket.gethostname())
    node = _node_comm(mpi_comm)
    try:
        return place_on_node(setting, node, cuda or TorchCuda(), socket.gethostname())
    finally:
        if node is not None:
            node.Free()


def place_on_node(setting: str, node_comm: Any | None, cuda: CudaQueries,
                  node: str) -> Placement:
    """`place_rank` among the ranks of one node (`node_comm`, None: alone on it), `setting`
    cuda or auto. Collective over `node_comm`: every rank of the node says which GPUs it sees."""
    visible = tuple(cuda.visible())
    local_rank, local_size = ((0, 1) if node_comm is None
                              else (node_comm.Get_rank(), node_comm.Get_size()))
    seen = [visible] if node_comm is None else [tuple(s) for s in node_comm.allgather(visible)]
    if not visible:
        if setting == "auto":
            return Placement(torch.device("cpu"), local_rank, local_size, 0, None, node)
        raise RuntimeError("trainer.device=cuda: torch sees no GPU on this rank (none on its "
                           "node, or CUDA_VISIBLE_DEVICES hides them)")
    # Ranks that see the same GPUs spread over them in local-rank order.
    peers = [rank for rank, other in enumerate(seen) if other == visible]
    index = peers.index(local_rank) % len(visible)
    cuda.set_device(index)
    return Placement(torch.device("cuda", index), local_rank, local_size, len(visible),
                     visible[index], node)


def shared_gpus(
        facts: Sequence[tuple[str, str] | None]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The GPUs several ranks hold, from every rank's (node, GPU UUID), None for a rank on the
    host: each as ("UUID on node", its ranks), in the order of their first rank."""
    holders: dict[str, list[int]] = {}
    where: dict[str, str] = {}
    for rank, fact in enumerate(facts):
        if fact is not None:
            node, uuid = fact
            holders.setdefault(uuid, []).append(rank)
            where.setdefault(uuid, node)
    return tuple((f"{uuid} on {where[uuid]}" if where[uuid] else uuid, tuple(ranks))
                 for uuid, ranks in holders.items() if len(ranks) > 1)


def mpi_is_cuda_aware() -> bool:
    """Whether the MPI library says it was built with CUDA: MPICH and MVAPICH print their
    configure line in the version string (`--with-cuda`, `--enable-cuda`), Open MPI names its
    CUDA support there when it has it. Anything else: not known to be, so staged."""
    from mpi4py import MPI

    text = MPI.Get_library_version().lower()
    return any(mark in text for mark in ("--with-cuda", "--enable-cuda", "cuda-aware",
                                         "mvapich2-gdr"))


def device_paths(run: RunConfig, placement: Placement, mpi_comm: Any | None) -> DevicePaths:
    """How this run's collectives reach device memory (the module docstring). Collective over
    `mpi_comm` unless `trainer.device=cpu`: every rank's GPU is all-gathered. Rank 0 warns when
    ranks share a GPU."""
    stage_host = run.debug.stage_host_tensors
    if run.trainer.device == "cpu":
        return DevicePaths("cpu", stage_host=stage_host)
    size = 1 if mpi_comm is None else mpi_comm.Get_size()
    mine = None if placement.uuid is None else (placement.node, placement.uuid)
    facts = [mine] if mpi_comm is None or size == 1 else list(mpi_comm.allgather(mine))
    hosts = [rank for rank, fact in enumerate(facts) if fact is None]
    if len(hosts) == len(facts):  # auto, and no rank sees a GPU
        return DevicePaths("cpu", stage_host=stage_host)
    if hosts:  # auto on nodes of which some have no GPU: every rank sees it and refuses
        raise RuntimeError(f"trainer.device={run.trainer.device}: ranks {_ranks(hosts)} see no "
                           f"GPU and the others do; set trainer.device=cpu, or run on nodes "
                           f"that all have GPUs")
    shared = shared_gpus(facts)
    backend: Backend = "torch" if run.comm.backend == "torch" else "mpi"  # validated
    if backend == "torch":
        direct = not shared
    else:
        aware = str(run.comm.cuda_aware).lower()
        direct = aware == "true" or (aware == "auto" and mpi_comm is not None
                                     and mpi_is_cuda_aware())
    paths = DevicePaths(placement.device.type, direct=direct, stage_host=stage_host,
                        shared=shared)
    if shared and (mpi_comm is None or mpi_comm.Get_rank() == 0):
        why = " (NCCL takes one rank per GPU)" if backend == "torch" else ""
        line = f"{paths.sharing()}; device buffers: {paths.path(backend)}{why}"
        get_logger().warning("%s", line)
        print(f"warning: {line}", file=sys.stderr, flush=True)  # one line, never wrapped
    return paths


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def describe_device(device: torch.device) -> str:
    """The device as the summary names it: "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
