"""Parallel plans by module name (strategies/plans/module_plan.py), in process: parsing and glob
matching, where plans come from, each refusal; and the user's path end to end through the
command line (a plan on the command line, a plan in a YAML file of the user's config dir)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.core import ProcessGrid
from strategies import STRATEGIES
from strategies.plans.module_plan import (
    DECLARED_SOURCE,
    USER_SOURCE,
    declared_plan,
    match_plan,
    module_plan,
    plan_problems,
)
from tests import plan_models
from tests.conftest import assert_ok, read_summary, run_cli_together, train_losses

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
VOCAB, T = 50, 8


def block_lm() -> nn.Module:
    torch.manual_seed(0)
    return plan_models.UserBlockLM(VOCAB, (T,))


def test_patterns_match_module_paths_dots_included() -> None:
    plan = match_plan(block_lm(), {"*.qkv": "fused_qkv", "blocks.1.fc?": "colwise"},
                      USER_SOURCE)
    assert plan.layouts == {"blocks.0.attn.qkv": "fused_qkv", "blocks.1.attn.qkv": "fused_qkv",
                            "blocks.1.fc1": "colwise", "blocks.1.fc2": "colwise"}
    assert plan.given_problems == []


def test_a_module_matched_by_two_styles_an_unknown_style_and_an_idle_pattern_are_named(
        ) -> None:
    plan = match_plan(block_lm(), {"blocks.0.fc1": "colwise", "blocks.*.fc1": "rowwise",
                                   "head": "sideways", "nothing.here": "colwise"}, USER_SOURCE)
    problems = plan.given_problems
    assert "strategy.plan: head: sideways is not a style gridrun runs" in problems[0]
    assert any("blocks.0.fc1 is matched by blocks.0.fc1, blocks.*.fc1" in p for p in problems)
    assert "strategy.plan: nothing.here matches no module of the model" in problems
    assert plan_problems(plan, block_lm(), (T,), 2) == problems


def test_without_a_plan_nothing_changes() -> None:
    assert module_plan(block_lm(), {}) is None
    assert declared_plan(nn.Sequential(nn.Linear(4, 4))) == {}


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_the_users_plan_comes_before_the_models_declared_one() -> None:
    llama = plan_models.hf_llama(VOCAB, (T,))
    declared = module_plan(llama, {})
    assert declared is not None and declared.source == DECLARED_SOURCE
    # the base model's patterns resolved under `model.`, the head's from the wrapper
    assert declared.layouts["model.layers.1.self_attn.k_proj"] == "colwise"
    assert declared.layouts["model.layers.0.mlp.down_proj"] == "rowwise"
    assert declared.layouts["lm_head"] == "colwise_gather_output"  # the library's own name
    given = module_plan(llama, {"model.layers.*.mlp.up_proj": "colwise"})
    assert given is not None and given.source == USER_SOURCE
    assert set(given.layouts) == {"model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"}


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_key_value_heads_that_neither_divide_nor_serve_one_ranks_heads_are_refused_by_name(
        ) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # 6 query heads over 3 ranks, 2 key/value heads: rank 1's two query heads read both
    config = LlamaConfig(vocab_size=48, hidden_size=24, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=2, intermediate_size=36,
                         max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    llama = LlamaForCausalLM(config)
    problems = STRATEGIES.get("model")().check_model(llama, (T,), _shape(3))
    assert ("strategy=model: model.layers.0.self_attn.k_proj (Linear): its 8 output features "
            "do not divide over grid.pr=3 ranks") in problems, problems
    # 4 query heads over 4 ranks, 2 key/value heads: each held whole (kv_replicated)
    assert not any("key/value" in p for p in STRATEGIES.get("model")().check_model(
        plan_models.hf_llama(48, (T,)), (T,), _shape(4)))


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_gpt2s_attention_attributes_are_divided_and_reported() -> None:
    from strategies.plans.module_plan import adjustments

    gpt2 = plan_models.hf_gpt2(VOCAB, (T,))
    plan = module_plan(gpt2, plan_models.GPT2_PLAN)
    assert plan is not None
    found, problems = adjustments(plan, gpt2, 2, None)
    assert problems == []
    assert "adjusted transformer.h.0.attn.split_size 16 → 8" in [str(a) for a in found]
    assert "adjusted transformer.h.1.attn.num_heads 4 → 2" in [str(a) for a in found]


def test_a_tied_table_splits_by_vocabulary_with_its_head_or_is_refused() -> None:
    model = plan_models.UserBlockLM(VOCAB, (T,))
    model.head.weight = model.embed.weight
    # the head split by rows takes the table along, by vocabulary: one piece, both uses
    plan = module_plan(model, {"head": "colwise"})
    assert plan is not None and plan.layouts == {"embed": "vocab", "head": "colwise"}
    assert list(plan.layouts) == ["embed", "head"]  # in the model's order
    assert plan_problems(plan, model, (T,), 2) == []
    # a tied weight split otherwise (the table by its features) is refused by name
    plan = match_plan(model, {"head": "rowwise"}, USER_SOURCE)
    problems = plan_problems(plan, model, (T,), 2)
    assert any(p.startswith("head (Linear): its weights are shared with embed (tied): a plan "
                            "splits a tied weight only by its vocabulary rows") for p in problems)
    # the split model holds one parameter for both, at its rows of the table
    strategy = STRATEGIES.get("model")(plan={"head": "colwise"})
    pmodel = strategy.parallelize(model, (T,), ProcessGrid(1, 1))
    inner = pmodel.module
    assert inner.embed.weight is inner.head.weights[0]


def _shape(pr: int, pc: int = 1):  # type: ignore[no-untyped-def]
    from runner.core import GridShape

    return GridShape(pr, pc)


COMMON = ["model._target_=tests.plan_models.UserBlockLM", "dataset=tokens",
          "dataset.vocab_size=50", "dataset.seq_len=8", "dataset.samples=64", "trainer.steps=2",
          "trainer.batch_size=8", "trainer.dtype=float64", "trainer.eval_every=1000"]
YAML_PLAN = """defaults: [grid]
plan:
  embed: vocab
  blocks.*.attn.qkv: fused_qkv
  blocks.*.attn.out: rowwise
  blocks.*.fc1: colwise
  blocks.*.fc2: rowwise
  head: colwise
