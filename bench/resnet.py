"""ResNet-18 under every strategy and grid of P ranks, against DDP, with the planner's pick.

    python bench/resnet.py [--ranks 1 2 4] [--batch 256] [--steps 3] [--warmup 1]
                           [--widths 64 128 256 512] [--blocks 2 2 2 2]

For each P one MPI job (one torch thread per rank). Every rank builds the CIFAR ResNet-18
(BasicBlocks, BatchNorm, 32×32×3 inputs, 10 classes) from the same seed and trains on a fixed
random global batch. For every strategy and every grid pr × pc = P it accepts (`check_model`),
it times forward + backward + gradient exchange + SGD step (rank 0's wall time per step, every
rank starting each step together), after `--warmup` untimed steps. With P > 1, the same
ranks also run PyTorch's DistributedDataParallel on gloo twice: as users run it (each rank's
BatchNorm on its own rows) and with `nn.SyncBatchNorm` (the batch statistics of every rank:
what gridrun's `data` computes, so the like-for-like comparison; torch's DDP refuses it on CPU,
"SyncBatchNorm layers only work with GPU modules", and the JSON says so). gridrun's ranks talk
through MPI, DDP's through gloo: each with its default transport.

Next to each measurement, the planner's prediction of its communication time (α–β, the
machine's calibration or defaults) and bytes; the JSON names the grid the planner would pick
(least predicted communication) and the one measured fastest. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from typing import Any

from timing import free_port, run_worker

# data twice: BatchNorm over every rank's rows (one process's model), and over each rank's own
# (strategy.batch_norm=local: what DDP without SyncBatchNorm computes)
VARIANTS: list[tuple[str, dict[str, str]]] = [
    ("data", {}), ("data", {"batch_norm": "local"}), ("model", {}), ("grid", {}),
    ("domain", {})]


def build(widths: list[int], blocks: list[int]) -> Any:
    import torch

    from runner.zoo.models import resnet

    torch.manual_seed(0)
    return resnet((3, 32, 32), 10, widths=widths, blocks=blocks)


def timed(model: Any, zero: Any, sync: Any, optimizer: Any, x: Any, y: Any, steps: int,
          warmup: int, comm: Any) -> list[float]:
    import torch.nn.functional as F

    times = []
    for i in range(warmup + steps):
        comm.Barrier()
        start = time.perf_counter()
        zero()
        F.cross_entropy(model(x), y).backward()
        sync()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def worker(batch: int, steps: int, warmup: int, widths: list[int], blocks: list[int],
           only: list[str]) -> None:
    import torch
    from mpi4py import MPI

    from runner.config.machine import load_machine_costs
    from runner.config.registry import load_plugins
    from runner.core import ProcessGrid
    from runner.cost.collectives import step_bytes, step_time
    from strategies import STRATEGIES as REGISTRY

    load_plugins()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    generator = torch.Generator().manual_seed(1)
    x_all = torch.randn(batch, 3, 32, 32, generator=generator)
    y_all = torch.randint(0, 10, (batch,), generator=generator)
    costs = load_machine_costs()
    results: list[dict[str, Any]] = []
    for pr in [d for d in range(1, size + 1) if size % d == 0]:
        pc = size // pr
        grid = ProcessGrid(pr, pc, world if size > 1 else None)
        for name, options in VARIANTS:
            if name not in only:
                continue
            strategy = REGISTRY.get(name)(**options)
            plain = build(widths, blocks)
            problems = (strategy.check(grid.shape, batch)
                        or strategy.check_model(plain, (3, 32, 32), grid.shape))
            if problems:
                continue
            ops = strategy.predict_ops(build(widths, blocks), (3, 32, 32), grid.shape, batch)
            pmodel = strategy.parallelize(plain, (3, 32, 32), grid)
            x = x_all[pmodel.input_rows(batch)]
            y = y_all[pmodel.output_rows(batch)]
            optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.01, momentum=0.9)
            seconds = timed(pmodel, pmodel.zero_grad, pmodel.finish_gradient_sync, optimizer,
                            x, y, steps, warmup, world)
            median = statistics.median(seconds)
            results.append({"strategy": name, **options, "pr": pr, "pc": pc,
                            "median_step_s": median,
                            "samples_per_s": batch / median,
                            "predicted_comm_s": step_time(ops, costs.alpha, costs.beta),
                            "predicted_comm_bytes": step_bytes(ops)})
    ddp = ddp_runs(batch, steps, warmup, widths, blocks, x_all, y_all) if size > 1 else {}
    if rank == 0:
        planned = min(results, key=lambda r: r["predicted_comm_s"])  # ties: the first listed
        measured = min(results, key=lambda r: r["median_step_s"])
        data = next((r for r in results if r["strategy"] == "data"
                     and "batch_norm" not in r), None)
        local = next((r for r in results if r.get("batch_norm") == "local"), None)
        print(json.dumps({
            "ranks": size, "runs": results, "ddp": ddp,
            "planner_pick": f"{planned['strategy']} {planned['pr']}x{planned['pc']}",
            "measured_best": f"{measured['strategy']} {measured['pr']}x{measured['pc']}",
            "data_over_ddp_syncbn": (data["median_step_s"] / ddp["syncbn_median_step_s"]
                                     if data and "syncbn_median_step_s" in ddp else None),
            "data_over_ddp": (data["median_step_s"] / ddp["local_bn_median_step_s"]
                              if data and "local_bn_median_step_s" in ddp else None),
            "data_local_bn_over_ddp": (local["median_step_s"] / ddp["local_bn_median_step_s"]
                                       if local and "local_bn_median_step_s" in ddp else None),
        }))


def ddp_runs(batch: int, steps: int, warmup: int, widths: list[int], blocks: list[int],
             x_all: Any, y_all: Any) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    port = world.bcast(free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    rows = slice(rank * batch // size, (rank + 1) * batch // size)
    x, y = x_all[rows], y_all[rows]
    out: dict[str, Any] = {}
    for name, convert in (("local_bn", lambda m: m),
                          ("syncbn", nn.SyncBatchNorm.convert_sync_batchnorm)):
        try:
            model = DistributedDataParallel(convert(build(widths, blocks)))
        except ValueError as exc:  # torch: "SyncBatchNorm layers only work with GPU modules"
            out[f"{name}_unavailable"] = str(exc)
            continue
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        seconds = timed(model, lambda o=optimizer: o.zero_grad(set_to_none=False), lambda: None,
                        optimizer, x, y, steps, warmup, world)
        out[f"{name}_median_step_s"] = statistics.median(seconds)
        out[f"{name}_samples_per_s"] = batch / statistics.median(seconds)
    dist.destroy_process_group()
    return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 2, 2, 2])
    parser.add_argument("--strategies", nargs="+", default=[name for name, _ in VARIANTS])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
             str(args.warmup), "--widths", *map(str, args.widths), "--blocks",
             *map(str, args.blocks), "--strategies", *args.strategies]
    if args.worker:
        worker(args.batch, args.steps, args.warmup, args.widths, args.blocks, args.strategies)
        return
    runs = [run_worker(__file__, ranks, *sizes) for ranks in args.ranks]
    print(json.dumps({"benchmark": "resnet", "model": {"widths": args.widths,
                                                        "blocks": args.blocks,
                                                        "input": [3, 32, 32], "classes": 10},
                      "global_batch": args.batch, "threads_per_rank": 1,
                      "machine": socket.gethostname(), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
