"""The sparse exchange of embedding gradients on real ranks, one launch: `mpiexec -n P python THIS`
(P = 2 and 4), or in check_data_parallel.py's, which imports it.

- the row-sparse operators against the dense all-reduce they replace, with a rank that has no
  rows, duplicate indices, and a table smaller than P (owners with no rows): rows dealt or in
  blocks, over every rank or fewer owners, pushed directly or summed inside nodes first; push
  and pull pass the dot-product (adjoint) test, the all-gather sum is self-adjoint;
- the exchange object in every mode, with one rank whose batch never used the table;
- training: every mode gives the dense exchange's parameters after 12 steps (float32, 1e-6
  relative), with plain SGD (a sparse update) and with momentum and weight decay (dense); the
  owners-only `sharded` with and without hot rows and with fewer owners than ranks, and with
  a node's rows summed before the push (whose step issues the planner's operations);
- owners-only storage: a rank's table parameter and optimizer state are its block of rows, the
  rows it holds are the planner's, the hot rows the most widely read;
- `auto` chooses dense when a batch touches most rows of a table and a sparse mode when it
  touches few; every rank chooses alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from harness import BACKEND, check, run_checks
from mpi4py import MPI
from torch import nn

from runner.core import CommCounter, ProcessGrid
from runner.core.row_sparse import (
    BlockRows,
    CyclicRows,
    NodeRoutes,
    allgather_sum_rows,
    pull_rows,
    push_rows,
    push_rows_by_node,
)
from runner.cost.collectives import MachineCosts
from runner.optim.sync import SynchronousSGD
from runner.zoo.datasets import ZipfTokens
from runner.zoo.models import bag_classifier
from strategies import ParallelModel, PricingContext
from strategies.data import DataParallel
from strategies.exchange import sparse_gradients
from strategies.exchange.sparse_gradients import SparseGradientExchange

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = ProcessGrid(1, SIZE, WORLD, CommCounter(keep_records=True), backend=BACKEND).world


def rows_of(rank: int, num_rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's row-sparse input: rank 1 has none; the others repeat indices."""
    gen = torch.Generator().manual_seed(100 + rank)
    count = 0 if rank == 1 else 3 + 2 * rank
    indices = torch.randint(0, num_rows, (count,), generator=gen)
    indices = torch.cat([indices, indices[:2]])  # duplicates on purpose
    return indices, torch.randn(len(indices), width, dtype=torch.float64, generator=gen)


