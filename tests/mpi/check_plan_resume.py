"""Planned runs resume across grids and strategies, and vision transformers split by a plan, in
one launch: `mpiexec -n 4 python THIS [OUT]`.

- The transformers library's Llama trained 2 steps under `strategy=grid` 2x2 with its declared
  plan, its checkpoint (each split parameter a block of its global tensor) resumed for 2 more
  under `strategy=data` 1x4 and `strategy=model` 4x1: each gives the uninterrupted one-process
  run's losses (float64, 1e-9 relative), moving the predicted bytes every step; and a `data`
  1x4 checkpoint resumed under the plan on the grid 2x2 does too; so does the grid 2x2 one
  resumed under `strategy=model` 2x1 with the plan's norms `sequence`. A `strategy=domain` 2x2
  run of a plan (norms and MLPs `sequence`, every weight whole) gives the one-process losses,
  and its checkpoint resumes under `strategy=grid` 2x2 and `strategy=data` 1x4 alike.
- The transformers library's ViT (a plan given) and a timm-style ViT (its fused qkv Linear
  split by `fused_qkv`) under `strategy=model` 2x1 and `strategy=grid` 2x2: every step's loss
  equals one process's to 1e-9, every final parameter piece the block of one process's
  parameter its placement names, and the bytes rank 0 moves every step the predicted ones.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests` is this checkout's, whatever else is installed

import torch  # noqa: E402
from harness import (  # noqa: E402
    assert_one_process,
    check,
    make_grids,
    one_process_losses,
    run_checks,
    train_losses,
    train_run,
    wait_politely,
)
from mpi4py import MPI  # noqa: E402
from plan_harness import (  # noqa: E402
    TOLERANCE,
    built,
    tagged_copy,
    train_as_one_process,
)
from torch import nn  # noqa: E402

from runner.core import ProcessGrid  # noqa: E402
from strategies import STRATEGIES  # noqa: E402
from tests import plan_vit_models  # noqa: E402

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/check_plan_resume")
WORLD = MPI.COMM_WORLD
GRIDS = make_grids([(1, 1), (1, 4), (4, 1), (2, 2), (2, 1)])
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None

# 4 key/value heads: the declared plan splits them over 4 ranks too
LLAMA = {"_target_": "tests.plan_models.hf_llama", "key_value_heads": 4}
TOKENS = {"name": "tokens", "vocab_size": 48, "seq_len": 8, "classes": 4, "samples": 64,
          "val_fraction": 0.2, "seed": 0}
STEPS, CHECKPOINT_STEP = 4, 2
# Llama's declared plan in gridrun's styles, its norms on a rank's positions (`sequence`)
SEQUENCE_PLAN = {f"model.layers.*.{path}": style for path, style in (
    ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
    ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"),
    ("input_layernorm", "sequence"), ("post_attention_layernorm", "sequence"))}
SEQUENCE_PLAN |= {"model.norm": "sequence", "lm_head": "colwise"}
# strategy=domain: the norms and MLPs on a rank's positions, every weight whole
DOMAIN_PLAN = {"model.layers.*.*_layernorm": "sequence", "model.layers.*.mlp": "sequence",
               "model.norm": "sequence"}


def run_config(strategy: str, pr: int, pc: int, steps: int = STEPS,
               resume: str | None = None, checkpoint_every: int | None = None,
               plan: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "seed": 3, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": steps, "batch_size": 8, "log_every": 1, "eval_every": 1000,
                    "checkpoint_every": checkpoint_every, "resume": resume, "threads": None,
                    "dtype": "float64"},
        "model": LLAMA, "dataset": TOKENS,
        "strategy": {"name": strategy, **({"plan": plan} if plan else {})},
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01},
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


@functools.cache
def uninterrupted() -> list[float]:
    """One process's losses over all the steps (every rank gets them)."""
    return one_process_losses({"one": (run_config("data", 1, 1), OUT / "one")})["one"]


def write_checkpoint(name: str, strategy: str, pr: int, pc: int,
                     plan: dict[str, str] | None = None) -> str:
    path = train_run(run_config(strategy, pr, pc, steps=CHECKPOINT_STEP,
                                checkpoint_every=CHECKPOINT_STEP, plan=plan), OUT / name,
                     GRIDS[pr, pc])
    return str(path / "checkpoints" / f"step-{CHECKPOINT_STEP:08d}")


def resume(name: str, checkpoint: str, strategy: str, pr: int, pc: int,
           want: list[float], plan: dict[str, str] | None = None) -> None:
    grid = GRIDS[pr, pc]
    if grid is None:  # a rank outside a grid of fewer ranks
        return
    path = train_run(run_config(strategy, pr, pc, resume=checkpoint, plan=plan), OUT / name,
                     grid)
    if grid.rank != 0:
        return
    _, lines = train_losses(path)
    assert lines[0]["step"] == CHECKPOINT_STEP + 1, (name, lines[0])
    assert_one_process(path, want[CHECKPOINT_STEP:], TOLERANCE, name)
    layouts = json.loads((path / "summary.json").read_text()).get("layouts") or {}
    planned = strategy != "data"
    assert bool(layouts) == planned, (name, layouts)
    if planned:
        assert layouts["model.layers.0.self_attn.q_proj"] == "colwise", layouts
    if plan:
        assert layouts["model.layers.0.input_layernorm"] == "sequence", layouts


