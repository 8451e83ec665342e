"""gridrun's sharded data parallelism (`strategy=fsdp`, ZeRO stages 3, 2, 1) against PyTorch's
own FSDP2 (`torch.distributed.fsdp.fully_shard`), with `data` and DDP for scale.

    python bench/fsdp.py [--ranks 2 4] [--steps 10] [--rounds 2]

For each P, one MPI job of P ranks, one torch thread per rank. Every rank builds gridrun's GPT
(width 256, 4 layers, 4 heads, vocabulary 2048, context 64, untied head) from the same seed and
trains it with AdamW on a fixed random global batch of 16 sequences (1024 tokens), split over
the ranks, in alternating rounds:
- `fsdp_stage3`, `fsdp_stage2`, `fsdp_stage1`: gridrun `strategy=fsdp` at that stage, units the
  model's blocks (the embeddings, final norm and head in the whole model's unit), over MPI;
- `fsdp_stage3_gloo`: stage 3 with gridrun's collectives on gloo (`backend="torch"`), the
  transport FSDP2 uses here;
- `fsdp_stage3_no_prefetch`, `fsdp_stage3_gloo_no_prefetch`: the same two with
  `prefetch=False` (every gather waited for when its unit starts; the rows above prefetch, the
  default);
- `torch_fsdp2`: `fully_shard` on each block, then on the root (its defaults: each block
  resharded after its forward), on a gloo process group, CPU;
- `torch_fsdp2_keep`: the same with `reshard_after_forward=False` (ZeRO-2, as stage 2);
- `data`: gridrun `strategy=data`; `ddp`: PyTorch DistributedDataParallel on gloo;
- `no_comm`: the plain model on the rank's own rows, nothing exchanged (the compute alone: a
  floor, not training).
A step is forward, the rank's targets scored, backward, the gradient exchange, AdamW. Rank 0
times each step; tokens/s = 1024 / the median.

What a rank holds (`held_bytes`): after a step, the storages behind the parameters, their
gradients and the optimizer's state, each storage once, counted alike for every contender (a
DTensor by its local shard's storage, padding included); communication buckets (DDP's,
`data`'s) are not counted. The step's peak (`peak_bytes`): what is held before one more step
plus the largest rise of torch's allocations during it (PyTorch's profiler, memory events in
time order: activations, gathered units, gradients and communication buffers that torch
allocates; MPI's and gloo's own buffers are not seen).

Checked and printed: every contender's loss at every step against FSDP2's (all start from the
same weights and see the same batches, so they must agree to float32 rounding), and gridrun's
bytes moved per step against its predicted ones. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from timing import free_port, run_worker

WIDTH, LAYERS, HEADS, VOCAB, CONTEXT, BATCH = 256, 4, 4, 2048, 64, 16
TOKENS = BATCH * CONTEXT
TARGET_STEP_RATIO = 1.0  # gridrun stage 3 / FSDP2 step time, at most
TARGET_HELD_RATIO = 1.05  # gridrun stage 3 / FSDP2 bytes held per rank, at most
LOSS_RTOL = 1e-5  # losses equal to float32 rounding (a few ulps of ~7.6, carried over steps)


def build_gpt() -> Any:
    import torch

    from strategies.transformer.gpt import GPT

    torch.manual_seed(0)
    return GPT(VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, tie_weights=False)


@dataclass
class Contender:
    """One way of training the model on this rank: its step (returning this rank's share of
    the global mean loss, the bytes it moved and its seconds in collectives, where known), its
    optimizer, and its predicted bytes per step (gridrun's)."""

    step: Callable[[], tuple[float, int, float]]
    optimizer: Any
    predicted_bytes: int | None = None


def gridrun_contender(name: str, options: dict[str, Any], comm: Any,
                      backend: str = "mpi") -> Contender:
    """gridrun's strategy `name` over all ranks (1 × P) on this rank's rows."""
    import torch

    from runner.core import ProcessGrid
    from runner.cost.collectives import step_bytes
    from strategies import STRATEGIES

    size = comm.Get_size()
    strategy = STRATEGIES.get(name)(**options)
    grid = ProcessGrid(1, size, comm, backend=backend)
    plain = build_gpt()
    predicted = step_bytes(strategy.predict_ops(plain, (CONTEXT,), grid.shape, BATCH))
    model = strategy.parallelize(plain, (CONTEXT,), grid)
    x, y = batch()
    x, y = x[model.input_rows(BATCH)], y[model.output_rows(BATCH)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scale = size / TOKENS  # each rank's sum over P: the global mean loss's gradient

    def step() -> tuple[float, int, float]:
        before = grid.counter.snapshot()
        model.zero_grad()
        loss_sum = model.score(model(x), y).loss_sum
        (loss_sum * scale).backward()
        model.finish_gradient_sync()
        optimizer.step()
        moved = grid.counter.since(before)
        return loss_sum.item() / TOKENS, int(moved.nbytes), float(moved.seconds)

    return Contender(step, optimizer, predicted)


def torch_contender(model: Any, rank: int, size: int, set_to_none: bool = True) -> Contender:
    """A torch.distributed-wrapped model (FSDP2, DDP) on this rank's rows: the mean loss of
    its tokens, gradients averaged over the ranks by the wrapper."""
    import torch
    import torch.nn.functional as F

    x, y = batch()
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)
    x, y = x[rows], y[rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> tuple[float, int, float]:
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item() / size, 0, 0.0

    return Contender(step, optimizer)


def batch() -> tuple[Any, Any]:
    """The fixed global batch: inputs and next-token targets."""
    import torch

    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1),
                           generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def held_bytes(optimizer: Any) -> int:
    """Bytes of the storages behind the optimizer's parameters, their gradients and its state,
    each storage once (a DTensor by its local shard's)."""
    import torch
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}

    def add(tensors: Iterable[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    params = [p for group in optimizer.param_groups for p in group["params"]]
    add(params)
    add(p.grad for p in params if p.grad is not None)
    for state in optimizer.state.values():
        add(state.values())
    return sum(storages.values())


def allocation_rise(step: Callable[[], object]) -> int:
    """The largest rise of torch's allocations during `step`, above where it started: its
    memory events (allocations positive, frees negative) summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def unit_bytes(model: Any) -> dict[str, int]:
    """The whole parameters' bytes of each unit (each block, and the rest: the root's)."""
    blocks = {f"blocks.{i}": sum(p.numel() * p.element_size() for p in block.parameters())
              for i, block in enumerate(model.blocks)}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"(model)": total - sum(blocks.values()), **blocks}


def worker(steps: int, rounds: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from runner.core.torchdist import init_torch_distributed, shutdown_torch_distributed

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    init_torch_distributed(comm)  # gridrun's own gloo groups, beside the default one

    def fsdp2(reshard_after_forward: bool) -> Any:
        model = build_gpt()
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        return fully_shard(model, reshard_after_forward=reshard_after_forward)

    units = {"units": ["blocks.*"]}
    contenders = {
        "fsdp_stage3": gridrun_contender("fsdp", {"stage": 3, **units}, comm),
        "torch_fsdp2": torch_contender(fsdp2(True), rank, size),
        "fsdp_stage3_gloo": gridrun_contender("fsdp", {"stage": 3, **units}, comm, "torch"),
        "fsdp_stage3_no_prefetch": gridrun_contender(
            "fsdp", {"stage": 3, "prefetch": False, **units}, comm),
        "fsdp_stage3_gloo_no_prefetch": gridrun_contender(
            "fsdp", {"stage": 3, "prefetch": False, **units}, comm, "torch"),
        "fsdp_stage2": gridrun_contender("fsdp", {"stage": 2, **units}, comm),
        "torch_fsdp2_keep": torch_contender(fsdp2(False), rank, size),
        "fsdp_stage1": gridrun_contender("fsdp", {"stage": 1, **units}, comm),
        "data": gridrun_contender("data", {}, comm),
        "ddp": torch_contender(DistributedDataParallel(build_gpt()), rank, size,
                               set_to_none=False),
        "no_comm": torch_contender(build_gpt(), rank, size),
    }

    times: dict[str, list[float]] = {label: [] for label in contenders}
    comm_seconds: dict[str, list[float]] = {label: [] for label in contenders}
    losses: dict[str, list[float]] = {label: [] for label in contenders}
    moved: dict[str, int] = {}
    for _ in range(rounds):  # alternating, so that a shared machine's drifts hit all alike
        for label, contender in contenders.items():
            comm.Barrier()
            for i in range(steps + warmup):
                start = time.perf_counter()
                loss, moved[label], seconds = contender.step()
                elapsed = time.perf_counter() - start
                losses[label].append(loss)
                if i >= warmup:
                    times[label].append(elapsed)
                    comm_seconds[label].append(seconds)

    memory: dict[str, dict[str, int]] = {}
    for label, contender in contenders.items():
        comm.Barrier()
        held = held_bytes(contender.optimizer)
        rise = allocation_rise(contender.step)
        memory[label] = {"held_bytes": held, "peak_bytes": held + rise,
                         "step_rise_bytes": rise}
    # the global mean loss of every step: the sum of the ranks' shares
    global_losses = {label: comm.allreduce(torch.tensor(values, dtype=torch.float64)).tolist()
                     for label, values in losses.items()}
    memories = comm.gather(memory, root=0)
    shutdown_torch_distributed()
    dist.destroy_process_group()
    if rank != 0:
        return

    reference = global_losses["torch_fsdp2"]
    results: dict[str, dict[str, Any]] = {}
    for label, measured in times.items():
        median = statistics.median(measured)
        result: dict[str, Any] = {"median_step_s": median, "tokens_per_s": TOKENS / median,
                                  # every rank's: the largest
                                  **{key: max(m[label][key] for m in memories)
                                     for key in memory[label]}}
        if label != "no_comm":
            difference = max(abs(a - b) / abs(b)
                             for a, b in zip(global_losses[label], reference, strict=True))
            result.update({"loss_max_relative_difference_to_fsdp2": difference,
                           "losses_equal_fsdp2": difference <= LOSS_RTOL})
        predicted = contenders[label].predicted_bytes
        if predicted is not None:
            result.update({"comm_bytes_per_step": moved[label],
                           "predicted_comm_bytes_per_step": predicted,
                           "bytes_as_predicted": moved[label] == predicted,
                           "comm_s_per_step": statistics.median(comm_seconds[label])})
        results[label] = result

    def ratio(a: str, b: str, key: str) -> float:
        return float(results[a][key] / results[b][key])

    step_ratio = ratio("fsdp_stage3", "torch_fsdp2", "median_step_s")
    held_ratio = ratio("fsdp_stage3", "torch_fsdp2", "held_bytes")
    print(json.dumps({
        "ranks": size, "steps_timed": len(times["fsdp_stage3"]),
        "losses_compared_steps": len(reference), "contenders": results,
        "unit_bytes": unit_bytes(build_gpt()),
        "stage3_over_fsdp2_step_time": step_ratio,
        "stage3_step_target_met": step_ratio <= TARGET_STEP_RATIO,
        "stage3_over_fsdp2_held_bytes": held_ratio,
        "stage3_held_target_met": held_ratio <= TARGET_HELD_RATIO,
        "stage3_over_fsdp2_peak_bytes": ratio("fsdp_stage3", "torch_fsdp2", "peak_bytes"),
        "stage3_gloo_over_fsdp2_step_time": ratio("fsdp_stage3_gloo", "torch_fsdp2",
                                                  "median_step_s"),
        "stage3_prefetch_over_no_prefetch_step_time": ratio(
            "fsdp_stage3", "fsdp_stage3_no_prefetch", "median_step_s"),
        "stage3_gloo_prefetch_over_no_prefetch_step_time": ratio(
            "fsdp_stage3_gloo", "fsdp_stage3_gloo_no_prefetch", "median_step_s"),
        "stage2_over_fsdp2_keep_step_time": ratio("fsdp_stage2", "torch_fsdp2_keep",
                                                  "median_step_s"),
        "data_over_ddp_step_time": ratio("data", "ddp", "median_step_s")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and side")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds, args.warmup)
        return
    runs = [run_worker(__file__, ranks, "--steps", str(args.steps), "--rounds",
                       str(args.rounds), "--warmup", str(args.warmup)) for ranks in args.ranks]
    print(json.dumps({"benchmark": "fsdp", "model": {
        "width": WIDTH, "layers": LAYERS, "heads": HEADS, "vocab": VOCAB, "context": CONTEXT},
        "global_batch": BATCH, "threads_per_rank": 1, "optimizer": "adamw",
        "target_stage3_over_fsdp2_step_time": TARGET_STEP_RATIO,
        "target_stage3_over_fsdp2_held_bytes": TARGET_HELD_RATIO, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
