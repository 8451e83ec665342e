"""Sharded data parallelism (`strategy=fsdp`): its units, and a sharded checkpoint resumed under
other strategies and stages through the command line. Equality with one process at every stage,
with real ranks, is `tests/mpi/check_fsdp.py`'s."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from runner.zoo.models import mlp
from strategies.fsdp_units import unit_parameters, unit_paths, unmatched_patterns
from strategies.transformer import GPT
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


def test_units_by_path_or_class_and_a_pattern_that_matches_nothing() -> None:
    gpt = GPT(32, 8, width=16, layers=2, heads=2)
    by_class = unit_paths(gpt, ["TransformerBlock"])
    assert by_class == unit_paths(gpt, ["blocks.*"]) == ["", "blocks.0", "blocks.1"]
    assert unmatched_patterns(gpt, ["blocks.*", "decoder.*"]) == ["decoder.*"]
    net = mlp((1, 4, 4), 3, hidden=(8, 8))  # no stack of blocks: the model's own children
    assert unit_paths(net, "auto") == ["", "1", "3", "5"]
    plain = nn.Linear(4, 2)
    assert unit_paths(plain, "auto") == [""]


COMMON = ["dataset=synthetic", "trainer.batch_size=8", "trainer.dtype=float64",
          "trainer.eval_every=null", "trainer.steps=4", "seed=2", "optimizer=adamw"]


def test_a_sharded_checkpoint_resumes_under_data_and_another_stage_exactly(
        tmp_path: Path) -> None:
    sharded, whole = tmp_path / "fsdp", tmp_path / "one"
    jobs = [[*COMMON, "strategy=fsdp", "grid.pr=1", "grid.pc=2", "trainer.checkpoint_every=2",
             f"hydra.run.dir={sharded}"],
            [*COMMON, "strategy=data", "grid.pr=1", "grid.pc=1", f"hydra.run.dir={whole}"]]
    for result in run_cli_together(*jobs):
        assert_ok(result)
    reference = train_losses(whole)
    assert len(reference) == 4
    checkpoint = sharded / "checkpoints" / "step-00000002"
    resumed = [[*COMMON, "strategy=data", "grid.pr=1", "grid.pc=2",
                f"trainer.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'data'}"],
               [*COMMON, "strategy=fsdp", "strategy.stage=1", "grid.pr=1", "grid.pc=2",
                f"trainer.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'stage1'}"]]
    for result in run_cli_together(*resumed):
        assert_ok(result)
    summary = read_summary(sharded)
    assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"] > 0
    # the bytes held, counted from the tensors, as predicted; half of one process's state
    for run in (sharded, tmp_path / "stage1", whole):
        held = read_summary(run)
        assert held["memory_per_rank"] == held["predicted_memory_per_rank"], run
    one = read_summary(whole)["memory_per_rank"]
    for part in ("parameters", "optimizer state"):
        assert summary["memory_per_rank"][part] <= 0.55 * one[part], part
    assert 0 < summary["memory_per_rank"]["gathered parameters"] < one["parameters"]
    assert summary["layouts"] == {"1": "fsdp stage 3", "3": "fsdp stage 3", "5": "fsdp stage 3"}
    for run in (sharded, tmp_path / "data", tmp_path / "stage1"):
        losses = train_losses(run)
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference[-len(losses):],
                                                      strict=True)) <= 1e-9, (run, losses)