"""


def test_a_plan_on_the_command_line_and_one_in_yaml_train_as_one_process(
        tmp_path: Path) -> None:
    """The plan on the command line runs under torch.distributed (gloo), the YAML one under
    MPI."""
    (tmp_path / "conf" / "strategy").mkdir(parents=True)
    (tmp_path / "conf" / "strategy" / "planned.yaml").write_text(YAML_PLAN)
    given = ("strategy.plan={embed: vocab, blocks.*.attn.qkv: fused_qkv, "
             "blocks.*.attn.out: rowwise, blocks.*.fc1: colwise, blocks.*.fc2: rowwise, "
             "head: colwise}")
    jobs = [[*COMMON, "strategy=data", "grid.pr=1", "grid.pc=1",
             f"hydra.run.dir={tmp_path / 'one'}"],
            [*COMMON, "strategy=grid", "grid.pr=2", "grid.pc=2", given, "comm.backend=torch",
             f"hydra.run.dir={tmp_path / 'line'}"],
            ["--config-dir", str(tmp_path / "conf"), *COMMON, "strategy=planned", "grid.pr=2",
             "grid.pc=1", f"hydra.run.dir={tmp_path / 'yaml'}"]]
    for result in run_cli_together(*jobs):
        assert_ok(result)
    one = train_losses(tmp_path / "one")
    assert len(one) == 2
    for name in ("line", "yaml"):
        got = train_losses(tmp_path / name)
        assert max(abs(a - b) / abs(b) for a, b in zip(got, one, strict=True)) <= 1e-9, (
            name, got, one)
        summary = read_summary(tmp_path / name)
        assert summary["layouts"]["blocks.1.attn.qkv"] == "fused_qkv", summary["layouts"]
        assert summary["layouts"]["head"] == "colwise"
        assert "adjusted blocks.0.attn.heads 4 → 2" in summary["plan_adjustments"]
        assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"]


class NormBetween(nn.Module):
    """A LayerNorm on the features between a colwise and a rowwise Linear: it would normalise
    one rank's features as if they were all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(torch.relu(self.up(x))))