def split_blocks(checkpoint: str, name: str) -> list[list[Any]]:
    """The blocks of tensor `name` the checkpoint's model weights are kept in."""
    manifest = json.loads((Path(checkpoint) / "manifest.json").read_text())
    return [entry for entries in manifest["files"].values() for entry in entries
            if entry[0] == "model" and entry[2] == name]


@check
def a_planned_checkpoint_resumes_under_other_grids_and_strategies() -> None:
    if not HAVE_TRANSFORMERS:
        return
    want = uninterrupted()
    planned = write_checkpoint("written_grid", "grid", 2, 2)
    if WORLD.Get_rank() == 0:  # the plan's pieces, each by its rows of the global weight
        rows = sorted((entry[4], entry[5]) for entry in
                      split_blocks(planned, "model.layers.0.self_attn.q_proj.weight"))
        assert rows == [(0, 8), (8, 16)], rows
    resume("resumed_data", planned, "data", 1, 4, want)
    resume("resumed_model", planned, "model", 4, 1, want)
    # the norms on a rank's positions: their weights whole, as in the checkpoint
    resume("resumed_sequence", planned, "model", 2, 1, want, SEQUENCE_PLAN)
    wait_politely()


@check
def an_unplanned_checkpoint_resumes_under_a_plan() -> None:
    if not HAVE_TRANSFORMERS:
        return
    want = uninterrupted()
    unplanned = write_checkpoint("written_data", "data", 1, 4)
    resume("resumed_grid", unplanned, "grid", 2, 2, want)


@check
def a_domain_planned_checkpoint_resumes_under_grid_and_data() -> None:
    if not HAVE_TRANSFORMERS:
        return
    want = uninterrupted()
    written = write_checkpoint("written_domain", "domain", 2, 2, DOMAIN_PLAN)
    if WORLD.Get_rank() == 0:  # the domain run itself: one process's losses, bytes predicted
        run = OUT / "written_domain"
        assert_one_process(run, want[:CHECKPOINT_STEP], TOLERANCE, "written_domain")
        layouts = json.loads((run / "summary.json").read_text())["layouts"]
        assert layouts["model.layers.0.mlp"] == "sequence", layouts
    resume("resumed_domain_grid", written, "grid", 2, 2, want)
    resume("resumed_domain_data", written, "data", 1, 4, want)
    wait_politely()


# -- vision transformers split by a plan, against one process ---------------------------------

BATCH, CLASSES = 8, 4
IMAGE_SHAPE = (plan_vit_models.CHANNELS, plan_vit_models.IMAGE, plan_vit_models.IMAGE)


def compare_images(factory: Callable[[], nn.Module], plan: dict[str, str],
                   strategy_name: str, shape: tuple[int, int]) -> None:
    grid: ProcessGrid | None = GRIDS[shape]
    if grid is None:
        return
    what = f"{factory.__name__} {strategy_name} {shape[0]}x{shape[1]}"
    strategy = STRATEGIES.get(strategy_name)(bucket_cap_mb=0.004, first_bucket_mb=0.001,
                                             plan=plan)
    seq = built(factory, tokens=False)
    assert strategy.check(grid.shape, BATCH) == [], what
    problems = strategy.check_model(seq, IMAGE_SHAPE, grid.shape)
    assert problems == [], (what, problems)
    ops = strategy.predict_ops(seq, IMAGE_SHAPE, grid.shape, BATCH)
    pmodel = strategy.parallelize(tagged_copy(seq, tokens=False), IMAGE_SHAPE, grid)
    assert set(getattr(pmodel, "layouts", {}).values()) == set(plan.values()), what
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(BATCH, *IMAGE_SHAPE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    train_as_one_process(seq, pmodel, grid, x, y, ops, what,
                         lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9))


def hf_vit() -> nn.Module:
    return plan_vit_models.hf_vit(CLASSES)


def timm_style_vit() -> nn.Module:
    return plan_vit_models.TimmStyleViT(CLASSES)


@check
def vision_transformers_by_plan_equal_one_process() -> None:
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        if HAVE_TRANSFORMERS:
            compare_images(hf_vit, plan_vit_models.HF_VIT_PLAN, strategy_name, shape)
        compare_images(timm_style_vit, plan_vit_models.TIMM_VIT_PLAN, strategy_name, shape)
        wait_politely()


if __name__ == "__main__":
    run_checks()
