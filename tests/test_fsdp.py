"""Sharded data parallelism (`strategy=fsdp`): its units; through the command line, accumulation,
recomputation, the 2-D grid and sharded checkpoints resumed under other strategies, grids and
stages. Equality with one process at every stage, with real ranks, is
`tests/mpi/check_fsdp.py`'s."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.core import GridShape
from runner.zoo.models import mlp
from strategies import STRATEGIES
from strategies.sharding.memory import HeldWhole, gathered_peak
from strategies.sharding.units import (
    container_units,
    unit_parameters,
    unit_paths,
    unmatched_patterns,
)
from strategies.transformer.gpt import GPT
from tests.conftest import assert_ok, read_summary, run_cli_together, train_losses


def test_auto_units_are_the_blocks_of_the_largest_stack_and_the_model_holds_the_rest() -> None:
    gpt = GPT(32, 8, width=16, layers=3, heads=2)
    assert unit_paths(gpt, "auto") == ["", "blocks.0", "blocks.1", "blocks.2"]
    found = unit_parameters(gpt, unit_paths(gpt, "auto"))
    # the tied embedding and head, and the final norm, stay with the model's own unit
    assert [name for name, _, _ in found[""]] == ["tok_emb.weight", "pos_emb.weight",
                                                 "ln_f.weight", "ln_f.bias"]
    assert all(name.startswith("blocks.1.") for name, _, _ in found["blocks.1"])
    tied = next(holders for name, holders, _ in found[""] if name == "tok_emb.weight")
    assert {type(h.module).__name__ for h in tied} == {"Embedding", "Linear"}


def test_a_stack_of_one_block_gives_its_block_never_the_list_that_holds_it() -> None:
    """A ModuleList is never called (its members are), so it cannot gather before a forward:
    a one-block GPT's unit is the block; a pattern naming the list is refused by name."""
    gpt = GPT(32, 8, width=16, layers=1, heads=2)
    assert unit_paths(gpt, "auto") == ["", "tok_emb", "pos_emb", "blocks.0", "ln_f", "head"]
    assert container_units(gpt, "auto") == []
    assert container_units(gpt, ["blocks"]) == ["blocks"]
    problems = STRATEGIES.get("fsdp")(units=["blocks"]).check_model(gpt, (8,), GridShape(1, 2))
    assert problems == ["strategy.units: blocks is a ModuleList, which is never called (its "
                        "members are): name its members (blocks.*)"], problems


def test_units_by_path_or_class_and_a_pattern_that_matches_nothing() -> None:
    gpt = GPT(32, 8, width=16, layers=2, heads=2)
    by_class = unit_paths(gpt, ["TransformerBlock"])
    assert by_class == unit_paths(gpt, ["blocks.*"]) == ["", "blocks.0", "blocks.1"]
    assert unmatched_patterns(gpt, ["blocks.*", "decoder.*"]) == ["decoder.*"]
    net = mlp((1, 4, 4), 3, hidden=(8, 8))  # no stack of blocks: the model's own children
    assert unit_paths(net, "auto") == ["", "1", "3", "5"]
    plain = nn.Linear(4, 2)
    assert unit_paths(plain, "auto") == [""]


class Shift(nn.Module):
    """x + a learned offset: backward reads none of its weights."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


def test_prefetch_holds_the_next_units_gather_from_its_issue() -> None:
    """Five units, float32, P = 2: 0 Linear(8, 32) (1152 B whole; its input needs no gradient,
    so backward reads none of its weights), 1 Shift (128 B, reads none), 2 Linear(32, 32)
    (4224 B), 3 Shift (128 B), 4 Linear(32, 4) (528 B)."""
    model = nn.Sequential(nn.Linear(8, 32), Shift(32), nn.Linear(32, 32), Shift(32),
                          nn.Linear(32, 4))

    def gathered(stage: int, prefetch: bool) -> int:
        strategy = STRATEGIES.get("fsdp")(stage=stage, prefetch=prefetch)
        return strategy.predict_memory(model, (8,), GridShape(1, 2), 2)["gathered parameters"]

    # stage 3 without: one unit at a time, the largest; with: forward holds a unit and the
    # next one (at most 4224 + 128), backward regathers 4 then 2 (skipping 3, which it does not
    # read) and holds 4 and 2 at once
    assert gathered(3, False) == 4224
    assert gathered(3, True) == 528 + 4224
    # stages 1 and 2: autograd keeps 2 and 4 whole; without prefetch the most is at 4's entry
    # (2, 4), with it at 3's (2, 3 and 4 issued ahead)
    for stage in (1, 2):
        assert gathered(stage, False) == 4224 + 528
        assert gathered(stage, True) == 4224 + 128 + 528
    # pieces, gradients and state do not change
    on, off = (STRATEGIES.get("fsdp")(prefetch=p).predict_memory(model, (8,), GridShape(1, 2), 2)
               for p in (True, False))
    assert {k: v for k, v in on.items() if k != "gathered parameters"} == {
        k: v for k, v in off.items() if k != "gathered parameters"}


def test_gathered_peak_replays_the_hooks_on_one_forwards_entries_and_exits() -> None:
    """Units a, b, c run in turn (1, 10 and 100 bytes whole). Stage 3: one at a time, with
    prefetch also the next (b and c at once); units autograd keeps add up; a recomputed
    module's units held together in backward, more than its forward held."""
    events = [(path, entering) for path in "abc" for entering in (True, False)]
    sizes = {"a": 1, "b": 10, "c": 100}
    regathered = HeldWhole(kept=set(), regathered={"a", "b", "c"}, recomputed={})
    assert gathered_peak(events, sizes, regathered, prefetch=False) == 100
    assert gathered_peak(events, sizes, regathered, prefetch=True) == 110
    kept = HeldWhole(kept={"a", "b", "c"}, regathered=set(), recomputed={})
    assert gathered_peak(events, sizes, kept, prefetch=False) == 111
    recomputed = HeldWhole(kept=set(), regathered={"a"}, recomputed={"bc": ["b", "c"]})
    assert gathered_peak(events, sizes, recomputed, prefetch=False) == 110


