"""Plans derived from the module structure (strategies/plans/derive.py, through
`module_plan.module_plan`): which modules of the tiny models of tests/plan_models.py (their
declared plans removed) and of the conformance corpus get which style, what the trial in one
process leaves out, and what auto and the planner say of a derived plan."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.core import GridShape
from strategies import STRATEGIES, PricingContext
from strategies.plans.module_plan import DERIVED_SOURCE, derived_plan, module_plan
from strategies.probe import reads_tokens
from tests import corpus_models as corpus
from tests import plan_models

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
VOCAB, T = 50, 8


def tokens_model(model: nn.Module) -> nn.Module:
    reads_tokens(model)
    return model


def without_declared_plan(model: nn.Module) -> nn.Module:
    """`model` with neither its config's plan nor its class's head plan: its class swapped for
    a subclass without one (the library's class, which other tests read, is left alone)."""
    model.config.base_model_tp_plan = None  # type: ignore[union-attr]
    model._tp_plan = {}  # the instance's
    model.__class__ = type(type(model).__name__, (type(model),), {"_tp_plan": None})
    return tokens_model(model)


def test_a_users_block_gets_its_embedding_attention_and_mlp_split() -> None:
    torch.manual_seed(0)
    model = tokens_model(plan_models.UserBlockLM(VOCAB, (T,)))
    plan = module_plan(model, {}, (T,), 2)
    assert plan is not None and plan.source == DERIVED_SOURCE
    expected = {"embed": "vocab"}
    for i in range(2):
        expected |= {f"blocks.{i}.attn.qkv": "fused_qkv", f"blocks.{i}.attn.out": "rowwise",
                     f"blocks.{i}.fc1": "colwise", f"blocks.{i}.fc2": "rowwise"}
    assert plan.layouts == expected
    # the head is the model's output: no derived plan splits it; 50 rows do not divide by 4
    four = derived_plan(model, (T,), 4)
    assert four is not None and "embed" not in four.layouts and "head" not in four.layouts
    # the user's and the model's own plans come first; one rank has nothing to split
    given = module_plan(model, {"blocks.*.fc1": "colwise"}, (T,), 2)
    assert given is not None and given.source != DERIVED_SOURCE
    assert derived_plan(model, (T,), 1) is None
    assert module_plan(model, {}) is None  # without shapes and ranks, nothing is derived


def test_an_unknown_head_attribute_leaves_the_attention_whole() -> None:
    model = tokens_model(plan_models.FixedHeadsLM(VOCAB, (T,)))
    plan = derived_plan(model, (T,), 2)
    assert plan is not None
    assert not any("attn" in path for path in plan.layouts), plan.layouts
    assert plan.layouts["blocks.0.fc1"] == "colwise"


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_llamas_gated_mlp_and_grouped_attention_are_derived() -> None:
    llama = without_declared_plan(plan_models.hf_llama(VOCAB, (T,)))
    plan = module_plan(llama, {}, (T,), 2)
    assert plan is not None and plan.source == DERIVED_SOURCE
    layer = "model.layers.0."
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        assert plan.layouts[layer + name] == "colwise", name
    assert plan.layouts[layer + "self_attn.o_proj"] == "rowwise"
    assert plan.layouts[layer + "mlp.down_proj"] == "rowwise"
    assert plan.layouts["model.embed_tokens"] == "vocab"
    assert "lm_head" not in plan.layouts
    # 2 key/value heads do not divide over 4 ranks: the attention stays whole, the MLP splits
    four = derived_plan(llama, (T,), 4)
    assert four is not None and layer + "self_attn.q_proj" not in four.layouts
    assert four.layouts[layer + "mlp.down_proj"] == "rowwise"


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_gpt2_and_bert_get_the_plans_the_tests_give_them() -> None:
    gpt2 = tokens_model(plan_models.hf_gpt2(VOCAB, (T,)))
    plan = derived_plan(gpt2, (T,), 2)
    assert plan is not None
    given = module_plan(gpt2, plan_models.GPT2_PLAN)
    assert given is not None and plan.layouts == given.layouts  # its tied embedding stays whole
    bert = tokens_model(plan_models.hf_bert(VOCAB, 4, (T,)))
    plan = derived_plan(bert, (T,), 2)
    given = module_plan(bert, plan_models.BERT_PLAN)
    assert plan is not None and given is not None and plan.layouts == given.layouts


def test_the_corpus_models_get_what_is_safe_and_nothing_else() -> None:
    image = (3, 8, 8)
    vit = corpus.ViTTiny(image, 4)
    plan = derived_plan(vit, image, 2)
    # timm's attention reshapes to its input's width (`reshape(b, n, c)`): left whole
    assert plan is not None and plan.layouts == {
        "blocks.0.mlp.fc1": "colwise", "blocks.0.mlp.fc2": "rowwise",
        "blocks.1.mlp.fc1": "colwise", "blocks.1.mlp.fc2": "rowwise"}
    convnext = derived_plan(corpus.ConvNeXtBlock(image, 4), image, 2)
    assert convnext is not None
    assert convnext.layouts == {"pwconv1": "colwise", "pwconv2": "rowwise"}
    tied = derived_plan(tokens_model(corpus.TiedTokenLM(VOCAB, (T,))), (T,), 2)
    assert tied is not None and "embed" not in tied.layouts  # tied to the head
    classifier = derived_plan(tokens_model(corpus.TokenClassifier(VOCAB, 4)), (T,), 2)
    assert classifier is not None and classifier.layouts == {"embed": "vocab"}
    # 16 → 32 → 4 restores no width; BatchNorms see a batch group's rows only
    for model in (corpus.SqueezeExcite(image, 4), corpus.DepthwiseSeparable(image, 4),
                  corpus.StochasticDepth(image, 4)):
        assert derived_plan(model, image, 2) is None, type(model).__name__


class InterleavedAttention(nn.Module):
    """A fused projection whose heads interleave q, k and v (BLOOM's layout): its shapes fit
    `fused_qkv`, its values do not."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, t, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class SideOutputMLP(nn.Module):
    """An MLP whose hidden activation is also added to the output (read elsewhere)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc1(x))
        return self.fc2(hidden) + hidden[..., :x.shape[-1]]


