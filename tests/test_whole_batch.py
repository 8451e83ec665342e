"""`strategies.whole_batch.GlobalDraws` in one process: each "rank" of a batch split in two,
from the same generator state, draws exactly the rows of the one process's masks (dropout,
dropout2d, stochastic depth, attention dropout inside `nn.MultiheadAttention` and
`F.scaled_dot_product_attention`), and the generator ends where the one process's does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strategies.probe import draw_plan
from strategies.whole_batch import GlobalDraws


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


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "dropout": (lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.4)), (6,)),
    "dropout2d": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.Dropout2d(0.5)), (3, 4, 4)),
    "stochastic depth": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), DropPath()), (3, 4, 4)),
    "multi-head attention": (lambda: Attention(fused=False), (5, 8)),
    "scaled dot-product attention": (lambda: Attention(fused=True), (5, 8)),
}


@pytest.mark.parametrize("case", CASES)
def test_each_rank_draws_its_rows_of_one_process_masks(case: str) -> None:
    build, shape = CASES[case]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(6, *shape, dtype=torch.float64)
    plan = draw_plan(model, shape)
    assert plan.problems == () and plan.cuts and None not in plan.cuts
    torch.manual_seed(1)
    whole = model(x)
    after = torch.random.get_rng_state()
    for start in (0, 3):
        torch.manual_seed(1)
        with GlobalDraws(plan, start, 3, 6):
            mine = model(x[start:start + 3])
        torch.testing.assert_close(mine, whole[start:start + 3], rtol=1e-12, atol=1e-12)
        assert torch.equal(torch.random.get_rng_state(), after)
