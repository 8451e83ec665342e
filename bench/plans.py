"""Tokens per second of a Llama split by its declared plan, against gridrun's own GPT tensor
parallelism, `strategy=data` and DDP, at P = 2, with the planner's predicted step times.

    python bench/plans.py [--steps 10] [--rounds 2]

One MPI job of 2 ranks, one torch thread per rank (one core each on a 2-core machine). Every
rank builds the transformers library's Llama from a config (width 128, 4 layers, 4 heads,
vocabulary 2048, context 64; its SwiGLU MLP of 344 features holds as many weights as the GPT's
of 512) and gridrun's GPT of the same width, depth, heads, vocabulary and context (untied head,
as the Llama's), and trains each with AdamW on a fixed random global batch of 16 sequences
(1024 tokens), in alternating rounds:
- `plan_model`: the Llama under `strategy=model` 2×1 by its declared plan
  (`config.base_model_tp_plan`: q/k/v, gate and up colwise, o and down rowwise, the head
  colwise and gathered);
- `plan_vocab_model`: the same plan with the head split by vocabulary (`lm_head: vocab`): its
  logits scored split, never gathered;
- `gpt_model`: the GPT under `strategy=model` 2×1 with the Megatron pairing (gridrun's own
  tensor parallelism: the same splits, written for its GPT);
- `data`: the Llama under `strategy=data` 1×2;
- `ddp`: the Llama in PyTorch DistributedDataParallel on gloo (as `bench/data_parallel.py`).
A step is the runner's: forward, the rank's own targets scored (`ParallelModel.score`),
backward, the gradient exchange, AdamW. Rank 0 times each step; tokens/s = 1024 / the median.
Beside each of gridrun's: the strategy's predicted step time (`predict_step`, this machine's
calibration: `gridrun-plan plan.calibrate=true` first) and its ratio to the measured one
(target 0.75–1.25), and the bytes moved (measured == predicted). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from timing import free_port, run_worker

WIDTH, LAYERS, HEADS, VOCAB, CONTEXT, BATCH, RANKS = 128, 4, 4, 2048, 64, 16, 2
LLAMA_MLP = 344  # 3 matrices of 344 features: the weights of the GPT's 2 of 4 x WIDTH
TARGET = (0.75, 1.25)  # predicted / measured step time


def build_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from strategies.probe import reads_tokens

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         intermediate_size=LLAMA_MLP, max_position_embeddings=CONTEXT,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = LlamaForCausalLM(config)
    reads_tokens(model)  # its probes feed it token ids
    return model


def build_gpt() -> Any:
    import torch

    from strategies.transformer.gpt import GPT

    torch.manual_seed(0)
    return GPT(VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, tie_weights=False)


# The Llama's declared plan with its head split by vocabulary: the loss scored on the split
# logits instead of gathering them (the `vocab` style of a user's `strategy.plan`).
LLAMA_VOCAB_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
                    "model.layers.*.self_attn.k_proj": "colwise",
                    "model.layers.*.self_attn.v_proj": "colwise",
                    "model.layers.*.self_attn.o_proj": "rowwise",
                    "model.layers.*.mlp.gate_proj": "colwise",
                    "model.layers.*.mlp.up_proj": "colwise",
                    "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "vocab"}

# label: (model builder, strategy, its options, pr, pc)
CONTENDERS: dict[str, tuple[Callable[[], Any], str, dict[str, Any], int, int]] = {
    "plan_model": (build_llama, "model", {}, RANKS, 1),
    "plan_vocab_model": (build_llama, "model", {"plan": LLAMA_VOCAB_PLAN}, RANKS, 1),
    "gpt_model": (build_gpt, "model", {"tp_layout": "pairing"}, RANKS, 1),
    "data": (build_llama, "data", {}, 1, RANKS),
}


def runner_step(model: Any, x: Any, y: Any, grid: Any, scale: float
                ) -> Callable[[], tuple[int, float]]:
    """The runner's training step of `model` on this rank's rows, with AdamW; it returns the
    bytes this rank moved and the seconds it spent in its collectives (waits included)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> tuple[int, float]:
        before = grid.counter.snapshot()
        model.zero_grad()
        (model.score(model(x), y).loss_sum * scale).backward()
        model.finish_gradient_sync()
        optimizer.step()
        moved = grid.counter.since(before)
        return int(moved.nbytes), float(moved.seconds)

    return step


