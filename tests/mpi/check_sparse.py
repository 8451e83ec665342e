"""The sparse exchange of embedding gradients on real ranks, one launch: `mpiexec -n P python THIS`
(P = 2 and 4).

- the row-sparse operators against the dense all-reduce they replace, with a rank that has no
  rows, duplicate indices, and a table smaller than P (owners with no rows); push and pull pass
  the dot-product (adjoint) test, the all-gather sum is self-adjoint;
- the exchange object in every mode, with one rank whose batch never used the table;
- training: every mode gives the dense exchange's parameters after 12 steps (float32, 1e-6
  relative), with plain SGD (a sparse update) and with momentum and weight decay (dense);
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
from runner.core.cost import MachineCosts
from runner.core.sparse import CyclicRows, allgather_sum_rows, pull_rows, push_rows
from runner.datasets import ZipfTokens
from runner.models import bag_classifier
from runner.optim import SynchronousSGD
from strategies.data import DataParallel
from strategies.sparse_exchange import SparseGradientExchange

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
        rows = CyclicRows(num_rows, SIZE)
        own_i, own_v = push_rows(COMM, rows, indices, values)
        assert bool((rows.owner(own_i) == RANK).all()), "push delivered rows to a non-owner"
        owned = rows.owned(RANK)
        assert torch.allclose(dense(own_i, own_v, num_rows)[owned], want[owned],
                              rtol=1e-12, atol=1e-12), "push sums differ from the all-reduce"
        # pull: each rank asks for its own rows (none on rank 1) from a table whose owned rows
        # hold the true values and whose other rows hold garbage
        table = torch.full((num_rows, width), float("nan"), dtype=torch.float64)
        table[owned] = want[owned]
        wanted = torch.unique(indices)
        assert torch.equal(pull_rows(COMM, rows, wanted, table), want[wanted]), "pull"


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
    rhs = torch.tensor([(x * pull_rows(COMM, rows, wanted, y)).sum().item()],
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
        table.weight.grad = (None if RANK == 1 else  # a batch that never reached the table
                             torch.sparse_coo_tensor(indices.unsqueeze(0), values,
                                                     table.weight.shape, check_invariants=False))
        exchange.finish()
        grad = table.weight.grad.to_dense()
        if exchange.report()["t"]["mode"] == "sharded":  # owners hold their rows' sums only
            owned = CyclicRows(num_rows, SIZE).owned(RANK)
            assert torch.allclose(grad[owned], want[owned], rtol=1e-12, atol=1e-12), mode
            others = torch.ones(num_rows, dtype=torch.bool)
            others[owned] = False
            assert not grad[others].any(), f"{mode}: gradient rows on a non-owner"
        else:
            assert torch.allclose(grad, want, rtol=1e-12, atol=1e-12), mode


def train_tokens(mode: str, momentum: float, weight_decay: float,
                 steps: int = 12) -> tuple[list[float], nn.Module]:
    data = ZipfTokens(vocab_size=5000, seq_len=16, samples=1024).load()
    grid = ProcessGrid(1, SIZE, WORLD, backend=BACKEND)
    torch.manual_seed(0)
    model = bag_classifier((16,), 4, vocab_size=5000, embedding_dim=16, hidden=(16,))
    pmodel = DataParallel(sparse=mode).parallelize(model, (16,), grid)
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
    return losses, pmodel.module


@check
def every_mode_trains_to_the_dense_parameters() -> None:
    for momentum, decay in ((0.0, 0.0), (0.9, 1e-3)):  # a sparse update; a dense one
        _, reference = train_tokens("dense", momentum, decay)
        for mode in ("allgather", "sharded", "auto"):
            _, model = train_tokens(mode, momentum, decay)
            for (name, got), want in zip(model.named_parameters(), reference.parameters(),
                                         strict=True):
                gap = ((got - want).abs().max() / want.abs().max()).item()
                assert gap < 1e-6, f"{mode} (momentum {momentum}): {name} off by {gap:.2e}"


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