def test_split_features_must_be_summed_before_anything_reads_them_whole() -> None:
    model = NormBetween()
    plan = match_plan(model, {"up": "colwise", "down": "rowwise"}, USER_SOURCE)
    assert plan_problems(plan, model, (8,), 2) == [
        "norm (LayerNorm) runs on the features up split over the model group before a rowwise "
        "module sums them: plan it too, or end the split before it"]
    lm = block_lm()
    only_up = match_plan(lm, {"blocks.*.fc1": "colwise"}, USER_SOURCE)
    assert [p.split(" runs on ")[0] for p in plan_problems(only_up, lm, (T,), 2)] == [
        "blocks.0.fc2 (Linear)", "blocks.1.fc2 (Linear)"]  # once per stretch, no cascade
    last = match_plan(lm, {"blocks.*.attn.qkv": "fused_qkv", "blocks.*.attn.out": "rowwise",
                           "blocks.1.fc1": "colwise", "blocks.1.fc2": "rowwise",
                           "norm": "replicate", "head": "replicate"}, USER_SOURCE)
    assert plan_problems(last, lm, (T,), 2) == []
    open_end = NormBetween()
    assert plan_problems(match_plan(open_end, {"down": "colwise"}, USER_SOURCE), open_end,
                         (8,), 2) == []  # the model's output: gathered, not a stretch
    only_down = match_plan(lm, {"blocks.*.fc2": "rowwise"}, USER_SOURCE)
    assert ("blocks.0.fc2 (Linear) is rowwise but no colwise module before it splits its input "
            "features") in plan_problems(only_down, lm, (T,), 2)
    assert plan_problems(match_plan(lm, plan_models.BLOCK_PLAN, USER_SOURCE), lm, (T,), 2) == []


def test_gathered_outputs_and_split_inputs_read_whole_features_and_nothing_else() -> None:
    # the norm that reads split features under colwise/rowwise reads whole ones once the
    # projection's output is gathered, and the next projection takes its own features from them
    model = NormBetween()
    gathered = match_plan(model, {"up": "colwise_gather_output", "down": "rowwise_split_input"},
                          USER_SOURCE)
    assert plan_problems(gathered, model, (8,), 2) == []
    relu_between = nn.Sequential()
    relu_between.up, relu_between.act, relu_between.down = nn.Linear(8, 16), nn.ReLU(), \
        nn.Linear(16, 4)
    for styles, reader in (({"up": "colwise", "down": "rowwise_split_input"}, "down"),
                           ({"up": "colwise", "down": "colwise_gather_output"}, "down")):
        plan = match_plan(relu_between, styles, USER_SOURCE)
        assert plan_problems(plan, relu_between, (8,), 2) == [
            f"{reader} (Linear) runs on the features up split over the model group before a "
            f"rowwise module sums them: plan it too, or end the split before it"], styles
    # the transformers library's styles gridrun does not run are named, the library's name given
    declared = NormBetween()
    declared.config = type("Config", (), {"base_model_tp_plan": {"up": "packed_colwise"}})()
    plan = module_plan(declared, {}, (8,), 2)
    assert plan is not None and plan.given_problems == [
        "the model's declared plan: up: packed_colwise is not a style gridrun runs (one of "
        "colwise, rowwise, fused_qkv, colwise_gather_output, rowwise_split_input, vocab, "
        "sequence, replicate); give strategy.plan instead"]


def test_a_forward_that_reshapes_by_the_whole_width_is_refused_before_any_rank_starts() -> None:
    from tests.corpus_models import ViTTiny

    torch.manual_seed(0)
    vit = ViTTiny((3, 8, 8), 4)
    plan = match_plan(vit, {"blocks.*.attn.qkv": "fused_qkv", "blocks.*.attn.proj": "rowwise",
                            "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"},
                      USER_SOURCE)
    [problem] = plan_problems(plan, vit, (3, 8, 8), 2)
    assert problem.startswith("blocks.0.attn (Attention) cannot run on one rank's features "
                              "under the plan: "), problem
    # the model is left as it was: the check ran on a copy
    assert isinstance(vit.blocks[0].attn.qkv, nn.Linear) and vit.blocks[0].attn.heads == 2


