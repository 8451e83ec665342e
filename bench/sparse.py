"""Sparse exchange of an embedding table's gradient against the dense all-reduce: step time and
bytes over vocabulary sizes and batch densities, and the measured crossover density.

    python bench/sparse.py [--ranks 2 4] [--vocab 10000 100000 1000000]
                           [--densities 0.001 0.01 0.05 0.2 0.5 1.0] [--repeats 7] [--warmup 2]
                           [--big-vocab 500000] [--big-repeats 3] [--big-warmup 1]

For each P it starts one MPI job (one torch thread per rank). The model is an
`nn.EmbeddingBag(vocab, 64, mode="sum", sparse=True)` followed by a Linear 64 → 8 head, so the
table is nearly all the weights. Density d is the fraction of the table's rows one rank's batch
touches: per step, each rank draws exactly round(d · vocab) distinct row ids, uniformly, from a
generator seeded by (vocab, d, rank, step), and packs them into bags of 32 ids (the last bag
topped up with repeats of those ids, so the distinct rows stay exact); labels are random. Ranks
thus overlap by chance (≈ d² of the rows for two ranks), not identically; real token data, being
Zipfian, overlaps more.

Every mode trains through `DataParallel(sparse=mode).parallelize(...)`, exactly as a run does (α, β
and the local costs from the stored calibration, like runner/training/loop.py): `dense` is what a
user picking it gets, the table joining the ordinary dense gradient buckets (all-reduce of the whole
table, then a dense SGD update of every row); `allgather`, `sharded` and `auto` go through the
sparse exchange (when `auto` picks dense, that is the exchange's own path: the rows scattered into
a zero table, all-reduced, applied as a dense update). Each mode starts from the same weights and
sees the same batches; the optimizer is plain SGD (lr 0.1, no momentum). Modes run one after the
other in the order dense, allgather, sharded, auto (dense first: the others are checked against
it). A timed step is the whole training step: zero_grad, forward (including the sharded mode's
pull of the rows other ranks own), backward, finish_gradient_sync, SGD step, each step started
right after a barrier; the median over `--repeats` steps after `--warmup` untimed ones is
reported, with min and max.
Tables of `--big-vocab` rows or more (1M rows × 64 float32 = 256 MB per copy) get only
`--big-repeats` timed steps after `--big-warmup`, to keep the whole default run within about 5
minutes on 2 cores (peak ≈ 12 GB of RAM over the 4 ranks). Within one run the steps mostly stay
within a quarter of their median, but at 1M rows the same exchange measured in two runs (`auto`
choosing allgather, and allgather) can differ by a third: buffers of hundreds of MB are allocated
afresh each step and their page faults depend on the memory state the previous runs left.

Bytes per step are the communication counter's payload bytes (the `n` of each operation's α–β
cost, as the training summary reports them: the buffer of an all-reduce, the whole gathered
tensor of an all-gather, a rank's input to an all-to-all-v), the mean over timed steps, for
rank 0 and the largest over ranks. With ring algorithms a rank sends 2(P−1)/P of an
all-reduce's payload but (P−1)/P of an all-gather's, so the dense / allgather ratio of these
bytes understates the saving on the wire twofold. After its steps each mode brings every copy
up to date (`refresh_copies`) and its weights are compared with dense's on every rank: the
largest difference relative to the largest dense weight (≲ 1e-7 when they did the same work;
a sharded table, held by its owners only, gathered whole first). For `auto`, the steps spent in
each mode it chose. Memory per rank, the largest over ranks: the parameters a rank holds
(`param_bytes_max_rank`: under `sharded` its block of the table and the hot replicas, else the
whole table) and with them the largest working set of rows it pulled
(`memory_bytes_max_rank`).

Per (P, vocab) the summary gives the crossover: the smallest measured density at which dense's
median step time is at most the best of allgather and sharded (null if dense never wins), and
its linear interpolation between the two bracketing densities; and, at density 0.01 (if
measured), dense's bytes and median step time over those of the fastest sparse mode, the step
time counted as clearly lower when every timed step of that mode beat every timed dense step.
Prints JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from typing import Any

from timing import barrier_timed, run_worker

EMBEDDING_DIM = 64
CLASSES = 8
IDS_PER_BAG = 32
LR = 0.1
MODES = ("dense", "allgather", "sharded", "auto")
SPARSE = ("allgather", "sharded")  # the modes a user picks instead of dense


def build_model(initial_table: Any) -> Any:
    """The bag model around a copy of `initial_table` (the same on every rank and for every
    mode); the head from a fixed seed."""
    import torch
    from torch import nn

    class BagModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            vocab, dim = initial_table.shape
            self.bag = nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True,
                                       _weight=initial_table.clone())
            torch.manual_seed(0)
            self.head = nn.Linear(dim, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.bag(x))

    return BagModel()


def draw_batches(vocab: int, density: float, rank: int, steps: int) -> list[tuple[Any, Any]]:
    """`steps` batches of this rank: (bags of ids covering exactly round(density·vocab) distinct
    rows, labels)."""
    import torch

    rows = max(1, round(density * vocab))
    batches = []
    for step in range(steps):
        seed = ((vocab * 1000 + round(density * 1e5)) * 64 + rank) * 1000 + step
        generator = torch.Generator().manual_seed(seed)
        distinct = torch.randperm(vocab, generator=generator)[:rows]
        bags = -(-rows // IDS_PER_BAG)
        extra = distinct[torch.randint(0, rows, (bags * IDS_PER_BAG - rows,),
                                       generator=generator)]
        ids = torch.cat([distinct, extra]).view(bags, IDS_PER_BAG)
        labels = torch.randint(0, CLASSES, (bags,), generator=generator)
        batches.append((ids, labels))
    return batches


def run_mode(mode: str, initial_table: Any, batches: list[tuple[Any, Any]], grid: Any,
             calibration: Any, repeats: int,
             warmup: int) -> tuple[dict[str, Any], list[Any]]:
    """Train `len(batches)` steps in `mode`; the measurements and the final weights."""
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from strategies import PricingContext
    from strategies.data import DataParallel

    # what the runner gives a strategy from the dataset: the rows a rank's batch touches (here
    # exactly round(d · vocab)), from which `auto` decides per table whether to shard it
    bags, rows = len(batches[0][1]), int(torch.unique(batches[0][0]).numel())
    strategy = DataParallel(sparse=mode, pricing=PricingContext(
        calibration, rows_touched=lambda _: float(rows), global_batch=bags * grid.size))
    pmodel = strategy.parallelize(build_model(initial_table), (IDS_PER_BAG,), grid)
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=LR)
    comm = grid.world.mpi_comm
    step_bytes: list[int] = []
    comm_seconds: list[float] = []
    position = iter(batches)

    def step() -> None:
        x, y = next(position)
        before = grid.counter.snapshot()
        pmodel.zero_grad()
        loss = F.cross_entropy(pmodel(x), y)
        loss.backward()
        pmodel.finish_gradient_sync()
        optimizer.step()
        spent = grid.counter.since(before)
        step_bytes.append(spent.nbytes)
        comm_seconds.append(spent.seconds)

    times = barrier_timed(comm, step, repeats, warmup)
    report = pmodel.exchange_report()
    pmodel.refresh_copies()  # sharded: the hot replicas written back into their owners' rows
    weights = whole_parameters(pmodel)
    mean_bytes = statistics.fmean(step_bytes[warmup:])
    # memory per rank: the parameters this rank holds (a sharded table: its block and the hot
    # replicas) and the largest working set it pulled (`held_bytes` of the report)
    param_bytes = sum(p.numel() * p.element_size() for p in pmodel.parameters())
    pulled = sum(t.get("pulled_rows_max", 0) * EMBEDDING_DIM * 4 for t in report.values())
    result = {
        "median_step_s": statistics.median(times), "min_step_s": min(times),
        "max_step_s": max(times),
        "median_comm_s": statistics.median(comm_seconds[warmup:]),
        "bytes_per_step_rank0": comm.bcast(mean_bytes, root=0),
        "bytes_per_step_max_rank": comm.allreduce(mean_bytes, op=MPI.MAX),
        "param_bytes_max_rank": comm.allreduce(param_bytes, op=MPI.MAX),
        "memory_bytes_max_rank": comm.allreduce(param_bytes + pulled, op=MPI.MAX),
    }
    if mode == "auto":
        result["auto_steps_by_mode"] = {name: table["steps_by_mode"]
                                        for name, table in report.items()}
    return result, weights


def whole_parameters(pmodel: Any) -> list[Any]:
    """The model's parameters as one process holds them (sharded tables gathered whole)."""
    from strategies.exchange import sparse_gradients

    return [w.clone() for w in sparse_gradients.whole_parameters(pmodel.module, pmodel.reducers)]