def worker(steps: int, rounds: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel

    from runner.config.machine import load_compute_rates, load_machine_costs
    from runner.core import ProcessGrid
    from runner.cost.collectives import step_bytes
    from runner.cost.compute import oversubscription
    from strategies import STRATEGIES, PricingContext
    from strategies.base import StepPrediction, predict_step

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=generator)
    x_all, y_all = tokens[:, :-1], tokens[:, 1:]
    cores = len(os.sched_getaffinity(0))
    costs, rates = load_machine_costs(), load_compute_rates()
    pricing = PricingContext(costs, rates=rates, global_batch=BATCH,
                             slowdown=oversubscription(size, cores), optimizer="adamw")
    scale = size / (BATCH * CONTEXT)

    steppers: dict[str, Callable[[], tuple[int, float]]] = {}
    predicted: dict[str, tuple[StepPrediction, int]] = {}
    for label, (build, name, options, pr, pc) in CONTENDERS.items():
        strategy = STRATEGIES.get(name)(**options, pricing=pricing)
        grid = ProcessGrid(pr, pc, comm)
        plain = build()
        predicted[label] = (
            predict_step(strategy, plain, (CONTEXT,), grid.shape, BATCH),
            step_bytes(strategy.predict_ops(plain, (CONTEXT,), grid.shape, BATCH)))
        model = strategy.parallelize(plain, (CONTEXT,), grid)
        steppers[label] = runner_step(model, x_all[model.input_rows(BATCH)],
                                      y_all[model.output_rows(BATCH)], grid, scale)

    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    ddp = DistributedDataParallel(build_llama())
    ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rows = slice(rank * BATCH // size, (rank + 1) * BATCH // size)

    def ddp_step() -> tuple[int, float]:
        ddp_optimizer.zero_grad(set_to_none=False)
        logits = ddp(x_all[rows]).logits
        F.cross_entropy(logits.reshape(-1, VOCAB), y_all[rows].reshape(-1)).backward()
        ddp_optimizer.step()
        return 0, 0.0

    steppers["ddp"] = ddp_step

    times: dict[str, list[float]] = {label: [] for label in steppers}
    moved: dict[str, int] = {}
    comm_times: dict[str, list[float]] = {label: [] for label in steppers}
    for _ in range(rounds):  # alternating, so that a shared machine's drifts hit all alike
        for label, step in steppers.items():
            comm.Barrier()
            for i in range(steps + warmup):
                start = time.perf_counter()
                moved[label], comm_seconds = step()
                if i >= warmup:
                    times[label].append(time.perf_counter() - start)
                    comm_times[label].append(comm_seconds)
    dist.destroy_process_group()
    if rank != 0:
        return
    results: dict[str, dict[str, Any]] = {}
    for label, measured in times.items():
        median = statistics.median(measured)
        result: dict[str, Any] = {"median_step_s": median,
                                  "tokens_per_s": BATCH * CONTEXT / median}
        if label in predicted:
            prediction, predicted_bytes = predicted[label]
            ratio = prediction.total_s / median
            result.update({"predicted_step_s": prediction.total_s,
                           "predicted_compute_s": prediction.compute_s,
                           "predicted_comm_s": prediction.comm_s + prediction.wait_s,
                           "measured_comm_s": statistics.median(comm_times[label]),
                           "predicted_over_measured": ratio,
                           "within_target": TARGET[0] <= ratio <= TARGET[1],
                           "comm_bytes_per_step": moved[label],
                           "predicted_comm_bytes_per_step": predicted_bytes})
        results[label] = result

    def over(a: str, b: str) -> float:
        """How many of b's tokens/s a delivers."""
        return float(results[a]["tokens_per_s"] / results[b]["tokens_per_s"])

    print(json.dumps({"ranks": size, "cores": cores, "steps_timed": len(times["ddp"]),
                      "calibration": {"costs": costs.source, "compute": rates.source},
                      "layouts": results,
                      "plan_over_gpt_model": over("plan_model", "gpt_model"),
                      "plan_vocab_over_gpt_model": over("plan_vocab_model", "gpt_model"),
                      "plan_over_data": over("plan_model", "data"),
                      "data_over_ddp": over("data", "ddp")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and layout")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds, args.warmup)
        return
    run = run_worker(__file__, RANKS, "--steps", str(args.steps), "--rounds",
                     str(args.rounds), "--warmup", str(args.warmup))
    print(json.dumps({"benchmark": "plans", "model": {
        "width": WIDTH, "layers": LAYERS, "heads": HEADS, "vocab": VOCAB, "context": CONTEXT,
        "llama_mlp": LLAMA_MLP, "gpt_mlp": 4 * WIDTH}, "global_batch": BATCH,
        "threads_per_rank": 1, "target_predicted_over_measured": list(TARGET), **run}, indent=2))


if __name__ == "__main__":
    main()