class _ActBatchNorm(nn.BatchNorm1d):
    """timm's BatchNormAct-like: a BatchNorm whose forward adds an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


def test_a_batch_norm_with_its_own_forward_is_refused_where_a_batch_group_holds_part_of_the_batch(
        ) -> None:
    model = plan_models.NormedClassifier(VOCAB, 4)
    model.norm = _ActBatchNorm(16)
    plan = match_plan(model, plan_models.NORMED_PLAN, USER_SOURCE)
    assert plan_problems(plan, model, (T,), 2, pc=1) == []
    [problem] = plan_problems(plan, model, (T,), 2, pc=2)
    assert problem.startswith("norm (_ActBatchNorm): a BatchNorm with a forward of its own "
                              "would normalise by one batch group's rows"), problem


LLAMA_BLOCKS_PLAN = {"model.layers.*.self_attn.q_proj": "colwise",
                     "model.layers.*.self_attn.k_proj": "colwise",
                     "model.layers.*.self_attn.v_proj": "colwise",
                     "model.layers.*.self_attn.o_proj": "rowwise",
                     "model.layers.*.mlp.gate_proj": "colwise",
                     "model.layers.*.mlp.up_proj": "colwise",
                     "model.layers.*.mlp.down_proj": "rowwise"}


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_grouped_query_attention_holds_key_values_whole_where_ranks_outnumber_their_heads(
        ) -> None:
    from strategies.plans.module_plan import adjustments, gathered_path

    llama = plan_models.hf_llama(VOCAB, (T,))  # 4 query heads, 2 key/value heads
    two = module_plan(llama, LLAMA_BLOCKS_PLAN, (T,), 2)
    assert two is not None and two.layouts["model.layers.0.self_attn.k_proj"] == "colwise"
    four = module_plan(llama, LLAMA_BLOCKS_PLAN, (T,), 4)
    assert four is not None
    assert four.layouts["model.layers.0.self_attn.k_proj"] == "kv_replicated"
    assert four.layouts["model.layers.1.self_attn.v_proj"] == "kv_replicated"
    assert four.layouts["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan_problems(four, llama, (T,), 4) == []
    changes, _ = adjustments(four, llama, 4, gathered_path(four, llama, (T,)))
    assert "adjusted model.layers.0.self_attn.num_key_value_groups 2 → 1" in map(str, changes)
    # the ranks 0, 1 read key/value head 0; ranks 2, 3 head 1
    style = four.styles["model.layers.0.self_attn.k_proj"]
    assert [style.head_rows(4, r).start for r in range(4)] == [0, 0, 4, 4]  # type: ignore[attr-defined]


# -- the sequence style (Megatron-LM's sequence parallelism) -------------------------------------

BLOCK_SEQUENCE_PLAN = {**plan_models.BLOCK_PLAN, "blocks.*.norm?": "sequence"}


class DroppingBlockLM(plan_models.UserBlockLM):
    """`UserBlockLM` whose blocks drop out their attention's output at `p`."""

    def __init__(self, p: float) -> None:
        super().__init__(VOCAB, (T,))
        for block in self.blocks:
            block.drop = nn.Dropout(p)
            block.forward = self._forward(block)  # type: ignore[method-assign]

    @staticmethod
    def _forward(block: nn.Module):  # type: ignore[no-untyped-def]
        def forward(x: torch.Tensor) -> torch.Tensor:
            x = x + block.drop(block.attn(block.norm1(x)))
            return x + block.fc2(torch.nn.functional.gelu(block.fc1(block.norm2(x))))
        return forward


def test_a_sequence_plan_splits_the_blocks_and_prices_its_exchanges() -> None:
    from runner.core import GridShape
    from strategies.plans.module_plan import predict_plan_ops
    from strategies.plans.sequence_parallel import sequence_layout

    lm = block_lm()
    plan = match_plan(lm, {**BLOCK_SEQUENCE_PLAN, "norm": "sequence"}, USER_SOURCE)
    assert plan_problems(plan, lm, (T,), 2) == []
    assert plan.layouts["blocks.0.norm1"] == "sequence"
    layout, problems = sequence_layout(plan.styles, lm, (T,), 2)
    assert problems == [] and layout is not None
    # one run of both blocks; the attention gathered at its entry, the MLP at fc1's input; the
    # final norm outside every block runs on the whole sequence
    assert (layout.entries, list(layout.exits)) == (["blocks.0"], ["blocks.1"])
    assert layout.gathers == ["blocks.0.attn", "blocks.0.fc1", "blocks.1.attn", "blocks.1.fc1"]
    assert layout.sharded == {"blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1",
                              "blocks.1.norm2"}
    ops = predict_plan_ops(lm, plan, (T,), GridShape(2, 1), 4, (4000, 1000))
    whole = 4 * T * 16 * 4  # 4 rows of (T, 16) float32
    # the rowwise projections', the gathered inputs', the region's exit (the head's aside)
    scattered = [op for op in ops if op.op == "reduce_scatter" and op.layer != "head out"]
    assert len(scattered) == 4 + 4 + 1 and {op.nbytes for op in scattered} == {whole}
    assert not any(op.op == "allreduce" and op.layer.startswith("blocks") for op in ops)


