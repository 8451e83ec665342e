"""Tokens per second of a small GPT under every strategy, against DDP, with the planner's pick.

    python bench/transformer.py [--ranks 1 2 4] [--steps 10] [--rounds 2]

For each P it starts one MPI job (one torch thread per rank). Every rank builds the same GPT
(width 128, 4 layers, 4 heads, vocabulary 2048, context 64) and trains it with AdamW on a fixed
random global batch of 16 sequences (1024 tokens), in alternating rounds over the layouts that
fit P ranks:
- `data` 1×P (bucketed all-reduce), and PyTorch DistributedDataParallel on gloo (the baseline
  a user would otherwise pick for data parallelism);
- `model` P×1 with the Megatron pairing (heads and MLP split, one all-reduce per block half)
  and with the gather layout (every Linear split by output, all-gathered);
- `grid` 2×(P/2) with the pairing;
- `domain` P×1 (the sequence split) with the ring and with the all-gather key/value exchange.
A step is the runner's: forward, the rank's own targets scored (`ParallelModel.score`),
backward, the gradient exchange, AdamW. Rank 0 times each step; tokens/s = 1024 / the median.
Beside each: the strategy's predicted step time (`predict_step`, this machine's calibration)
and bytes (measured == predicted); the planner's pick is the layout with the least predicted
time, next to the measured fastest. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from timing import free_port, run_worker

WIDTH, LAYERS, HEADS, VOCAB, CONTEXT, BATCH = 128, 4, 4, 2048, 64, 16


def build_gpt():
    import torch

    from strategies.transformer.gpt import GPT

    torch.manual_seed(0)
    return GPT(VOCAB, CONTEXT, WIDTH, LAYERS, HEADS)


def layouts(size: int) -> list[tuple[str, str, dict, int, int]]:
    """(label, strategy, options, pr, pc) for `size` ranks."""
    found = [("data", "data", {}, 1, size)]
    if size > 1:
        found += [("model_pairing", "model", {"tp_layout": "pairing"}, size, 1),
                  ("model_gather", "model", {"tp_layout": "gather"}, size, 1),
                  ("domain_ring", "domain", {"kv_exchange": "ring"}, size, 1),
                  ("domain_allgather", "domain", {"kv_exchange": "allgather"}, size, 1)]
    if size >= 4 and size % 2 == 0:
        found.append(("grid_pairing", "grid", {"tp_layout": "pairing"}, 2, size // 2))
    return found


def worker(steps: int, rounds: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    from runner.config.machine import load_compute_rates, load_machine_costs
    from runner.core import ProcessGrid
    from runner.cost.collectives import step_bytes
    from runner.cost.compute import oversubscription
    from strategies import STRATEGIES, PricingContext
    from strategies.base import predict_step

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator)
    x_all, y_all = tokens[:, :-1], tokens[:, 1:]
    costs, rates = load_machine_costs(), load_compute_rates()
    import os

    slowdown = oversubscription(size, len(os.sched_getaffinity(0)))
    scale = size / (BATCH * CONTEXT)

    contenders = {}
    for label, name, options, pr, pc in layouts(size):
        strategy = STRATEGIES.get(name)(**options, pricing=PricingContext(
            costs, rates=rates, global_batch=BATCH, slowdown=slowdown))
        grid = ProcessGrid(pr, pc, comm if size > 1 else None)
        plain = build_gpt()
        predicted = predict_step(strategy, plain, (CONTEXT,), grid.shape, BATCH)
        predicted_bytes = step_bytes(strategy.predict_ops(plain, (CONTEXT,), grid.shape, BATCH))
        model = strategy.parallelize(plain, (CONTEXT,), grid)
        x = x_all[model.input_rows(BATCH)]
        y = y_all[model.output_rows(BATCH)]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, x=x, y=y, optimizer=optimizer, grid=grid) -> int:
            before = grid.counter.snapshot()
            model.zero_grad()
            (model.score(model(x), y).loss_sum * scale).backward()
            model.finish_gradient_sync()
            optimizer.step()
            return grid.counter.since(before).nbytes

        contenders[label] = (step, predicted, predicted_bytes)
    if size > 1:
        port = comm.bcast(free_port() if rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)
        ddp = DistributedDataParallel(build_gpt())
        ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)

        def ddp_step() -> int:
            ddp_optimizer.zero_grad(set_to_none=False)
            logits = ddp(x_all[rows])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     y_all[rows].reshape(-1))
            loss.backward()
            ddp_optimizer.step()
            return 0

        contenders["ddp"] = (ddp_step, None, None)

    times: dict[str, list[float]] = {label: [] for label in contenders}
    nbytes: dict[str, int] = {}
    for _ in range(rounds):
        for label, (step, _, _) in contenders.items():
            comm.Barrier()
            for i in range(steps + warmup):
                start = time.perf_counter()
                moved = step()
                if i >= warmup:
                    times[label].append(time.perf_counter() - start)
                nbytes[label] = moved
    if size > 1:
        dist.destroy_process_group()
    if rank == 0:
        results = {}
        for label, (_, predicted, predicted_bytes) in contenders.items():
            median = statistics.median(times[label])
            results[label] = {
                "median_step_s": median, "tokens_per_s": BATCH * CONTEXT / median,
                "predicted_step_s": predicted.total_s if predicted else None,
                "comm_bytes_per_step": nbytes[label] if label != "ddp" else None,
                "predicted_comm_bytes_per_step": predicted_bytes}
        ours = [label for label in results if label != "ddp"]
        pick = min(ours, key=lambda label: results[label]["predicted_step_s"])
        fastest = min(ours, key=lambda label: results[label]["median_step_s"])
        line = {"ranks": size, "layouts": results, "planner_pick": pick,
                "measured_fastest": fastest,
                "pick_over_fastest": (results[pick]["median_step_s"]
                                      / results[fastest]["median_step_s"])}
        if "ddp" in results:
            line["data_over_ddp"] = (results["data"]["median_step_s"]
                                     / results["ddp"]["median_step_s"])
        print(json.dumps(line))



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and layout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds, args.warmup)
        return
    runs = [run_worker(__file__, ranks, "--steps", str(args.steps), "--rounds", str(args.rounds),
                       "--warmup", str(args.warmup)) for ranks in args.ranks]
    print(json.dumps({"benchmark": "transformer", "model": {
        "width": WIDTH, "layers": LAYERS, "heads": HEADS, "vocab": VOCAB, "context": CONTEXT},
        "global_batch": BATCH, "threads_per_rank": 1, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
