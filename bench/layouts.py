"""One large fully-connected layer in every layout gridrun has, against the same layer with its
weight partitioned in two dimensions the linear-algebraic way (DistDL), in one MPI job per
rank count and grid.

    python bench/layouts.py [--ranks 4] [--features 4096] [--batch 256] [--repeats 10]

The layer: y = x Wᵀ + b, W of features × features, a batch of `batch` rows, forward and
backward (the input's gradient too, as in the middle of a network), one torch thread per rank.
Each layout starts from its input already laid out as it needs it and leaves its output as it
makes it (the redistributions between layers are the planner's business, priced separately);
the gradient exchange its weights need is included and completed:

- gridrun `batch` (rows over all P, W whole, its gradient all-reduced), `row` (today's `grid`:
  W's rows over Pr, batch over Pc, gradient all-reduced over Pc), `col` (W's columns over Pr,
  partial outputs reduce-scattered), `2d` (W[rows over Pr, columns over Pc], whole batch:
  all-gather-free, partial outputs reduce-scattered over Pc, no gradient exchange);
- `distdl_2d`: the same 2-D partition of W built from DistDL's operators: x (columns over Pc,
  on the first model-group rank) broadcast over the model group, the partial products
  sum-reduced over the batch group to its first rank; backward their adjoints (sum-reduce,
  broadcast).

Each repetition's time is the slowest rank's; medians, layouts alternated so that drift on a
shared machine hits all alike. Prints JSON: seconds per layout and grid, the best gridrun
layout, and its speedup over `distdl_2d`.
"""

from __future__ import annotations

import argparse
import json
import statistics

from timing import run_worker


def worker(pr: int, pc: int, features: int, batch: int, repeats: int) -> None:
    import time

    import torch
    from mpi4py import MPI
    from torch import nn

    from runner.core import Partition, ProcessGrid
    from runner.core.primitives import broadcast, sum_reduce
    from strategies import PricingContext
    from strategies.auto import AutoLayout
    from strategies.layouts.chain import Redistribute
    from strategies.layouts.layer import LAYOUTS, PartialSumLinear

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    grid = ProcessGrid(pr, pc, comm)
    r, c = grid.model_index, grid.batch_index
    torch.manual_seed(0)
    linear = nn.Linear(features, features)
    gen = torch.Generator().manual_seed(1)
    whole_x = torch.randn(batch, features, generator=gen)

    def run_layout(name: str):
        """(module, its input piece, gradient exchanges) of gridrun's layout `name`."""
        layout = LAYOUTS["linear", name]
        strategy = AutoLayout(layouts={"0": name},
                              pricing=PricingContext(global_batch=batch))
        pmodel = strategy.parallelize(nn.Sequential(linear), (features,), grid)
        part = layout.takes.partition((batch, features), (pc, pr))
        box = part.box((c, r))
        x = whole_x[box].clone().requires_grad_(True)
        # the layer alone: skip the conversions the model adds around it
        layer = next(m for m in pmodel.body if not isinstance(m, Redistribute))
        return layer, x, pmodel

    def distdl_2d():
        """DistDL's 2-D Linear: W[rows over Pr, columns over Pc]."""
        rows, cols = Partition(features, pr).slice(r), Partition(features, pc).slice(c)
        block = PartialSumLinear(linear, rows, cols, grid.batch, 1, "distdl")
        weight = block.weight
        bias = linear.bias.detach()[rows].clone().requires_grad_(True)
        x = whole_x[:, cols].clone().requires_grad_(True)

        def forward(x_local: torch.Tensor) -> torch.Tensor:
            x_all = broadcast(x_local, grid.model, 0, label="x")  # over the output dimension
            partial = torch.nn.functional.linear(x_all, weight)
            y = sum_reduce(partial, grid.batch, 0, label="y")  # over the input dimension
            return y + bias if c == 0 else y

        return forward, x, (weight, bias)

    cases = {}
    for name in ("batch", "row", "col", "2d"):
        layer, x, pmodel = run_layout(name)
        cases[name] = (layer, x, pmodel)
    forward, dx, dparams = distdl_2d()

    def step(name: str) -> None:
        if name == "distdl_2d":
            dx.grad = None
            for p in dparams:
                p.grad = None
            y = forward(dx)
            y.backward(torch.ones_like(y))
            return
        layer, x, pmodel = cases[name]
        x.grad = None
        pmodel.zero_grad()
        y = layer(x)
        y.backward(torch.ones_like(y))
        pmodel.finish_gradient_sync()

    names = [*cases, "distdl_2d"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats + 2):
        for name in names:
            comm.Barrier()
            start = time.perf_counter()
            step(name)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if i >= 2:
                times[name].append(elapsed)
    if comm.Get_rank() == 0:
        medians = {n: statistics.median(t) for n, t in times.items()}
        print(json.dumps({"grid": f"{pr}x{pc}", "seconds": medians}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pr", type=int, default=0)
    parser.add_argument("--pc", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args.pr, args.pc, args.features, args.batch, args.repeats)
        return
    results = []
    for ranks in args.ranks:
        shapes = sorted({(pr, ranks // pr) for pr in range(1, ranks + 1) if ranks % pr == 0})
        by_grid = {}
        for pr, pc in shapes:
            by_grid[f"{pr}x{pc}"] = run_worker(
                __file__, ranks, "--pr", str(pr), "--pc", str(pc), "--features",
                str(args.features), "--batch", str(args.batch), "--repeats",
                str(args.repeats))["seconds"]
        best_layout = min(((g, n, s) for g, secs in by_grid.items() for n, s in secs.items()
                           if n != "distdl_2d"), key=lambda t: t[2])
        best_distdl = min(((g, secs["distdl_2d"]) for g, secs in by_grid.items()),
                          key=lambda t: t[1])
        results.append({
            "ranks": ranks, "features": args.features, "batch": args.batch,
            "seconds": by_grid,
            "best_gridrun": {"grid": best_layout[0], "layout": best_layout[1],
                             "seconds": best_layout[2]},
            "best_distdl_2d": {"grid": best_distdl[0], "seconds": best_distdl[1]},
            "speedup_over_distdl_2d": best_distdl[1] / best_layout[2],
        })
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
