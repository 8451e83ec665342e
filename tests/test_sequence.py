"""Sequence parallelism (`strategy=domain` on a GPT, `strategies.transformer.context_parallel`)
without MPI: what it refuses, what it predicts, and its one-process model
(tests/mpi/check_sequence.py runs it on 4 ranks against the sequential model)."""

from __future__ import annotations

import copy

import pytest
import torch

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.comm import CommCounter
from runner.core.primitives import ring_shift, ring_shift_op
from runner.cost.collectives import MachineCosts
from strategies import PricingContext
from strategies.domain import DomainParallel
from strategies.transformer.context_parallel import (
    RingAttention,
    SequenceParallelGPT,
    choose_kv_exchange,
)
from strategies.transformer.gpt import GPT

LENGTH, BATCH = 256, 8
AT_BATCH = PricingContext(global_batch=BATCH)  # the strategies price steps of BATCH samples


def meta_gpt(sparse: bool = False) -> GPT:
    with torch.device("meta"):
        return GPT(1000, LENGTH, width=64, layers=2, heads=4, tie_weights=not sparse,
                   sparse_embedding=sparse)


@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_activation_bytes_per_rank_fall_as_one_over_pr(mode: str) -> None:
    model, strategy = meta_gpt(), DomainParallel(kv_exchange=mode, pricing=AT_BATCH)
    one = strategy.predict_activation_bytes(model, (LENGTH,), GridShape(1, 1), BATCH)
    for pr in (2, 4, 8):
        split = strategy.predict_activation_bytes(model, (LENGTH,), GridShape(pr, 1), BATCH)
        # the gathered (or passed) keys and values stay whole: a little above 1/pr
        assert 1 / pr < split / one < 1.3 / pr, (pr, split / one)


def test_compute_falls_with_the_split() -> None:
    model, strategy = meta_gpt(), DomainParallel(kv_exchange="allgather", pricing=AT_BATCH)
    one = strategy.predict_compute_seconds(model, (LENGTH,), GridShape(1, 1), BATCH)
    four = strategy.predict_compute_seconds(model, (LENGTH,), GridShape(4, 1), BATCH)
    assert 0.2 < four / one < 0.35


def test_auto_picks_allgather_where_latency_dominates() -> None:
    model = meta_gpt()
    for pr in (2, 4, 8):  # same bytes; ⌈log₂ pr⌉ latencies against pr − 1 (a tie at 2 and 3)
        strategy = DomainParallel(kv_exchange="auto", pricing=AT_BATCH)
        assert strategy.sequence_exchange(model, (LENGTH,), GridShape(pr, 2)) == "allgather"
        assert DomainParallel(kv_exchange="ring").sequence_exchange(
            model, (LENGTH,), GridShape(pr, 2)) == "ring"


def test_auto_follows_the_cost_model() -> None:
    """Predicted, not guessed: where an all-gather's call costs more than the ring's messages
    together, the ring wins."""
    costs = MachineCosts(alpha=0.0, calls=(("allgather", 1.0), ("reduce_scatter", 1.0),
                                           ("exchange", 1e-6)))
    assert choose_kv_exchange("auto", meta_gpt(), LENGTH, GridShape(4, 1), 2, 4,
                              costs) == "ring"


def test_predicted_exchanges() -> None:
    model = meta_gpt()
    grid = GridShape(4, 2)
    rows = BATCH // 2
    per_position = rows * 2 * 64 * 4  # K and V, float32
    ring = DomainParallel(kv_exchange="ring").predict_ops(model, (10,), grid, BATCH)
    exchanges = [op for op in ring if op.op == "exchange"]
    # per layer 3 shifts forward (rank 0 sends blocks 0, 3, 2) and 3 back (the gradients of
    # blocks 1, 2, 3); 10 positions over 4 ranks: 3, 3, 2, 2
    assert [op.nbytes // per_position for op in exchanges] == [3, 2, 2, 3, 2, 2] * 2
    assert {(op.group, op.group_size) for op in exchanges} == {("model", 4)}
    gathered = DomainParallel(kv_exchange="allgather").predict_ops(model, (10,), grid, BATCH)
    kv = [op for op in gathered if op.group == "model"]
    assert [(op.op, op.nbytes) for op in kv] == [("allgather", 10 * per_position),
                                                  ("reduce_scatter", 10 * per_position)] * 2
    grads = [op for op in gathered if op.op == "iallreduce"]
    assert {(op.group, op.group_size) for op in grads} == {("world", 8)}
    assert sum(op.nbytes for op in grads) == sum(p.numel() * 4 for p in model.parameters())


def test_what_it_refuses() -> None:
    strategy = DomainParallel()
    assert DomainParallel(kv_exchange="tree").check(GridShape(2, 1), 4) == [
        "strategy.kv_exchange=tree: must be one of auto, allgather, ring"]
    assert strategy.check(GridShape(2, 1), 4) == []
    short = strategy.check_model(meta_gpt(), (3,), GridShape(4, 1))
    assert len(short) == 1 and "sequences are 3 tokens" in short[0]
    assert strategy.check_model(meta_gpt(), (LENGTH,), GridShape(4, 1)) == []
    sparse = strategy.check_model(meta_gpt(sparse=True), (LENGTH,), GridShape(2, 1))
    assert len(sparse) == 1 and "model.sparse_embedding" in sparse[0]
    assert "longer than the GPT's context" in strategy.check_model(
        meta_gpt(), (LENGTH + 1,), GridShape(2, 1))[0]


def test_one_process_equals_the_plain_model() -> None:
    torch.manual_seed(0)
    reference = GPT(50, 10, width=32, layers=2, heads=4)
    model = DomainParallel().parallelize(copy.deepcopy(reference), (10,), ProcessGrid(1, 1))
    assert isinstance(model, SequenceParallelGPT) and model.reducers == []
    x = torch.randint(0, 50, (3, 10))
    assert torch.equal(model(x), reference(x))
    assert model.output_rows(3) == slice(0, 3)
    score = model.score(model(x), x, correct=True)
    assert score.count == 30 and score.correct is not None
    with pytest.raises(ValueError, match="split for 10 positions"):
        model(x[:, :5])


def test_ring_shift_on_one_rank_is_the_identity() -> None:
    comm = CountedComm(None, CommCounter())
    x = torch.randn(2, 3, requires_grad=True)
    assert torch.equal(ring_shift_op(x, comm, 0, (2,)), x.detach())
    ring_shift(x, comm, 0, (2,), 1).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(2, 3))
    with pytest.raises(ValueError, match="its length is 2"):
        ring_shift_op(x, comm, 1, (2,))


def test_ring_blocks_merge_to_softmax_attention() -> None:
    """One rank's ring attention is plain causal attention (the merge's single block)."""
    comm = CountedComm(None, CommCounter())
    q, k, v = (torch.randn(2, 4, 7, 8, dtype=torch.float64) for _ in range(3))
    got = RingAttention(comm, Partition(7, 1))(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(got, want, atol=1e-12)