def test_a_module_that_mixes_positions_is_refused_as_sequence() -> None:
    lm = block_lm()
    plan = match_plan(lm, {"blocks.0.fc1": "colwise", "blocks.0.fc2": "rowwise",
                           "blocks.*.norm?": "sequence", "blocks.0.attn": "sequence"},
                      USER_SOURCE)
    assert plan_problems(plan, lm, (T,), 2) == [
        "blocks.0.attn (HeadsAttention): HeadsAttention mixes positions (attention, a "
        "convolution or pooling over the sequence, a recurrence, batch statistics): it cannot "
        "run on a rank's piece of the sequence"]
    from strategies.plans.styles import STYLES

    assert STYLES["sequence"].problems("rnn", nn.GRU(4, 4), 2)[0].startswith(
        "rnn (GRU): GRU mixes positions")


def test_a_sequence_that_does_not_divide_is_refused() -> None:
    torch.manual_seed(0)
    lm = plan_models.UserBlockLM(VOCAB, (7,))
    plan = match_plan(lm, BLOCK_SEQUENCE_PLAN, USER_SOURCE)
    assert plan_problems(plan, lm, (7,), 2) == [
        "blocks.0 (UserBlock): its sequence of 7 positions does not divide over grid.pr=2 "
        "ranks (sequence splits it evenly)"]


def test_sequence_without_a_colwise_rowwise_pair_is_refused() -> None:
    lm = block_lm()
    plan = match_plan(lm, {"blocks.*.norm?": "sequence"}, USER_SOURCE)
    assert plan_problems(plan, lm, (T,), 2) == [
        "blocks.0.norm1, blocks.0.norm2, blocks.1.norm1, blocks.1.norm2: sequence splits the "
        "positions of a block holding a colwise/rowwise pair of the plan (whose projections "
        "gather the sequence), and no module holding them has one"]


def test_dropout_that_draws_in_the_region_is_refused() -> None:
    lm = DroppingBlockLM(0.1)
    plan = match_plan(lm, BLOCK_SEQUENCE_PLAN, USER_SOURCE)
    problems = plan_problems(plan, lm, (T,), 2)
    assert problems[0] == (
        "blocks.0.drop (Dropout) in blocks.0: Dropout with p=0.1 on a piece of the sequence: "
        "each rank would draw its own masks, and gridrun runs one process's draws; use p=0"), \
        problems
    marked = match_plan(lm, {**BLOCK_SEQUENCE_PLAN, "blocks.*.drop": "sequence"}, USER_SOURCE)
    assert plan_problems(marked, lm, (T,), 2)[0].startswith(
        "blocks.0.drop (Dropout): Dropout with p=0.1 on a piece of the sequence")
    quiet = DroppingBlockLM(0.0)
    assert plan_problems(match_plan(quiet, BLOCK_SEQUENCE_PLAN, USER_SOURCE), quiet, (T,),
                         2) == []


