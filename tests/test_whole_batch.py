"""`strategies.layers.whole_batch.RowDraws` in one process: the batch's rows drawn by two "ranks"
holding half of them each are the rows one process draws (dropout, dropout2d, stochastic depth,
attention dropout inside `nn.MultiheadAttention` and `F.scaled_dot_product_attention`, a
Bernoulli of per-element probabilities), and the run's generator ends where it does in one
process."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strategies.layers.whole_batch import RowDraws, forward_key
from strategies.probe import draw_plan


class DropPath(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.new_empty((x.shape[0], 1, 1, 1)).bernoulli_(0.7) / 0.7


class Attention(nn.Module):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.mha = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            q = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).flatten(1)
        return self.mha(x, x, x, need_weights=False)[0].flatten(1)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.bernoulli(torch.sigmoid(x)) + torch.rand(1, dtype=x.dtype, device=x.device)


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "dropout": (lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.4)), (6,)),
    "dropout2d": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.Dropout2d(0.5)), (3, 4, 4)),
    "stochastic depth": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), DropPath()), (3, 4, 4)),
    "multi-head attention": (lambda: Attention(fused=False), (5, 8)),
    "scaled dot-product attention": (lambda: Attention(fused=True), (5, 8)),
    "bernoulli of probabilities": (lambda: nn.Sequential(nn.Linear(6, 6), Gate()), (6,)),
}


def forward(model: nn.Module, x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of the batch `x`, as the rank holding them computes them."""
    torch.manual_seed(1)
    with RowDraws(draw_plan(model, x.shape[1:]), forward_key(), start, rows):
        return model(x[start:start + rows])


@pytest.mark.parametrize("case", CASES)
def test_each_rank_draws_its_rows_as_one_process_does(case: str) -> None:
    build, shape = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(6, *shape, dtype=torch.float64)
    whole = forward(model, x, 0, 6)
    after = torch.random.get_rng_state()
    for start in (0, 3):
        mine = forward(model, x, start, 3)
        torch.testing.assert_close(mine, whole[start:start + 3], rtol=1e-12, atol=1e-12)
        assert torch.equal(torch.random.get_rng_state(), after)
    # and the masks are random: another forward's key draws others
    torch.manual_seed(2)
    with RowDraws(draw_plan(model, shape), forward_key(), 0, 6):
        assert not torch.allclose(model(x), whole)


class HeadsDropout(nn.Module):
    """Attention weights of `heads` heads, dropped: a model split by heads holds some of them."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = x.view(x.shape[0], self.heads, 4, -1).softmax(-1)  # B, heads, T, T
        return F.dropout(weights, 0.4, training=self.training).flatten(1)


@pytest.mark.parametrize("dim", ["heads", "features"])
def test_a_rank_of_a_split_model_draws_its_piece_of_each_rows_whole_draw(dim: str) -> None:
    # one process: 4 heads (or 8 features); two ranks of a model group: 2 heads (4 features)
    # each, every rank drawing the group's rows, keeping its piece of each row's mask
    torch.manual_seed(0)
    x = torch.randn(6, 4 * 4 * 4 if dim == "heads" else 8, dtype=torch.float64)

    def build(pieces: int) -> nn.Module:
        if dim == "heads":
            return HeadsDropout(4 // pieces)
        return nn.Dropout(0.4)

    plan = draw_plan(build(1), x.shape[1:])
    torch.manual_seed(1)
    key = forward_key()
    with RowDraws(plan, key, 0, 6):
        whole = build(1).train()(x).view(6, 2, -1)  # halves: rank 0's heads, rank 1's
    for piece in (0, 1):
        local = x.view(6, 2, -1)[:, piece].reshape(6, -1)
        with RowDraws(plan, key, 0, 6, pieces=2, piece=piece):
            mine = build(2).train()(local)
        torch.testing.assert_close(mine, whole[:, piece].reshape(6, -1), rtol=0, atol=0)
    # a tensor that is no rank's piece of the row's draw is refused, never drawn otherwise
    with (pytest.raises(RuntimeError, match="not one rank's piece"),
          RowDraws(plan, key, 0, 6, pieces=3, piece=0)):
        build(2).train()(x.view(6, 2, -1)[:, 0].reshape(6, -1))
