"""A plan's output projection split by vocabulary or classes (`vocab` on the model's head,
strategies/layers/vocab_head.py), in process: what is refused and why, what the model's declared
plan
keeps, the collectives predicted for its loss, and its score on one rank. Against one process
on 4 ranks: tests/mpi/check_plan_vocab.py."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.core import GridShape, ProcessGrid
from strategies import STRATEGIES
from strategies.base import cross_entropy_score
from strategies.layers.vocab_head import returns_logits_of, split_loss_ops
from strategies.plans.module_plan import PlannedModel, VocabScoredModel
from tests import plan_models

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
VOCAB, T = 50, 8


def block_lm() -> plan_models.UserBlockLM:
    torch.manual_seed(0)
    return plan_models.UserBlockLM(VOCAB, (T,))


class LogProbsLM(plan_models.UserBlockLM):
    """Returns log-probabilities: a softmax over the vocabulary after its head."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(super().forward(tokens), dim=-1)


def problems(model: nn.Module, plan: dict[str, str], pr: int = 2) -> list[str]:
    return STRATEGIES.get("model")(plan=plan).check_model(model, (T,), GridShape(pr, 1))


def test_a_vocab_projection_that_is_not_the_models_output_is_refused() -> None:
    assert problems(block_lm(), {"blocks.0.fc1": "vocab"}) == [
        "strategy=model: blocks.0.fc1 (Linear): vocab splits a projection only where its "
        "output is the model's output (its logits are scored split); plan it colwise"]


def test_a_head_whose_logits_go_through_a_softmax_is_refused() -> None:
    torch.manual_seed(0)
    model = LogProbsLM(VOCAB, (T,))
    assert not returns_logits_of(model, model.head, (T,))
    plain = block_lm()
    assert returns_logits_of(plain, plain.head, (T,))
    assert problems(model, {"head": "vocab"}) == [
        "strategy=model: head (Linear): vocab splits a projection only where its output is "
        "the model's output (its logits are scored split); plan it colwise"]


def test_a_vocabulary_that_does_not_divide_is_refused() -> None:
    assert problems(block_lm(), {"head": "vocab"}, pr=3) == [
        "strategy=model: head (Linear): its 50 vocabulary rows (output features) do not "
        "divide over grid.pr=3 ranks"]


def test_a_vocab_head_tied_to_the_embedding_takes_the_table_along() -> None:
    # its rows split with the head's (tests/mpi/check_plans.py: GPT-2 as one process)
    model = block_lm()
    model.head.weight = model.embed.weight
    assert problems(model, {"head": "vocab"}) == []
    # a table tied to a head split by its input features cannot be: named
    model.head.weight = model.embed.weight
    assert problems(model, {"embed": "vocab", "head": "rowwise"})[0].startswith(
        "strategy=model: embed (Embedding): its weights are shared with head (tied): a plan "
        "splits a tied weight only by its vocabulary rows")


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_gpt2s_tied_head_splits_its_table_by_vocabulary_too() -> None:
    gpt2 = plan_models.hf_gpt2(VOCAB, (T,))
    assert problems(gpt2, {**plan_models.GPT2_PLAN, "lm_head": "vocab"}) == []


def test_a_module_vocab_cannot_split_is_named() -> None:
    assert problems(block_lm(), {"norm": "vocab"}) == [
        "strategy=model: norm (LayerNorm): vocab splits an nn.Embedding, or the model's "
        "output Linear or Conv1D"]


def test_the_loss_moves_two_numbers_a_token_gathered_and_one_gradient_summed() -> None:
    strategy = STRATEGIES.get("grid")(plan={"head": "vocab"})
    ops = strategy.predict_ops(block_lm(), (T,), GridShape(2, 2), 8)
    tokens = 4 * T  # a batch group's rows
    loss = [op.key for op in ops if op.layer == "head loss"]
    assert loss == [("allgather", "model", 2, 2 * 2 * tokens * 4),
                    ("allreduce", "model", 2, tokens * 4)]
    assert not [op for op in ops if op.layer == "head out"]  # nothing gathered
    gathered = STRATEGIES.get("grid")(plan={"head": "colwise"}).predict_ops(
        block_lm(), (T,), GridShape(2, 2), 8)
    assert Counter(op.layer for op in gathered)["head out"] == 2
    # the loss of float16 logits computes in float32; one rank moves nothing
    assert split_loss_ops(10, 2, 2)[1].nbytes == 10 * 4
    assert split_loss_ops(10, 1, 8) == []


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_llamas_declared_plan_keeps_gathering_and_a_users_plan_splits_the_loss() -> None:
    grid = ProcessGrid(1, 1)
    strategy = STRATEGIES.get("model")()
    declared = strategy.parallelize(plan_models.hf_llama(VOCAB, (T,)), (T,), grid)
    assert type(declared) is PlannedModel and declared.layouts["lm_head"] == "colwise_gather_output"
    plan = {"model.layers.*.mlp.up_proj": "colwise", "lm_head": "vocab"}
    given = STRATEGIES.get("model")(plan=plan).parallelize(
        plan_models.hf_llama(VOCAB, (T,)), (T,), grid)
    assert isinstance(given, VocabScoredModel) and given.layouts["lm_head"] == "vocab"


def test_on_one_rank_the_split_score_is_the_whole_one() -> None:
    model = block_lm().double()
    reference = block_lm().double()
    pmodel = STRATEGIES.get("model")(plan={"head": "vocab"}).parallelize(
        model, (T,), ProcessGrid(1, 1))
    assert isinstance(pmodel, VocabScoredModel)
    x = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, VOCAB, (4, T), generator=torch.Generator().manual_seed(2))
    assert pmodel.output_rows(4) == slice(0, 4)
    got = pmodel.score(pmodel(x), y, correct=True)
    want = cross_entropy_score(reference(x), y, correct=True)
    assert got.count == want.count
    assert torch.allclose(got.loss_sum, want.loss_sum, rtol=1e-12)
    assert got.correct is not None and want.correct is not None
    assert int(got.correct) == int(want.correct)