def test_an_unmarked_module_with_weights_in_the_region_or_a_sequence_one_between_a_pair_is_refused(
        ) -> None:
    lm = block_lm()
    plan = match_plan(lm, {**plan_models.BLOCK_PLAN, "blocks.*.norm1": "sequence"}, USER_SOURCE)
    assert plan_problems(plan, lm, (T,), 2) == [
        f"blocks.{i}.norm2 (LayerNorm) in blocks.{i}: it runs on a rank's piece of the sequence "
        f"in the region but is not marked: mark it sequence if it acts token by token, or plan "
        f"it" for i in (0, 1)]
    between = plan_models.UserBlockLM(VOCAB, (T,))
    between.blocks[0].fc1 = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32))
    plan = match_plan(between, {"blocks.0.fc1.0": "colwise", "blocks.0.fc1.1": "sequence",
                                "blocks.0.fc2": "rowwise", "blocks.0.norm2": "sequence"},
                      USER_SOURCE)
    assert plan_problems(plan, between, (T,), 2)[0].startswith(
        "blocks.0.fc1.1 (LayerNorm) runs on the features blocks.0.fc1.0 split over the model "
        "group before a rowwise module sums them")


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_llamas_final_norm_as_sequence_runs_after_the_region() -> None:
    from runner.core import GridShape
    from runner.cost.compute import DEFAULT_RATES
    from strategies.plans.costs import plan_compute_seconds
    from strategies.plans.sequence_parallel import sequence_layout

    llama = plan_models.hf_llama(VOCAB, (T,))
    given = {**LLAMA_BLOCKS_PLAN, "model.layers.*.*_layernorm": "sequence",
             "model.norm": "sequence"}
    plan = match_plan(llama, given, USER_SOURCE)
    assert plan_problems(plan, llama, (T,), 2) == []
    layout, _ = sequence_layout(plan.styles, llama, (T,), 2)
    assert layout is not None and "model.norm" not in layout.sharded
    assert layout.gathers == [f"model.layers.{i}.{m}" for i in (0, 1)
                              for m in ("self_attn", "mlp")]
    rates = DEFAULT_RATES
    plain = match_plan(llama, LLAMA_BLOCKS_PLAN, USER_SOURCE)
    assert (plan_compute_seconds(llama, plan, (T,), GridShape(2, 1), 8, rates)
            < plan_compute_seconds(llama, plain, (T,), GridShape(2, 1), 8, rates))


# -- strategy=domain with a plan: the sequence split, every weight whole -------------------------

BLOCK_DOMAIN_PLAN = {"blocks.*.norm?": "sequence", "blocks.*.fc?": "sequence"}


def _domain_problems(model: nn.Module, plan: dict[str, str], length: int = T,
                     pr: int = 2) -> list[str]:
    problems: list[str] = STRATEGIES.get("domain")(plan=plan).check_model(
        model, (length,), _shape(pr))
    return problems


def test_a_domain_plan_runs_the_attention_whole_and_the_token_wise_modules_on_pieces() -> None:
    from runner.cost.collectives import DEFAULT_COSTS
    from runner.plan.planner import make_plan
    from strategies import PricingContext
    from strategies.plans.module_plan import domain_plan, plan_region, predict_plan_ops

    lm = block_lm()
    given = {**BLOCK_DOMAIN_PLAN, "norm": "sequence"}
    assert _domain_problems(lm, given) == []
    plan = domain_plan(lm, given)
    assert plan is not None and plan.whole_weights
    layout, problems = plan_region(plan, lm, (T,), 2)
    assert problems == [] and layout is not None
    # one run of both blocks; each attention gathered at its entry, its output's piece taken
    # at its exit; the norms and the MLP's Linears on a rank's positions; the final norm,
    # outside every block, on the whole sequence after the region
    assert (layout.entries, list(layout.exits)) == (["blocks.0"], ["blocks.1"])
    assert layout.gathers == layout.takes == ["blocks.0.attn", "blocks.1.attn"]
    assert layout.sharded == {f"blocks.{i}.{m}" for i in (0, 1)
                              for m in ("norm1", "norm2", "fc1", "fc2")}
    assert "norm" not in layout.on_pieces and "blocks.0" in layout.on_pieces
    ops = predict_plan_ops(lm, plan, (T,), _shape(2), 4, (4000, 1000))
    whole = 4 * T * 16 * 4  # 4 rows of (T, 16) float32
    on_model_group = [op for op in ops if op.group == "model"]
    assert sorted(op.op for op in on_model_group) == ["allgather"] * 3 + ["reduce_scatter"] * 3
    assert {op.nbytes for op in on_model_group} == {whole}
    # every weight whole: the gradients summed over every rank, none over a batch group
    assert {op.group for op in ops} == {"model", "world"}
    domain = STRATEGIES.get("domain")(plan=given, pricing=PricingContext(global_batch=8))
    assert domain.predict_param_bytes(lm, (T,), _shape(2)) == sum(
        p.numel() * p.element_size() for p in lm.parameters())
    # the token-wise modules on half the positions, the attention whole
    one, two = (domain.predict_compute_seconds(lm, (T,), _shape(pr), 8) for pr in (1, 2))
    assert one / 2 < two < one
    row = next(r for r in make_plan(lm, (T,), 8, 2, {"domain": domain}, DEFAULT_COSTS).rows
               if (r.pr, r.pc) == (2, 1))
    assert row.plan_source == USER_SOURCE and row.plan_modules is not None
    assert {style for _, style, _ in row.plan_modules} == {"sequence"}