def worker(vocabs: list[int], densities: list[float], repeats: int, warmup: int,
           big_vocab: int, big_repeats: int, big_warmup: int) -> None:
    import torch
    from mpi4py import MPI

    from runner.config.machine import load_machine_costs
    from runner.core import ProcessGrid

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    grid = ProcessGrid(1, size, comm)
    calibration = load_machine_costs()
    cases = []
    for vocab in vocabs:
        big = vocab >= big_vocab
        timed, untimed = (big_repeats, big_warmup) if big else (repeats, warmup)
        initial_table = torch.randn(vocab, EMBEDDING_DIM,
                                    generator=torch.Generator().manual_seed(vocab))
        for density in densities:
            batches = draw_batches(vocab, density, rank, untimed + timed)
            modes: dict[str, dict[str, Any]] = {}
            reference: list[Any] = []
            for mode in MODES:
                result, weights = run_mode(mode, initial_table, batches, grid, calibration,
                                           timed, untimed)
                if mode == "dense":
                    reference = weights
                else:
                    # Same start, same batches: every mode must end where dense does, on every
                    # rank.
                    scale = max(r.abs().max().item() for r in reference)
                    diff = max((w - r).abs().max().item()
                               for w, r in zip(weights, reference, strict=True)) / scale
                    result["max_weight_difference_vs_dense"] = comm.allreduce(diff, op=MPI.MAX)
                modes[mode] = result
                del weights
                gc.collect()
            cases.append({"vocab": vocab, "density": density,
                          "rows_per_rank": max(1, round(density * vocab)),
                          "ids_per_rank": batches[0][0].numel(), "timed_steps": timed,
                          "warmup_steps": untimed, "modes": modes})
            del batches, reference
            gc.collect()
        del initial_table
        gc.collect()
    if rank == 0:
        print(json.dumps({"ranks": size, "threads_per_rank": 1,
                          "alpha_beta": {"alpha": calibration.alpha, "beta": calibration.beta,
                                         "table_pass": calibration.table_pass,
                                         "sparse_row": calibration.sparse_row,
                                         "source": calibration.source},
                          "cases": cases}))


