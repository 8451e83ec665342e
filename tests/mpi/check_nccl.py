"""NCCL between GPUs, one rank on each: `mpiexec -n P python THIS --backend=torch` (P GPUs:
NCCL refuses two ranks on one GPU). Launched by tests/test_gpu.py where the machine has them.

Every operation of the counted communicator on CUDA tensors of a grid whose groups use NCCL
(`DevicePaths("cuda", direct=True)`) against the same operation on host tensors of the same grid
(its gloo groups): the same results (whole numbers: exact in any order of summation) and the same
records, and nothing staged through the host. Halos and the ring shift go by `batch_isend_irecv`.
Operations on the GPU are timed by CUDA events, resolved when the totals are read.

`... THIS hang --backend=torch` (2 GPUs): rank 1 sleeps outside any collective while rank 0's
all-reduce on the GPU never completes. Rank 0's host is not blocked in it (NCCL returns at once)
but in `torch.cuda.synchronize()`, as a step's loss read would be; its watchdog (1 s) sees the
operation in flight on the device and aborts the job, as `runner.training.rank` does.
"""

from __future__ import annotations

import sys
import time

import torch
from harness import BACKEND, COMM_TIMEOUT_S, check, run_checks
from mpi4py import MPI

from runner.core import CommWatchdog, DevicePaths, Partition, ProcessGrid
from runner.core import halo as H
from runner.core import primitives as P
from runner.core.torchdist import process_group_timeout

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MODE = sys.argv[1] if len(sys.argv) > 1 else "checks"
assert BACKEND == "torch", "NCCL is backend 'torch'"
torch.cuda.set_device(RANK % torch.cuda.device_count())  # before any NCCL group
DEVICE = torch.device("cuda", torch.cuda.current_device())
ON_GPUS = DevicePaths("cuda", direct=True)


