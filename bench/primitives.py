"""The core primitives against raw mpi4py, and the grid fully-connected layer, in one MPI job.

    python bench/primitives.py [--ranks 4] [--repeats 30]

1. Each primitive (the operator a layer calls: allocation of its output, counting and all) against
   the raw mpi4py collective a user would write on the same buffers with a preallocated output,
   for payloads of 4 KiB, 256 KiB and 4 MiB. Rounds alternate primitive and raw call; medians.
   Target: ratio (primitive / raw) within 1.10.
2. A 4096 x 4096 fully-connected layer, global batch 256, one torch thread per rank: forward +
   backward + gradient exchange, median over repetitions, on the 2 x 2 grid, and on the layouts a
   user would otherwise pick on the same 4 ranks: 4 x 1 (model) and 1 x 4 (data).
Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from timing import barrier_timed, run_worker

SIZES_BYTES = (4 << 10, 256 << 10, 4 << 20)


def _median_pair(fn_a, fn_b, repeats: int, comm) -> tuple[float, float]:
    """Medians of fn_a and fn_b, alternating, each timed between barriers."""
    times_a, times_b = [], []
    for _ in range(3):  # warm-up: first calls pay connection set-up
        fn_a()
        fn_b()
    for _ in range(repeats):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def primitive_cases(comm, counted, nbytes: int):
    """(name, primitive call, raw mpi4py call) on the same buffers."""
    import torch
    from mpi4py import MPI

    from runner.core import Partition
    from runner.core import primitives as P

    size, rank = comm.Get_size(), comm.Get_rank()
    n = nbytes // 4
    x = torch.randn(n)
    out = torch.empty(n)
    rows = max(size, n // 64)
    part = Partition(rows, size)
    piece = torch.randn(part.sizes[rank], 64)
    whole = torch.empty(rows, 64)
    full = torch.randn(rows, 64)
    mine = torch.empty(part.sizes[rank], 64)
    counts = [s * 64 for s in part.sizes]
    displs = [o * 64 for o in part.offsets]
    # repartition: rows split -> columns split of a (rows x 64*size) matrix
    cols = Partition(64 * size, size)
    block_in = torch.randn(part.sizes[rank], cols.total)
    send = torch.empty(block_in.numel())
    recv = torch.empty(rows * cols.sizes[rank])
    send_counts = [part.sizes[rank] * c for c in cols.sizes]
    recv_counts = [r * cols.sizes[rank] for r in part.sizes]

    def raw_alltoall():
        # what a user must do too: pack column blocks contiguously, exchange, unpack
        offset = 0
        for k in range(size):
            blk = block_in[:, cols.offsets[k]:cols.offsets[k] + cols.sizes[k]]
            send[offset:offset + blk.numel()].view(blk.shape).copy_(blk)
            offset += blk.numel()
        comm.Alltoallv([send, (send_counts, None)], [recv, (recv_counts, None)])
        torch.cat([recv[sum(recv_counts[:k]):sum(recv_counts[:k + 1])].view(part.sizes[k], -1)
                   for k in range(size)], dim=0)

    return [
        ("broadcast", lambda: P.broadcast_op(x, counted), lambda: comm.Bcast(out, root=0)),
        ("sum_reduce", lambda: P.sum_reduce_op(x, counted),
         lambda: comm.Reduce(x, out if rank == 0 else None, op=MPI.SUM, root=0)),
        ("all_sum_reduce", lambda: P.all_sum_reduce_op(x, counted),
         lambda: comm.Allreduce(x, out, op=MPI.SUM)),
        ("all_gather", lambda: P.all_gather_op(piece, counted, 0, part),
         lambda: comm.Allgatherv(piece, [whole, (counts, displs)])),
        ("reduce_scatter", lambda: P.reduce_scatter_op(full, counted, 0, part),
         lambda: comm.Reduce_scatter(full, mine, counts, op=MPI.SUM)),
        ("repartition", lambda: P.repartition_op(block_in, counted, 0, part, 1, cols),
         raw_alltoall),
    ]


def bench_primitives(repeats: int) -> list[dict]:
    from mpi4py import MPI

    from runner.core import CommCounter, CountedComm

    comm = MPI.COMM_WORLD
    counted = CountedComm(comm, CommCounter())
    results = []
    for nbytes in SIZES_BYTES:
        for name, ours, raw in primitive_cases(comm, counted, nbytes):
            t_ours, t_raw = _median_pair(ours, raw, repeats, comm)
            results.append({"primitive": name, "payload_bytes": nbytes, "gridrun_s": t_ours,
                            "raw_mpi4py_s": t_raw, "ratio": t_ours / t_raw})
    return results


def bench_fc_layer(repeats: int) -> list[dict]:
    import torch
    from mpi4py import MPI
    from torch import nn

    from runner.core import ProcessGrid
    from strategies import STRATEGIES

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    results = []
    layouts = [("grid", 2, size // 2), ("model", size, 1), ("data", 1, size)]
    for strategy, pr, pc in layouts:
        torch.manual_seed(0)
        layer = nn.Sequential(nn.Linear(4096, 4096))
        grid = ProcessGrid(pr, pc, comm)
        pmodel = STRATEGIES.get(strategy)().parallelize(layer, (4096,), grid)
        x = torch.randn(256, 4096)[pmodel.input_rows(256)]
        probe = torch.randn(256, 4096)[pmodel.output_rows(256)]

        def step(pmodel=pmodel, x=x, probe=probe) -> None:
            pmodel.zero_grad()
            (pmodel(x) * probe).sum().backward()
            pmodel.finish_gradient_sync()

        times = barrier_timed(comm, step, repeats)
        before = grid.counter.snapshot()
        step()
        moved = grid.counter.since(before).nbytes
        results.append({"strategy": strategy, "pr": pr, "pc": pc,
                        "median_fwd_bwd_s": statistics.median(times),
                        "param_bytes_per_rank": pmodel.param_bytes(),
                        "comm_bytes_per_step_rank0": moved})
    return results


def worker(repeats: int) -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    primitives = bench_primitives(repeats)
    layer = bench_fc_layer(max(5, repeats // 3))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(json.dumps({"ranks": MPI.COMM_WORLD.Get_size(), "primitives": primitives,
                          "fc_layer_4096x4096_batch256": layer}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.repeats)
        return
    result = run_worker(__file__, args.ranks, "--repeats", str(args.repeats))
    result["benchmark"] = "primitives"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
