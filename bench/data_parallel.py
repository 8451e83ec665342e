"""strategy=data against PyTorch DistributedDataParallel (gloo), on the same ranks, same run.

    python bench/data_parallel.py [--ranks 2 4] [--steps 30] [--rounds 3]

For each P it starts one MPI job. Every rank builds the same MLP (512→2048→2048→10, one torch
thread per rank) and trains it on a fixed random global batch of 256 split over the ranks, in
alternating rounds: gridrun's `data` strategy (bucketed MPI all-reduce from gradient hooks), then
DDP on gloo, then gridrun again, ... so slow drifts of a shared 2-core machine hit both alike.
A step is forward + backward + gradient averaging + SGD update; rank 0 times each step. Both
start from the same weights and must end with the same weights (checked and reported), so the
two sides demonstrably do the same work. Prints JSON: median step times and their ratio
(gridrun / DDP; below 1 means gridrun is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from timing import free_port, run_worker

LAYERS = (512, 2048, 2048, 10)
GLOBAL_BATCH = 256


def build_model():
    import torch

    from runner.zoo.models import mlp

    torch.manual_seed(0)
    return mlp((LAYERS[0],), LAYERS[-1], hidden=LAYERS[1:-1])


def timed_steps(model, step_fn, optimizer, x, y, steps: int) -> list[float]:
    import torch.nn.functional as F

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step_fn["zero"]()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        step_fn["sync"]()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def worker(steps: int, rounds: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    from runner.core import ProcessGrid
    from strategies.data import DataParallel

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    generator = torch.Generator().manual_seed(1)
    x_all = torch.randn(GLOBAL_BATCH, LAYERS[0], generator=generator)
    y_all = torch.randint(0, LAYERS[-1], (GLOBAL_BATCH,), generator=generator)
    local = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    x, y = x_all[local], y_all[local]

    grid = ProcessGrid(1, size, comm)
    ours = DataParallel().parallelize(build_model(), (LAYERS[0],), grid)
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.01)
    ours_fns = {"zero": ours.zero_grad, "sync": ours.finish_gradient_sync}

    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    ddp = DistributedDataParallel(build_model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ddp_fns = {"zero": lambda: ddp_opt.zero_grad(set_to_none=False), "sync": lambda: None}

    results: dict[str, list[float]] = {"gridrun": [], "ddp": []}
    for _ in range(rounds):
        for name, model, fns, opt in (("gridrun", ours, ours_fns, ours_opt),
                                      ("ddp", ddp, ddp_fns, ddp_opt)):
            comm.Barrier()
            times = timed_steps(model, fns, opt, x, y, steps + warmup)
            results[name] += times[warmup:]

    # Same start, same data, same number of steps: the weights must agree.
    diff = max((a - b).abs().max().item()
               for a, b in zip(ours.module.parameters(), ddp.module.parameters(), strict=True))
    dist.destroy_process_group()
    if rank == 0:
        medians = {k: statistics.median(v) for k, v in results.items()}
        print(json.dumps({
            "ranks": size, "steps_timed": len(results["gridrun"]),
            "gridrun_median_step_s": medians["gridrun"], "ddp_median_step_s": medians["ddp"],
            "ratio": medians["gridrun"] / medians["ddp"],
            "max_weight_difference": diff,
        }))



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds, args.warmup)
        return
    runs = [run_worker(__file__, ranks, "--steps", str(args.steps), "--rounds", str(args.rounds),
                       "--warmup", str(args.warmup)) for ranks in args.ranks]
    print(json.dumps({"benchmark": "data_parallel", "model": list(LAYERS),
                      "global_batch": GLOBAL_BATCH, "threads_per_rank": 1, "runs": runs},
                     indent=2))


if __name__ == "__main__":
    main()