def test_a_style_that_splits_weights_is_refused_under_domain() -> None:
    assert _domain_problems(block_lm(), {**BLOCK_DOMAIN_PLAN, "blocks.*.attn.qkv": "fused_qkv",
                                         "head": "colwise"}) == [
        f"strategy=domain: {path} (Linear): {style} splits weights; strategy=domain keeps "
        f"every weight whole (its styles: sequence, replicate): use strategy=grid"
        for path, style in (("blocks.0.attn.qkv", "fused_qkv"),
                            ("blocks.1.attn.qkv", "fused_qkv"), ("head", "colwise"))]


def test_a_domain_plan_without_a_sequence_module_in_a_block_is_refused() -> None:
    assert _domain_problems(block_lm(), {"blocks.*.fc1": "replicate"}) == [
        "strategy=domain: strategy.plan marks no module sequence: strategy=domain splits each "
        "sample's sequence over grid.pr in the blocks holding sequence modules; mark the "
        "modules acting token by token (norms, MLPs) sequence"]
    assert _domain_problems(block_lm(), {"norm": "sequence"}) == [
        "strategy=domain: norm: sequence splits the positions inside a block (a module "
        "holding sequence modules, not the model), and the model itself holds it"]


def test_a_domain_sequence_that_does_not_divide_is_refused() -> None:
    torch.manual_seed(0)
    assert _domain_problems(plan_models.UserBlockLM(VOCAB, (7,)), BLOCK_DOMAIN_PLAN, 7) == [
        "strategy=domain: blocks.0 (UserBlock): its sequence of 7 positions does not divide "
        "over grid.pr=2 ranks (sequence splits it evenly)"]


def test_a_module_that_mixes_positions_is_refused_as_sequence_under_domain() -> None:
    assert _domain_problems(block_lm(), {**BLOCK_DOMAIN_PLAN, "blocks.0.attn": "sequence"}) == [
        "strategy=domain: blocks.0.attn (HeadsAttention): HeadsAttention mixes positions "
        "(attention, a convolution or pooling over the sequence, a recurrence, batch "
        "statistics): it cannot run on a rank's piece of the sequence"]


def test_dropout_that_draws_in_a_domain_region_is_refused() -> None:
    problems = _domain_problems(DroppingBlockLM(0.1), BLOCK_DOMAIN_PLAN)
    assert problems[0] == (
        "strategy=domain: blocks.0.drop (Dropout): Dropout with p=0.1 in the sequence region: "
        "each rank would draw its own masks, and gridrun runs one process's draws; use p=0 "
        "(in blocks.0)"), problems
    assert _domain_problems(DroppingBlockLM(0.0), BLOCK_DOMAIN_PLAN) == []


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_llamas_whole_mlp_runs_on_a_ranks_positions_under_domain() -> None:
    from strategies.plans.module_plan import domain_plan, plan_region

    llama = plan_models.hf_llama(VOCAB, (T,))
    given = {"model.layers.*.*_layernorm": "sequence", "model.layers.*.mlp": "sequence",
             "model.norm": "sequence"}
    assert _domain_problems(llama, given) == []
    plan = domain_plan(llama, given)
    assert plan is not None
    layout, _ = plan_region(plan, llama, (T,), 2)
    assert layout is not None and layout.takes == ["model.layers.0.self_attn",
                                                   "model.layers.1.self_attn"]
    assert "model.layers.1.mlp.down_proj" in layout.sharded
    assert _domain_problems(llama, {**given, "model.layers.0.self_attn": "sequence"})[0] == (
        "strategy=domain: model.layers.0.self_attn (LlamaAttention): LlamaAttention mixes "
        "positions (attention, a convolution or pooling over the sequence, a recurrence, batch "
        "statistics): it cannot run on a rank's piece of the sequence")