def whole_numbers(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 8
    return values.round().to(dtype)


def grids() -> list[ProcessGrid]:
    """Every grid over the world's ranks (collective: the same order on every rank)."""
    shapes = [(1, SIZE), (SIZE, 1)] + ([(2, SIZE // 2)] if SIZE % 2 == 0 and SIZE > 2 else [])
    return [ProcessGrid(pr, pc, WORLD, backend="torch", devices=ON_GPUS) for pr, pc in shapes]


GRIDS = grids() if MODE == "checks" else []


def on_both(grid: ProcessGrid, run) -> None:
    """`run(device)` on the host and on the GPU: equal results, equal records."""
    outcomes = []
    for device in (torch.device("cpu"), DEVICE):
        grid.counter.keep_records = True
        results = [t.cpu() for t in run(device)]
        grid.counter.snapshot()  # the GPU's seconds resolved
        records = [(r.op, r.group, r.group_size, r.nbytes, r.label)
                   for r in grid.counter.records]
        assert all(r.seconds >= 0 for r in grid.counter.records)
        assert not grid.counter._on_device, "every device operation resolved"
        grid.counter.records.clear()
        outcomes.append((results, records))
    (host, host_records), (gpu, gpu_records) = outcomes
    assert host_records == gpu_records and host_records, (host_records, gpu_records)
    for a, b in zip(host, gpu, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


@check
def the_groups_move_gpu_tensors_by_nccl_and_host_tensors_by_gloo() -> None:
    """Not staged; each backend with the process groups' timeout."""
    for grid in GRIDS:
        for comm in (grid.world, grid.model, grid.batch):
            if comm.size == 1:
                continue
            transport = comm.transport
            assert type(transport).__name__ == "TorchTransport", transport  # not staged
            backends = transport.groups.backends  # type: ignore[union-attr]
            assert sorted(backends) == ["cpu", "cuda"], backends
            assert type(backends["cuda"]).__name__ == "ProcessGroupNCCL", backends
            for backend in backends.values():  # from the communication timeout, both
                assert backend.options._timeout == process_group_timeout(COMM_TIMEOUT_S)
            assert transport.stream_ordered(torch.zeros(1, device=DEVICE))  # type: ignore[union-attr]
            assert not transport.stream_ordered(torch.zeros(1))  # type: ignore[union-attr]


@check
def collectives_on_gpus_equal_the_host_path() -> None:
    for grid in GRIDS:
        for comm in (grid.world, grid.model, grid.batch):
            if comm.size == 1:
                continue
            size, rank = comm.size, comm.rank
            for dtype in (torch.float32, torch.bfloat16):

                def reductions(device: torch.device, comm=comm, dtype=dtype) -> list:
                    x = whole_numbers((5, 3), 10 + comm.rank, dtype).to(device)
                    out = torch.empty_like(x)
                    root = comm.size - 1
                    reduced = torch.empty_like(x) if comm.rank == root else None
                    pending = comm.iallreduce_(x.clone(), "iallreduce")
                    results = [comm.allreduce_(x.clone(), "allreduce_"),
                               comm.allreduce(x, out, "allreduce"),
                               comm.bcast_(x.clone(), root, "bcast")]
                    comm.reduce(x, reduced, root, "reduce")
                    pending.wait()
                    return results + ([reduced] if reduced is not None else [])

                on_both(grid, reductions)
            for total in (2 * size, 2 * size + 1, max(size - 1, 1)):  # even, uneven, empty pieces
                part = Partition(total, size)
                counts = part.counts(3)

                def gathers(device: torch.device, comm=comm, part=part, counts=counts) -> list:
                    whole = whole_numbers((part.total, 3), 20, torch.float32).to(device)
                    piece = whole[part.slice(comm.rank)].clone()
                    gathered = torch.full_like(whole, -1)
                    comm.allgatherv_(piece, gathered, counts, "allgather")
                    started = torch.full_like(whole, -1)
                    comm.iallgatherv_(piece, started, counts, "iallgather").wait()
                    full = whole_numbers((part.total, 3), 30 + comm.rank, torch.float32)
                    scattered = torch.full((part.sizes[comm.rank], 3), -1.0, device=device)
                    comm.reduce_scatter_(full.to(device), scattered, counts, "reduce_scatter")
                    assert torch.equal(gathered, whole)
                    return [gathered, started, scattered]

                on_both(grid, gathers)

            def all_to_all(device: torch.device, comm=comm, size=size, rank=rank) -> list:
                send_counts = [(rank + k) % 3 for k in range(size)]  # some empty
                recv_counts = [(k + rank) % 3 for k in range(size)]  # what rank k sends here
                send = whole_numbers((sum(send_counts),), 40 + rank, torch.float32).to(device)
                recv = torch.full((sum(recv_counts),), -1.0, device=device)
                comm.alltoallv_(send, send_counts, recv, recv_counts, "alltoallv")
                return [recv]

            on_both(grid, all_to_all)


@check
def halo_and_ring_exchanges_on_gpus_by_batch_isend_irecv() -> None:
    for grid in GRIDS:
        for comm in (grid.world, grid.model, grid.batch):
            if comm.size == 1:
                continue
            for n_in, window in ((3 * comm.size + 2, H.Window(3, 1, 1)),
                                 (comm.size + 1, H.Window(5, 1, 2)),  # halos wider than slabs
                                 (2 * comm.size + 5, H.Window(3, 2, 1))):
                if window.out_size(n_in) < comm.size:
                    continue
                plan = H.HaloPlan(n_in, window, comm.size, comm.rank)

                def halos(device: torch.device, comm=comm, plan=plan, n_in=n_in) -> list:
                    whole = whole_numbers((2, 3, n_in, 4), 50, torch.float32).to(device)
                    lo, hi = plan.own_rows
                    slab = whole[:, :, lo:hi].clone()
                    window_rows = H.halo_exchange_op(slab, comm, 2, plan, "halo")
                    back = H.halo_accumulate_op(window_rows, comm, 2, plan, "halo back")
                    assert torch.equal(window_rows, whole[:, :, slice(*plan.window_rows)])
                    return [window_rows, back]

                on_both(grid, halos)
            sizes = tuple(Partition(2 * comm.size + 1, comm.size).sizes)

            def ring(device: torch.device, comm=comm, sizes=sizes) -> list:
                x = whole_numbers((sizes[comm.rank], 4), 60 + comm.rank, torch.float32)
                return [P.ring_shift_op(x.to(device), comm, 0, sizes, 1, "ring"),
                        P.ring_shift_op(x.to(device), comm, 0, sizes, -1, "ring back")]

            on_both(grid, ring)


@check
def gpu_communication_is_timed_by_cuda_events() -> None:
    """The seconds of a large all-reduce on the GPU are the stream's, not the host's ~0."""
    grid = GRIDS[0]
    x = torch.ones(64 * 2**20 // 4, device=DEVICE)  # 64 MiB
    before = grid.counter.snapshot()
    for _ in range(3):
        grid.world.allreduce_(x, "big")
    assert grid.counter._on_device, "timed on the device, resolved later"
    spent = grid.counter.since(before)
    assert spent.calls == 3 and spent.nbytes == 3 * x.numel() * 4
    assert spent.seconds > 1e-4, spent  # 3 × 64 MiB between GPUs: well over 0.1 ms
    assert not grid.counter._on_device


def hang() -> None:
    grid = ProcessGrid(1, SIZE, WORLD, backend="torch", devices=ON_GPUS)

    def on_timeout(message: str, in_flight: object) -> None:
        time.sleep(1.0)  # as runner.training.rank: the watchdog's line through the launcher
        WORLD.Abort(1)

    watchdog = CommWatchdog(grid.counter, 1.0, grid.rank, on_timeout).start()
    x = torch.ones(1000, device=DEVICE)
    grid.world.allreduce_(x, label="warm")  # both ranks arrive: completes
    torch.cuda.synchronize()
    if grid.rank == 1:
        time.sleep(120)  # hung outside any collective: the test ends long before
    else:
        grid.world.allreduce_(x, label="hang")
        print("issued", flush=True)  # NCCL returned: the host is not blocked in it
        torch.cuda.synchronize()  # as a step's loss read: blocked on the device
    watchdog.stop()
    print("not reached", flush=True)


if __name__ == "__main__":
    if MODE == "hang":
        hang()
    else:
        run_checks()
