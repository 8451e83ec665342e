"""Micro-batches, recomputation and the activation meter, in one process (the runs with real
ranks are in `tests/test_cli_runs.py`)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from runner.core import ProcessGrid
from runner.training.memory import SavedTensorMeter
from strategies.base import ParallelModel
from strategies.data import DataParallel
from strategies.recompute import checkpoint_modules, checkpoint_targets, outermost
from strategies.transformer.gpt import GPT


def test_micro_batches_cut_each_batch_group_into_consecutive_pieces() -> None:
    grid = SimpleNamespace(pc=2, pr=2, batch_index=1, model_index=1, size=4)
    model = ParallelModel(grid)  # type: ignore[arg-type]
    whole = model.micro_batches(16, 1)
    assert [(m.inputs, m.outputs) for m in whole] == [(slice(8, 16), slice(12, 16))]
    pieces = model.micro_batches(16, 2)
    # each piece is a global batch of 8 to the model: this group's rows 4..8 of it, and this
    # rank's sub-shard, the second half of those
    assert [(m.inputs, m.outputs, m.global_rows) for m in pieces] == [
        (slice(8, 12), slice(10, 12), 8), (slice(12, 16), slice(14, 16), 8)]
    assert [m.last for m in pieces] == [False, True]


class _DropoutBlocks(nn.Module):
    """Repeated blocks that draw dropout masks over the batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Dropout(0.3)) for _ in range(3))
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(x)
        return out


def _gradients(make: Callable[[], nn.Module], setting: str,
               x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """One process's gradients of a training step and the peak bytes it kept for backward,
    with the modules `setting` names recomputed."""
    torch.manual_seed(0)
    model = make()
    names, problem = checkpoint_targets(model, setting)
    assert problem is None
    modules = dict(model.named_modules())
    pmodel = DataParallel().parallelize(model, tuple(x.shape[1:]), ProcessGrid(1, 1))
    wrapped, rebuilt = checkpoint_modules(pmodel, {name: modules[name] for name in names})
    assert wrapped == names and not rebuilt
    meter = SavedTensorMeter(pmodel.parameters())
    torch.manual_seed(1)
    with meter.step():
        logits = pmodel(x)
        logits.reshape(-1, logits.shape[-1]).logsumexp(dim=1).sum().backward()
    assert meter.live == 0  # backward let every saved tensor go
    return [p.grad.clone() for p in pmodel.parameters() if p.grad is not None], meter.peak


def test_recomputed_blocks_draw_the_masks_their_forward_drew() -> None:
    x = torch.randn(6, 12, dtype=torch.float64)
    torch.set_default_dtype(torch.float64)
    try:
        kept, kept_peak = _gradients(_DropoutBlocks, "none", x)
        again, again_peak = _gradients(_DropoutBlocks, "units", x)
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(kept, again, strict=True))
    assert again_peak < kept_peak


def test_recomputed_transformer_blocks_keep_less() -> None:
    tokens = torch.randint(0, 40, (4, 16))

    def gpt() -> nn.Module:
        return GPT(40, 16, 32, 4, 4, 4, True, True, False)

    kept, kept_peak = _gradients(gpt, "none", tokens)
    again, again_peak = _gradients(gpt, "units", tokens)
    assert all(torch.allclose(a, b) for a, b in zip(kept, again, strict=True))
    assert again_peak < 0.7 * kept_peak, (again_peak, kept_peak)


def test_a_glob_keeps_the_outermost_modules_it_matches() -> None:
    model = _DropoutBlocks()
    names, problem = checkpoint_targets(model, "blocks*")
    assert problem is None and names == ["blocks"]
    assert outermost(["a", "a.b", "ab", "c.d"]) == ["a", "ab", "c.d"]
    assert checkpoint_targets(model, "units")[0] == ["blocks.0", "blocks.1", "blocks.2"]
    assert "matches no module" in (checkpoint_targets(model, "nothing")[1] or "")


def test_the_meter_counts_a_storage_once_and_not_the_parameters() -> None:
    weight = nn.Parameter(torch.randn(8, 8))
    meter = SavedTensorMeter([weight])
    x = torch.randn(4, 8, requires_grad=True)
    with meter.step():
        y = x * x  # x saved twice: one storage
        z = (y @ weight).sum()  # y saved, the weight not counted
        assert meter.live == x.nbytes + y.nbytes
        z.backward()
    assert meter.live == 0 and meter.peak == x.nbytes + y.nbytes