def test_the_trial_leaves_out_what_shapes_alone_would_split_wrongly() -> None:
    torch.manual_seed(0)
    for block in (InterleavedAttention(), SideOutputMLP()):
        model = nn.Sequential(block, nn.Linear(16, 4))
        assert derived_plan(model, (T, 16), 2) is None, type(block).__name__
    # the same attention with q, k and v in chunks splits
    good = nn.Sequential(plan_models.HeadsAttention(16, 4), nn.Linear(16, 4))
    plan = derived_plan(good, (T, 16), 2)
    assert plan is not None and plan.layouts == {"0.qkv": "fused_qkv", "0.out": "rowwise"}


def test_a_model_on_the_meta_device_gets_the_plan_a_real_one_gets() -> None:
    real = tokens_model(plan_models.UserBlockLM(VOCAB, (T,)))
    with torch.device("meta"):
        meta = tokens_model(plan_models.UserBlockLM(VOCAB, (T,)))
    assert next(meta.parameters()).is_meta
    got, want = derived_plan(meta, (T,), 2), derived_plan(real, (T,), 2)
    assert got is not None and want is not None and got.layouts == want.layouts


def test_a_sequential_keeps_its_layer_plan() -> None:
    mlp = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 4))
    assert derived_plan(mlp, (8,), 2) is not None  # the structure has an MLP
    assert STRATEGIES.get("grid")().module_plan(mlp, (8,), 2) is None  # grid's own plan runs


def test_planned_compute_is_the_local_shapes_and_the_planner_lists_the_plan() -> None:
    from runner.cost.collectives import DEFAULT_COSTS
    from runner.plan.planner import make_plan

    model = tokens_model(plan_models.UserBlockLM(VOCAB, (T,)))
    grid = STRATEGIES.get("grid")(pricing=PricingContext(global_batch=16))
    one = grid.predict_compute_seconds(model, (T,), GridShape(1, 2), 16)  # nothing derived
    two = grid.predict_compute_seconds(model, (T,), GridShape(2, 1), 16)
    assert grid.module_plan(model, (T,), 2) is not None
    # 2 x 1 runs all 16 rows with half of each split projection; 1 x 2 runs 8 rows whole
    assert one < two < 2 * one
    plan = make_plan(model, (T,), 16, 4, {"grid": grid}, DEFAULT_COSTS)
    row = next(r for r in plan.rows if (r.pr, r.pc) == (2, 2))
    assert row.plan_source == DERIVED_SOURCE and row.plan_modules is not None
    styles = {path: style for path, style, _ in row.plan_modules}
    assert styles["blocks.0.attn.qkv"] == "fused_qkv" and styles["embed"] == "vocab"
    assert sum(n for _, _, n in row.plan_modules) <= row.comm_bytes
    assert all(n > 0 for path, style, n in row.plan_modules if style in ("rowwise", "vocab"))


def test_auto_names_its_choice_and_every_candidates_predicted_step() -> None:
    model = tokens_model(plan_models.UserBlockLM(VOCAB, (T,)))
    auto = STRATEGIES.get("auto")(pricing=PricingContext(global_batch=16))
    assert auto.check_model(model, (T,), GridShape(2, 2)) == []
    _, label, why = auto.tree_choice(model, (T,), GridShape(2, 2), 16)
    assert label == "grid by the plan derived from the module structure"
    assert why.startswith(label + ": ") and "ms predicted per step, the fastest" in why
    assert auto.describe_plan(model, (T,), GridShape(2, 2), 16) == {"(whole model)": label}
    # at 2 x 1 model and grid by the plan compete (torch.fx cannot trace the block)
    _, _, why = auto.tree_choice(model, (T,), GridShape(2, 1), 16)
    assert "model by the plan" in why and "grid by the plan" in why


class _DropoutMLP(nn.Module):
    """An MLP a derived plan splits, with a dropout that would draw per rank under it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.fc2(torch.relu(self.fc1(x)))))


def test_auto_keeps_plans_whose_dropout_draws_as_one_process() -> None:
    from runner.core import GridShape
    from strategies import STRATEGIES, PricingContext

    torch.manual_seed(0)
    model = _DropoutMLP()
    auto = STRATEGIES.get("auto")(pricing=PricingContext(global_batch=8))
    # a planned model draws each row's masks by its place in the global batch (a rank of a
    # model group its piece of a split tensor's): the candidates by plan stay in
    assert auto.check_model(model, (8,), GridShape(2, 2)) == []
    grid = STRATEGIES.get("grid")()
    assert grid.reproduces_random_draws(model, (8,), GridShape(2, 2))
    assert grid.draws_rows_alike(model, (8,), GridShape(2, 2))
    assert auto.check_model(model, (8,), GridShape(1, 2)) == []
