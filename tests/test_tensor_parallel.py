"""Tensor parallelism of a GPT without MPI: predictions on GPT-2 small's shapes, refusals by
name, and a grid of one process against the sequential model (tests/mpi/check_tensor_parallel.py
runs the split itself)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from runner.core import GridShape, ProcessGrid
from runner.core.placement import place_whole
from runner.cost.collectives import DEFAULT_COSTS, comm_seconds, step_bytes
from strategies import STRATEGIES, PricingContext
from strategies.transformer.gpt import GPT
from strategies.transformer.tensor_parallel import activation_ops, tp_param_bytes


def gpt2_small() -> GPT:
    with torch.device("meta"):
        return GPT(50257, 1024, width=768, layers=12, heads=12)


def test_pairing_moves_less_than_gather_per_block() -> None:
    model = gpt2_small()
    tokens = 8 * 1024
    pairing = activation_ops(model, tokens, 4, "pairing", None)
    gather = activation_ops(model, tokens, 4, "gather", None)
    # per block: pairing 4 all-reduces of b·T·width; gather 8 operations, the MLP's gather of
    # its 4·width hidden features among them
    assert step_bytes(pairing) < step_bytes(gather)
    assert comm_seconds(pairing, DEFAULT_COSTS) < comm_seconds(gather, DEFAULT_COSTS)
    block = [op for op in pairing if op.layer.startswith("blocks.0.")]
    assert [op.op for op in block] == ["allreduce"] * 4
    assert all(op.nbytes == tokens * 768 * 4 for op in block)
    loss = [op for op in pairing if op.layer == "loss"]
    assert [(op.op, op.nbytes) for op in loss] == [("allgather", 4 * 2 * tokens * 4),
                                                   ("allreduce", tokens * 4)]


def test_auto_layout_is_the_cheaper_predicted_step() -> None:
    model = gpt2_small()
    grid = GridShape(4, 2)
    at_16 = PricingContext(global_batch=16)
    times = {layout: STRATEGIES.get("grid")(tp_layout=layout, pricing=at_16)
             .predict_step_seconds(model, (1024,), grid, 16) for layout in ("pairing", "gather")}
    assert times["pairing"] < times["gather"]
    auto = STRATEGIES.get("grid")(pricing=at_16)
    assert auto.predict_ops(model, (1024,), grid, 16) == \
        STRATEGIES.get("grid")(tp_layout="pairing").predict_ops(model, (1024,), grid, 16)


def test_each_rank_holds_its_share_of_the_blocks() -> None:
    model = gpt2_small()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    small = [(name, p) for name, p in model.named_parameters() if p.dim() == 1
             or name == "pos_emb.weight"]  # replicated: norms, biases, positions
    replicated = sum(p.numel() * p.element_size() for _, p in small)
    for pr in (2, 4, 12):
        got = tp_param_bytes(model, pr, "pairing")
        assert (whole - replicated) / pr <= got <= (whole - replicated) / pr + replicated
        assert got == STRATEGIES.get("model")().predict_param_bytes(model, (1024,),
                                                                     GridShape(pr, 1))
    one = STRATEGIES.get("grid")()
    assert one.predict_param_bytes(model, (1024,), GridShape(1, 4)) == whole
    act = [one.predict_activation_bytes(model, (1024,), GridShape(pr, 1), 8) for pr in (1, 4)]
    assert act[1] < act[0]
    seconds = [one.predict_compute_seconds(model, (1024,), GridShape(pr, 1), 8)
               for pr in (1, 4)]
    assert 0 < seconds[1] < seconds[0]


def test_refusals_name_the_values() -> None:
    model = gpt2_small()
    problems = STRATEGIES.get("model")().check_model(model, (1024,), GridShape(16, 1))
    assert problems == ["strategy=model splits the GPT's 12 attention heads over grid.pr=16 "
                        "ranks: grid.pr must be at most 12"]
    assert STRATEGIES.get("grid")().check_model(model, (1024,), GridShape(4, 2)) == []
    bad = STRATEGIES.get("grid")(tp_layout="rows").check(GridShape(2, 2), 8)
    assert bad == ["strategy.tp_layout=rows: must be one of auto, pairing, gather"]


@pytest.mark.parametrize("layout", ["pairing", "gather"])
@pytest.mark.parametrize("tied", [True, False])
def test_one_process_equals_the_sequential_model(layout: str, tied: bool) -> None:
    torch.manual_seed(0)
    seq = GPT(50, 8, width=32, layers=2, heads=4, tie_weights=tied).double()
    twin = copy.deepcopy(seq)
    place_whole(twin)
    pmodel = STRATEGIES.get("grid")(tp_layout=layout).parallelize(twin, (8,), ProcessGrid(1, 1))
    x, y = torch.randint(0, 50, (3, 8)), torch.randint(0, 50, (3, 8))
    assert pmodel.output_rows(3) == slice(0, 3)
    score = pmodel.score(pmodel(x), y, correct=True)
    logits = seq(x)
    want = F.cross_entropy(logits.reshape(-1, 50), y.reshape(-1), reduction="sum")
    assert score.count == 24
    assert abs(score.loss_sum.item() - want.item()) < 1e-10
    assert score.correct is not None
    assert score.correct.item() == (logits.argmax(-1) == y).sum().item()
    score.loss_sum.backward()
    want.backward()
    assert seq.tok_emb.weight.grad is not None
    grad = dict(pmodel.named_parameters())["gpt.tok_emb.weight"].grad
    assert grad is not None and torch.allclose(grad, seq.tok_emb.weight.grad, atol=1e-12)
