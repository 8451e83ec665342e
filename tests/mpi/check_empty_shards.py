"""Validation sets too small for the grid, under every strategy, in one launch:
`mpiexec -n 4 python THIS` (tests/test_bad_values.py runs it).

A set of 1 or 3 rows on a grid of 2 or 4 batch groups leaves a batch group without rows (what
`trainer.eval_samples=1` does on the default grid): the loss and accuracy are one process's on
the same weights, in float64 to 1e-12, under data, model, grid, domain, auto, fsdp on one and two
dimensions, grid, fsdp and domain split by a plan, and a GPT's tensor and sequence parallelism,
in pieces of the whole set and of one row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import check, make_grids, run_checks
from plan_harness import built
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's `tests`
from runner.core import ProcessGrid
from runner.training.evaluation import evaluate
from runner.zoo.models import cnn, mlp
from strategies import STRATEGIES, PricingContext
from strategies.transformer.gpt import GPT
from tests import plan_models

GRIDS = make_grids([(1, 4), (4, 1), (2, 2)])
IMAGE, VOCAB, T = (1, 8, 8), 48, 8
# the plan of the user's block model without its head and embedding (48 rows split as they are)
PLAN = {"blocks.*.attn.qkv": "fused_qkv", "blocks.*.attn.out": "rowwise",
        "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}
# its norms and MLPs on a rank's positions (strategy=domain by plan)
SEQUENCE_PLAN = {"blocks.*.norm*": "sequence", "blocks.*.fc*": "sequence", "norm": "sequence"}


def one_process(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        logits = model.eval()(x)
    flat = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(flat, y.reshape(-1)).item()
    return loss, (flat.argmax(1) == y.reshape(-1)).double().mean().item()


def compare(name: str, shape: tuple[int, int], factory: Callable[[], nn.Module],
            tokens: bool = False, **options: object) -> None:
    grid: ProcessGrid | None = GRIDS[shape]
    if grid is None:
        return
    sample = (T,) if tokens else IMAGE
    strategy = STRATEGIES.get(name)(**options)
    what = f"{name} {shape[0]}x{shape[1]} {factory.__name__}"
    assert strategy.check_model(built(factory, tokens), sample, grid.shape) == [], what
    pmodel = strategy.parallelize(built(factory, tokens), sample, grid)
    reference = built(factory, tokens)
    gen = torch.Generator().manual_seed(7)
    if tokens:
        x = torch.randint(1, VOCAB, (3, T), generator=gen)
        y = torch.randint(0, VOCAB, (3, T), generator=gen)
    else:
        x = torch.randn(3, *IMAGE, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 10, (3,), generator=gen)
    for rows in (1, 3):
        want = one_process(reference, x[:rows], y[:rows])
        for batch in (None, 1):  # the whole set in one piece, and a piece per row
            got = evaluate(pmodel, x[:rows], y[:rows], batch_size=batch)
            assert abs(got.loss - want[0]) <= 1e-12 * abs(want[0]), (what, rows, got, want)
            assert got.accuracy == want[1], (what, rows, batch, got, want)


def small_mlp() -> nn.Module:
    return mlp(IMAGE, 10, hidden=(12, 10))


def small_cnn() -> nn.Module:
    return cnn(IMAGE, 10, channels=(4,), hidden=(12,))


def user_block_lm() -> nn.Module:
    return plan_models.UserBlockLM(VOCAB, (T,))


def gpt() -> nn.Module:
    return GPT(VOCAB, T, width=16, layers=1, heads=4, tie_weights=False)


@check
def split_strategies_score_an_empty_batch_group_as_one_process() -> None:
    compare("data", (1, 4), small_mlp)
    compare("model", (4, 1), small_mlp)
    compare("grid", (2, 2), small_mlp)
    compare("grid", (2, 2), small_cnn)
    compare("domain", (2, 2), small_cnn)
    compare("auto", (2, 2), small_mlp, pricing=PricingContext(global_batch=4))


@check
def sharded_and_planned_strategies_score_an_empty_batch_group_as_one_process() -> None:
    compare("fsdp", (1, 4), small_mlp, stage=3)
    compare("fsdp", (2, 2), user_block_lm, tokens=True, stage=3, plan=PLAN)
    compare("grid", (2, 2), user_block_lm, tokens=True, plan=PLAN)
    compare("domain", (2, 2), user_block_lm, tokens=True, plan=SEQUENCE_PLAN)
    # a GPT's own tensor parallelism (its head by vocabulary) and its sequence split
    compare("grid", (2, 2), gpt, tokens=True)
    compare("domain", (2, 2), gpt, tokens=True)


if __name__ == "__main__":
    run_checks()