def dense(indices: torch.Tensor, values: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = values.new_zeros(num_rows, values.shape[1])
    return out.index_add_(0, indices, values)


def dense_sum(num_rows: int, width: int) -> torch.Tensor:
    """What the all-reduce of the densified inputs gives (the reference)."""
    return sum(dense(*rows_of(k, num_rows, width), num_rows) for k in range(SIZE))


@check
def sparse_operators_equal_the_dense_all_reduce() -> None:
    width = 3
    for num_rows in (SIZE - 1, 40):  # a table smaller than P, and a larger one
        want = dense_sum(num_rows, width)
        indices, values = rows_of(RANK, num_rows, width)
        got_i, got_v = allgather_sum_rows(COMM, indices, values)
        assert torch.equal(got_i, torch.unique(got_i)), "allgather result not coalesced"
        assert torch.allclose(dense(got_i, got_v, num_rows), want, rtol=1e-12, atol=1e-12)
        # dealt rows, blocks over every rank, and blocks over fewer owners than ranks
        for rows in (CyclicRows(num_rows, SIZE), BlockRows(num_rows, SIZE),
                     BlockRows(num_rows, max(1, SIZE - 1))):
            owned = rows.owned(RANK)
            # direct, and through nodes of two ranks (and of three: nodes of unequal size)
            for per_node in (None, 2, 3):
                if per_node is None:
                    own_i, own_v = push_rows(COMM, rows, indices, values)
                else:
                    routes = NodeRoutes([rank // per_node for rank in range(SIZE)])
                    own_i, own_v = push_rows_by_node(COMM, rows, routes, indices, values)
                assert bool((rows.owner(own_i) == RANK).all()), "push reached a non-owner"
                assert torch.equal(own_i, torch.unique(own_i)), "push result not coalesced"
                assert torch.allclose(dense(own_i, own_v, num_rows)[owned], want[owned],
                                      rtol=1e-12, atol=1e-12), f"{rows} {per_node}: push sums"
            # pull: each rank asks for its own rows (none on rank 1) from the owners, each of
            # which holds its own rows only
            wanted = torch.unique(indices)
            assert torch.equal(pull_rows(COMM, rows, wanted, want[owned]), want[wanted]), rows


@check
def push_and_pull_are_adjoint_and_allgather_is_self_adjoint() -> None:
    num_rows, width = 37, 4
    rows = CyclicRows(num_rows, SIZE)
    gen = torch.Generator().manual_seed(7 + RANK)
    indices, x = rows_of(RANK, num_rows, width)
    wanted = torch.unique(indices)
    x = torch.randn(len(wanted), width, dtype=torch.float64, generator=gen)
    y = torch.randn(num_rows, width, dtype=torch.float64, generator=gen)  # owned rows count
    own_i, own_v = push_rows(COMM, rows, wanted, x)
    owned_y = y[own_i]
    lhs = torch.tensor([(own_v * owned_y).sum().item()], dtype=torch.float64)
    rhs = torch.tensor([(x * pull_rows(COMM, rows, wanted, y[rows.owned(RANK)])).sum().item()],
                       dtype=torch.float64)
    WORLD.Allreduce(MPI.IN_PLACE, lhs)
    WORLD.Allreduce(MPI.IN_PLACE, rhs)
    assert abs(lhs.item() - rhs.item()) <= 1e-12 * max(1.0, abs(lhs.item())), (lhs, rhs)
    # allgather-sum is 1·1ᵀ ⊗ I: ⟨A x, y⟩ = ⟨x, A y⟩ with y row-sparse too
    y_i = torch.unique(torch.randint(0, num_rows, (5,), generator=gen))
    y_v = torch.randn(len(y_i), width, dtype=torch.float64, generator=gen)
    ax_i, ax_v = allgather_sum_rows(COMM, wanted, x)
    ay_i, ay_v = allgather_sum_rows(COMM, y_i, y_v)
    dots = torch.tensor([(dense(ax_i, ax_v, num_rows) * dense(y_i, y_v, num_rows)).sum(),
                         (dense(wanted, x, num_rows) * dense(ay_i, ay_v, num_rows)).sum()],
                        dtype=torch.float64)
    WORLD.Allreduce(MPI.IN_PLACE, dots)
    assert abs(dots[0] - dots[1]) <= 1e-12 * max(1.0, abs(dots[0].item())), dots


@check
def every_mode_handles_a_rank_that_never_used_the_table() -> None:
    num_rows, width = 30, 3
    want = dense_sum(num_rows, width) / SIZE
    for mode in ("allgather", "sharded", "auto"):
        table = nn.Embedding(num_rows, width, sparse=True).double()
        exchange = SparseGradientExchange([("t", table)], COMM, 1.0 / SIZE, mode,
                                          MachineCosts(1e-6, 1e-9))
        indices, values = rows_of(RANK, num_rows, width)
        if mode == "sharded":  # owners-only: the gradient comes through the table's forward,
            # which every rank runs (it pulls rows): rank 1's with no ids; two forwards before
            # one exchange (their gradient rows summed)
            half = len(indices) // 2
            ((table(indices[:half]) * values[:half]).sum()
             + (table(indices[half:]) * values[half:]).sum()).backward()
        else:
            table.weight.grad = (None if RANK == 1 else
                                 torch.sparse_coo_tensor(indices.unsqueeze(0), values,
                                                         table.weight.shape,
                                                         check_invariants=False))
        exchange.finish()
        grad = table.weight.grad.to_dense()
        if mode == "sharded":  # owners hold their own rows, and their sums only
            block = BlockRows(num_rows, SIZE).block(RANK)
            assert grad.shape == want[block].shape, f"{mode}: holds {list(grad.shape)}"
            assert torch.allclose(grad, want[block], rtol=1e-12, atol=1e-12), mode
        else:
            assert torch.allclose(grad, want, rtol=1e-12, atol=1e-12), mode


def whole_parameters(pmodel: ParallelModel) -> list[torch.Tensor]:
    return sparse_gradients.whole_parameters(pmodel.module, pmodel.reducers)


def train_tokens(mode: str, momentum: float, weight_decay: float, steps: int = 12,
                 **options: object) -> tuple[list[float], list[torch.Tensor]]:
    losses, params, _ = train_tokens_reporting(mode, momentum, weight_decay, steps, **options)
    return losses, params


def train_tokens_reporting(mode: str, momentum: float, weight_decay: float, steps: int = 12,
                           **options: object
                           ) -> tuple[list[float], list[torch.Tensor], dict[str, object]]:
    data = ZipfTokens(vocab_size=5000, seq_len=16, samples=1024).load()
    grid = ProcessGrid(1, SIZE, WORLD, backend=BACKEND)
    torch.manual_seed(0)
    model = bag_classifier((16,), 4, vocab_size=5000, embedding_dim=16, hidden=(16,))
    pmodel = DataParallel(sparse=mode, **options).parallelize(model, (16,), grid)  # type: ignore[arg-type]
    optimizer = SynchronousSGD(pmodel, grid, steps, lr=0.5, momentum=momentum,
                               weight_decay=weight_decay)
    batch, losses = 16 * SIZE, []
    for step in range(steps):
        rows = slice(step * batch + RANK * 16, step * batch + (RANK + 1) * 16)
        pmodel.zero_grad()
        loss = F.cross_entropy(pmodel(data.train_x[rows]), data.train_y[rows])
        loss.backward()
        pmodel.finish_gradient_sync()
        optimizer.step(step)
        losses.append(loss.item())
    pmodel.refresh_copies()
    return losses, whole_parameters(pmodel), pmodel.exchange_report()


@check
def every_mode_trains_to_the_dense_parameters() -> None:
    for momentum, decay in ((0.0, 0.0), (0.9, 1e-3)):  # a sparse update; a dense one
        _, reference = train_tokens("dense", momentum, decay)
        for mode, options in (("allgather", {}), ("sharded", {}), ("auto", {}),
                              ("sharded", {"sparse_hot_rows": 0}),
                              ("sharded", {"sparse_partitions": max(1, SIZE // 2)})):
            _, params = train_tokens(mode, momentum, decay, **options)
            for index, (got, want) in enumerate(zip(params, reference, strict=True)):
                gap = ((got - want).abs().max() / want.abs().max()).item()
                assert gap < 1e-6, (f"{mode} {options} (momentum {momentum}): parameter "
                                    f"{index} off by {gap:.2e}")


@check
def a_node_s_rows_summed_before_the_push_train_like_one_process() -> None:
    """Nodes of two ranks (`ranks_per_node=2`; 4 ranks: two nodes, 2 ranks: one, no sums) and
    messages dear enough (α = 1 ms) that the cost model takes the node's sums: the dense
    exchange's parameters, and each step issues the operations the planner predicts."""
    _, reference = train_tokens("dense", 0.9, 1e-3, steps=6)
    costs = MachineCosts(1e-3, 2.5e-10)
    _, params, report = train_tokens_reporting("sharded", 0.9, 1e-3, steps=6, ranks_per_node=2,
                                               sparse_partitions=SIZE,
                                               pricing=PricingContext(costs))
    table = report["0"]
    assert isinstance(table, dict) and table["node_push"] == (SIZE >= 4), table
    for index, (got, want) in enumerate(zip(params, reference, strict=True)):
        gap = ((got - want).abs().max() / want.abs().max()).item()
        assert gap < 1e-6, f"node push: parameter {index} off by {gap:.2e}"
    # the operations of one step, as the planner predicts them
    counter = CommCounter(keep_records=True)
    grid = ProcessGrid(1, SIZE, WORLD, counter, backend=BACKEND)
    torch.manual_seed(0)
    model = bag_classifier((16,), 4, vocab_size=5000, embedding_dim=16, hidden=(16,))
    strategy = DataParallel(sparse="sharded", ranks_per_node=2, sparse_partitions=SIZE,
                            pricing=PricingContext(costs))
    predicted = strategy.predict_sparse_ops("0", model[0].weight, SIZE, 16)
    pmodel = strategy.parallelize(model, (16,), grid)
    data = ZipfTokens(vocab_size=5000, seq_len=16, samples=256).load()
    for step in range(2):
        rows = slice(step * 16 * SIZE + RANK * 16, step * 16 * SIZE + (RANK + 1) * 16)
        before = len(counter.records)
        pmodel.zero_grad()
        F.cross_entropy(pmodel(data.train_x[rows]), data.train_y[rows]).backward()
        pmodel.finish_gradient_sync()
    ops = [(r.op, r.label) for r in counter.records[before:] if r.label.startswith("0 ")]
    assert sorted(ops) == sorted((o.op, o.layer) for o in predicted), (ops, predicted)
    counts = {r.label: r.nbytes for r in counter.records[before:] if r.label.endswith("counts")}
    assert counts == {o.layer: o.nbytes for o in predicted if o.layer.endswith("counts")}


@check
def owners_only_tables_hold_their_block_and_the_hot_rows_as_predicted() -> None:
    """A rank's table parameter is its block of rows, and its optimizer state likewise; the
    rows it holds as parameters (block and hot replicas) are the planner's for rank 0; the hot
    rows are read by several ranks and spare the pull; fewer owners than ranks leave the
    others owning nothing."""
    vocab, width, hot = 5000, 16, 32
    data = ZipfTokens(vocab_size=vocab, seq_len=16, samples=256).load()
    for parts in (SIZE, max(1, SIZE // 2)):
        grid = ProcessGrid(1, SIZE, WORLD, backend=BACKEND)
        torch.manual_seed(0)
        model = bag_classifier((16,), 4, vocab_size=vocab, embedding_dim=width, hidden=(16,))
        strategy = DataParallel(sparse="sharded", sparse_hot_rows=hot, sparse_partitions=parts)
        full = model[0].weight.detach().clone()
        predicted_rows = strategy.table_rows_per_rank(full, SIZE)
        pmodel = strategy.parallelize(model, (16,), grid)
        optimizer = SynchronousSGD(pmodel, grid, 2, lr=0.5, momentum=0.9)
        for step in range(2):
            rows = slice(step * 16 * SIZE + RANK * 16, step * 16 * SIZE + (RANK + 1) * 16)
            pmodel.zero_grad()
            F.cross_entropy(pmodel(data.train_x[rows]), data.train_y[rows]).backward()
            pmodel.finish_gradient_sync()
            optimizer.step(step)
        block = BlockRows(vocab, parts).block(RANK)
        table = pmodel.module[0]
        assert table.weight.shape == (block.stop - block.start, width), table.weight.shape
        momentum = optimizer.param_states()["momentum"][0]
        assert momentum is not None and momentum.shape == table.weight.shape, "state: owned"
        report = pmodel.exchange_report()["0"]
        assert report["param_rows"] == len(table.weight) + hot
        if RANK == 0:  # measured == predicted: rank 0 holds the first, largest block
            assert report["param_rows"] == predicted_rows, (report, predicted_rows)
        assert report["held_bytes"] == report["held_rows"] * width * 4
        assert report["held_rows"] == report["param_rows"] + report["pulled_rows_max"]
        assert 0 < report["hot_rows"] <= hot, report
        # chosen at the first step: the rows most ranks read then, the pull spared them
        first = [set(data.train_x[k * 16:(k + 1) * 16].flatten().tolist()) for k in range(SIZE)]
        readers = {i: sum(i in batch for batch in first) for i in set().union(*first)}
        chosen = table.hot_ids[table.hot_ids >= 0].tolist()
        assert chosen == sorted(chosen) and all(i in readers for i in chosen), chosen
        assert min(readers[i] for i in chosen) >= max(
            (k for i, k in readers.items() if i not in chosen), default=0), \
            "a row read by fewer ranks was chosen over one read by more"


@check
def auto_chooses_dense_for_busy_tables_and_sparse_for_quiet_ones() -> None:
    width, alpha, beta = 16, 5e-6, 2.5e-10
    for num_rows, touched, expect_dense in ((64, 60, True), (200_000, 40, False)):
        table = nn.Embedding(num_rows, width, sparse=True)
        exchange = SparseGradientExchange([("t", table)], COMM, 1.0, "auto",
                                          MachineCosts(alpha, beta))
        gen = torch.Generator().manual_seed(RANK)
        indices = torch.randperm(num_rows, generator=gen)[:touched]
        table.weight.grad = torch.sparse_coo_tensor(indices.unsqueeze(0),
                                                    torch.ones(touched, width),
                                                    table.weight.shape, check_invariants=False)
        exchange.finish()
        mode = exchange.report()["t"]["mode"]
        modes = WORLD.allgather(mode)
        assert len(set(modes)) == 1, f"ranks chose differently: {modes}"
        assert (mode == "dense") == expect_dense, (num_rows, touched, mode)


if __name__ == "__main__":
    run_checks()