def test_prefetch_must_be_true_or_false() -> None:
    strategy = STRATEGIES.get("fsdp")(prefetch="yes")  # type: ignore[arg-type]
    assert strategy.check(GridShape(1, 2), 8) == [
        "strategy.prefetch=yes: must be true (each unit's gather issued ahead of its use) or "
        "false (each gather when its unit starts)"]


GPT_RUN = ["model=gpt", "model.width=32", "dataset=tokens", "dataset.vocab_size=200",
           "dataset.seq_len=16", "dataset.samples=256", "trainer.batch_size=8",
           "trainer.dtype=float64", "trainer.eval_every=null", "trainer.steps=4", "seed=2",
           "optimizer=adamw"]
FSDP = ["strategy=fsdp"]


def test_accumulation_recomputation_2d_grids_and_sharded_checkpoints_train_as_one_process(
        tmp_path: Path) -> None:
    """With real ranks, through the command line, every loss equal to one process's (1e-9):
    fsdp 1x2 with 2 micro-batches and the blocks recomputed (less activation memory than without
    either), fsdp 2x2 (GPT's tensor parallelism over the model group, each part sharded over the
    batch group) at stage 1 with accumulation; checkpoints of both resumed under data, fsdp on
    another grid and stage, and grid, exactly. Every run moves the predicted bytes and holds the
    predicted memory. The first two through torch.distributed (gloo: the calls NCCL takes)."""
    run = {name: tmp_path / name for name in ("one", "micro", "plain", "grid2d", "data",
                                               "stage2", "split")}
    first = [[*GPT_RUN, "grid.pr=1", "grid.pc=1", f"hydra.run.dir={run['one']}"],
             [*GPT_RUN, *FSDP, "grid.pr=1", "grid.pc=2", "trainer.accumulate_steps=2",
              "trainer.activation_checkpointing=units", "comm.backend=torch",
              f"hydra.run.dir={run['micro']}"],
             [*GPT_RUN, *FSDP, "grid.pr=1", "grid.pc=2", "trainer.checkpoint_every=2",
              f"hydra.run.dir={run['plain']}"],
             [*GPT_RUN, *FSDP, "strategy.stage=1", "grid.pr=2", "grid.pc=2",
              "trainer.accumulate_steps=2", "trainer.checkpoint_every=2", "comm.backend=torch",
              f"hydra.run.dir={run['grid2d']}"]]
    for result in run_cli_together(*first):
        assert_ok(result)
    step2 = "checkpoints/step-00000002"
    resumed = [[*GPT_RUN, "strategy=data", "grid.pr=1", "grid.pc=2",
                f"trainer.resume={run['plain'] / step2}", f"hydra.run.dir={run['data']}"],
               [*GPT_RUN, *FSDP, "strategy.stage=2", "grid.pr=2", "grid.pc=2",
                f"trainer.resume={run['plain'] / step2}", f"hydra.run.dir={run['stage2']}"],
               [*GPT_RUN, "strategy=grid", "grid.pr=2", "grid.pc=2",
                f"trainer.resume={run['grid2d'] / step2}", f"hydra.run.dir={run['split']}"]]
    for result in run_cli_together(*resumed):
        assert_ok(result)
    reference = train_losses(run["one"])
    assert len(reference) == 4
    for name, path in run.items():
        losses = train_losses(path)
        assert len(losses) == (2 if name in ("data", "stage2", "split") else 4), name
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference[-len(losses):],
                                                      strict=True)) <= 1e-9, (name, losses)
        summary = read_summary(path)
        assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"], name
        assert summary["memory_per_rank"] == summary["predicted_memory_per_rank"], name
    micro, plain = read_summary(run["micro"]), read_summary(run["plain"])
    assert micro["activation_bytes_peak"] < 0.5 * plain["activation_bytes_peak"]
    # whole gradients kept between micro-batches: the pieces' and every unit's whole ones
    assert micro["memory_per_rank"]["gradients"] > 2 * plain["memory_per_rank"]["gradients"]
    one = read_summary(run["one"])["memory_per_rank"]
    for part in ("parameters", "optimizer state"):  # half of one process's, and a unit whole
        assert plain["memory_per_rank"][part] <= 0.55 * one[part], part
    # gathered at once: the model's own unit, a block and (prefetched) the next: of this
    # two-block GPT, every parameter
    assert 0 < plain["memory_per_rank"]["gathered parameters"] <= one["parameters"]
    grid2d = read_summary(run["grid2d"])
    assert grid2d["layouts"]["blocks.0"] == "fsdp stage 1"
    assert grid2d["memory_per_rank"]["parameters"] < 0.6 * plain["memory_per_rank"]["parameters"]