def test_a_domain_plan_on_the_command_line_is_validated_before_any_rank_starts() -> None:
    from runner.cli.compose import compose
    from runner.cli.validation import validate
    from runner.config.schema import ConfigError

    domain = [*COMMON, "strategy=domain", "grid.pr=2", "grid.pc=1"]
    run = validate(compose([*domain, "strategy.plan={blocks.*.norm?: sequence, "
                                     "blocks.*.fc?: sequence}"]), world_size=2)
    assert run.strategy.options["plan"] == BLOCK_DOMAIN_PLAN
    with pytest.raises(ConfigError, match=r"^strategy=domain: head \(Linear\): colwise splits "
                                          r"weights; .*: use strategy=grid$"):
        validate(compose([*domain, "strategy.plan={blocks.*.norm?: sequence, head: colwise}"]),
                 world_size=2)


# The transformers library's Llama named by its class, its configuration's fields as options
LLAMA_BY_CLASS = ["model._target_=transformers.LlamaForCausalLM", "model.hidden_size=16",
                  "model.num_hidden_layers=2", "model.num_attention_heads=4",
                  "model.num_key_value_heads=2", "model.intermediate_size=32",
                  "model.max_position_embeddings=16", "dataset=tokens", "dataset.vocab_size=64",
                  "dataset.seq_len=8", "dataset.samples=64", "trainer.steps=3",
                  "trainer.batch_size=8", "trainer.eval_every=null"]


# Phi-3's declared plan gathers its fused projections' outputs and splits its readers' inputs
PHI3_BY_CLASS = ["model._target_=transformers.Phi3ForCausalLM",
                 *LLAMA_BY_CLASS[1:7], "model.pad_token_id=null", "model.bos_token_id=0",
                 "model.eos_token_id=0", *LLAMA_BY_CLASS[7:]]


# Gemma's head is tied to its token table: the two split by vocabulary together
GEMMA_BY_CLASS = ["model._target_=transformers.GemmaForCausalLM", *LLAMA_BY_CLASS[1:7],
                  "model.head_dim=4", *LLAMA_BY_CLASS[7:]]


def test_a_transformers_class_named_on_the_command_line_trains_split_by_its_declared_plan(
        tmp_path: Path) -> None:
    # with dropout drawn as one process draws it: Llama's attention dropout over a rank's heads
    # (its grid run in two micro-batches a step), Phi-3's over whole hidden states and heads
    models = {"llama": [*LLAMA_BY_CLASS, "model.attention_dropout=0.5"],
              "phi3": [*PHI3_BY_CLASS, "model.attention_dropout=0.5", "model.resid_pdrop=0.5",
                       "model.embd_pdrop=0.5"],
              "gemma": GEMMA_BY_CLASS}
    runs = {"grid": ["strategy=grid", "grid.pr=2", "grid.pc=2"],
            "fsdp": ["strategy=fsdp", "grid.pr=2", "grid.pc=2"],
            "one": ["strategy=data", "grid.pr=1", "grid.pc=1"]}
    split = {"llama": ["grid"], "phi3": ["grid"], "gemma": ["grid", "fsdp"]}
    jobs = [[*overrides, *runs[run], f"hydra.run.dir={tmp_path / name / run}",
             *(["trainer.accumulate_steps=2"] if (name, run) == ("llama", "grid") else [])]
            for name, overrides in models.items() for run in [*split[name], "one"]]
    for result in run_cli_together(*jobs):
        assert_ok(result)
    for name in models:
        one = train_losses(tmp_path / name / "one")
        for run in split[name]:
            losses = train_losses(tmp_path / name / run)
            assert len(one) == len(losses) == 3
            # float32 (the library's RMSNorm computes in float32 whatever the model's dtype);
            # dropout 0.5 moves these losses by ~1e-3: other masks could not pass
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, one, strict=True)) <= 1e-6, \
                (name, run, losses, one)
            summary = read_summary(tmp_path / name / run)
            assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"]
            assert summary["plan_source"] == "the model's declared plan"
    layouts = read_summary(tmp_path / "llama" / "grid")["layouts"]
    assert layouts["model.layers.0.self_attn.q_proj"] == "colwise"
    assert layouts["model.layers.1.mlp.down_proj"] == "rowwise"
    layouts = read_summary(tmp_path / "phi3" / "grid")["layouts"]
    assert layouts["model.layers.0.self_attn.qkv_proj"] == "colwise_gather_output"
    assert layouts["model.layers.1.mlp.down_proj"] == "rowwise_split_input"
    layouts = read_summary(tmp_path / "gemma" / "grid")["layouts"]
    assert layouts["model.embed_tokens"] == "vocab"
    assert layouts["lm_head"] == "colwise_gather_output"
