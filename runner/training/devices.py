"""Which device a rank trains on, and how its collectives reach that device's memory.

`trainer.device=cuda`: rank r uses GPU `local rank % GPUs on the node`, the local rank being its
place among the ranks that share its node (`MPI.COMM_TYPE_SHARED`); `auto` is cuda where torch
sees a GPU. How device buffers travel (`runner.core.grid.DevicePaths`):
- `comm.backend=mpi`: straight to MPI when it is CUDA-aware (`comm.cuda_aware=true`, or `auto`
  and the library's version string says it was built with CUDA), else staged through pinned host
  buffers;
- `comm.backend=torch`: NCCL when every rank of the job has a GPU of its own (no node has more
  ranks than GPUs: NCCL refuses two ranks on one GPU), else staged through host buffers into
  gloo. Decided by every rank from the same all-gathered facts, so all agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runner.config.schema import RunConfig
from runner.core import DevicePaths


@dataclass(frozen=True)
class Placement:
    """This rank's device and its place on its node."""

    device: torch.device
    local_rank: int
    local_size: int  # ranks on this node
    gpus: int  # GPUs torch sees on this node


def _local(mpi_comm: Any | None) -> tuple[int, int]:
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        return 0, 1
    from mpi4py import MPI

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def place_rank(setting: str, mpi_comm: Any | None) -> Placement:
    """This rank's device for `trainer.device` (validated: cpu, cuda or auto). Collective over
    `mpi_comm` (its node's ranks are found with a split)."""
    local_rank, local_size = _local(mpi_comm)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "cpu" or (setting == "auto" and gpus == 0):
        return Placement(torch.device("cpu"), local_rank, local_size, gpus)
    if gpus == 0:
        raise RuntimeError("trainer.device=cuda: torch sees no GPU on this rank's node")
    index = local_rank % gpus
    torch.cuda.set_device(index)
    return Placement(torch.device("cuda", index), local_rank, local_size, gpus)


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
    `mpi_comm` under backend "torch" on CUDA (every node's ranks and GPUs are compared)."""
    device_type = placement.device.type
    stage_host = run.debug.stage_host_tensors
    if device_type == "cpu":
        return DevicePaths("cpu", direct=False, stage_host=stage_host)
    if run.comm.backend == "torch":
        facts = [(placement.local_size, placement.gpus)]
        if mpi_comm is not None and mpi_comm.Get_size() > 1:
            facts = mpi_comm.allgather(facts[0])
        direct = all(ranks <= gpus for ranks, gpus in facts)
    else:
        aware = str(run.comm.cuda_aware).lower()
        direct = aware == "true" or (aware == "auto" and mpi_comm is not None
                                     and mpi_is_cuda_aware())
    return DevicePaths(device_type, direct=direct, stage_host=stage_host)


def describe_device(device: torch.device) -> str:
    """The device as the summary names it: "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