def best_sparse(modes: dict[str, dict[str, Any]]) -> str:
    return min(SPARSE, key=lambda mode: modes[mode]["median_step_s"])


def crossover(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The smallest density where dense's median step is no slower than the best sparse mode,
    and its linear interpolation between the last density where dense lost and that one."""
    cases = sorted(cases, key=lambda case: case["density"])
    margins = [(case["density"], case["modes"]["dense"]["median_step_s"]
                - case["modes"][best_sparse(case["modes"])]["median_step_s"])
               for case in cases]
    for index, (density, margin) in enumerate(margins):
        if margin <= 0:
            interpolated = None
            if index > 0:  # dense lost at the previous density: the margin crosses zero between
                lower, lower_margin = margins[index - 1]
                interpolated = lower + (density - lower) * lower_margin / (lower_margin - margin)
            return {"crossover_density": density, "crossover_density_interpolated": interpolated}
    return {"crossover_density": None, "crossover_density_interpolated": None}


def at_density(case: dict[str, Any]) -> dict[str, Any]:
    """Dense over the fastest sparse mode at one density: bytes and step time (> 1: sparse
    better); 'clearly' lower: every timed dense step slower than every timed sparse one."""
    modes = case["modes"]
    dense, best = modes["dense"], best_sparse(modes)
    fastest = modes[best]
    bytes_ratio = dense["bytes_per_step_max_rank"] / fastest["bytes_per_step_max_rank"]
    return {
        "density": case["density"], "fastest_sparse_mode": best,
        "bytes_ratio_dense_over_sparse": bytes_ratio,
        "step_time_ratio_dense_over_sparse": dense["median_step_s"] / fastest["median_step_s"],
        "bytes_at_least_10x_less": bytes_ratio >= 10,
        "step_time_clearly_lower": fastest["max_step_s"] < dense["min_step_s"],
        "auto_steps_by_mode": modes["auto"].get("auto_steps_by_mode"),
        "memory_per_rank_dense_bytes": dense["memory_bytes_max_rank"],
        "memory_per_rank_sharded_bytes": modes["sharded"]["memory_bytes_max_rank"],
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    summary = []
    for run in runs:
        for vocab in sorted({case["vocab"] for case in run["cases"]}):
            cases = [case for case in run["cases"] if case["vocab"] == vocab]
            one_percent = next((case for case in cases if abs(case["density"] - 0.01) < 1e-12),
                               None)
            summary.append({"ranks": run["ranks"], "vocab": vocab, **crossover(cases),
                            "max_weight_difference_vs_dense": max(
                                result["max_weight_difference_vs_dense"] for case in cases
                                for mode, result in case["modes"].items() if mode != "dense"),
                            "fastest_sparse_mode_by_density": {
                                str(case["density"]): best_sparse(case["modes"])
                                for case in cases},
                            "at_1_percent": at_density(one_percent) if one_percent else None})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--vocab", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--densities", type=float, nargs="+",
                        default=[0.001, 0.01, 0.05, 0.2, 0.5, 1.0],
                        help="fraction of the table's rows each rank's batch touches")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per mode and case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--big-vocab", type=int, default=500_000,
                        help="tables of this many rows or more get --big-repeats/--big-warmup")
    parser.add_argument("--big-repeats", type=int, default=3)
    parser.add_argument("--big-warmup", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    options = ["--vocab", *map(str, args.vocab), "--densities", *map(str, args.densities),
               "--repeats", str(args.repeats), "--warmup", str(args.warmup),
               "--big-vocab", str(args.big_vocab), "--big-repeats", str(args.big_repeats),
               "--big-warmup", str(args.big_warmup)]
    if args.worker:
        worker(args.vocab, args.densities, args.repeats, args.warmup, args.big_vocab,
               args.big_repeats, args.big_warmup)
        return
    runs = [run_worker(__file__, ranks, *options) for ranks in args.ranks]
    print(json.dumps({"benchmark": "sparse", "embedding_dim": EMBEDDING_DIM,
                      "ids_per_bag": IDS_PER_BAG, "summary": summarize(runs), "runs": runs},
                     indent=2))


if __name__ == "__main__":
    main()
