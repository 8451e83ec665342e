"""Layers a strategy cannot split correctly are refused by name before anything starts; layers
it can split are (the MPI checks prove the equalities: tests/mpi/check_model_grid.py,
check_domain.py, check_data_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.config.registry import load_plugins
from runner.core import GridShape
from strategies import STRATEGIES


@pytest.fixture(autouse=True, scope="module")
def _strategies() -> None:
    load_plugins()


def _problems(strategy: str, *layers: nn.Module, pr: int = 2) -> list[str]:
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    return STRATEGIES.get(strategy)().check_model(model, (1, 8, 8), GridShape(pr, 1))


@pytest.mark.parametrize("layer,fragment", [
    (nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
    (nn.Conv2d(1, 4, 3, padding="same"), "padding='same'"),
])
def test_domain_refuses_what_a_height_slab_cannot_compute(layer: nn.Module,
                                                          fragment: str) -> None:
    problems = _problems("domain", layer)
    assert len(problems) == 1 and problems[0].startswith("layer 0 (Conv2d(") and \
        fragment in problems[0], problems


@pytest.mark.parametrize("strategy", ["model", "grid"])
def test_a_channel_split_takes_any_padding(strategy: str) -> None:
    assert _problems(strategy, nn.Conv2d(1, 4, 3, padding=1, padding_mode="reflect")) == []
    assert _problems(strategy, nn.Conv2d(1, 4, 3, padding="same")) == []


def test_batch_norm_without_running_statistics_is_refused_by_name() -> None:
    layers = (nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False))
    for strategy in ("data", "model", "grid"):
        problems = _problems(strategy, *layers)
        assert any("track_running_stats=False" in p for p in problems), (strategy, problems)


def test_a_batch_norm_on_gathered_features_is_refused_not_trained_wrongly() -> None:
    """After a gather every rank of the model group holds the whole features, and only a
    partial gradient for the BatchNorm's weights: refused under the splitting strategies."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Flatten(), nn.BatchNorm1d(256),
                          nn.Linear(256, 10))
    for strategy in ("model", "domain"):
        problems = STRATEGIES.get(strategy)().check_model(model, (1, 8, 8), GridShape(2, 1))
        assert any("layer 2 (BatchNorm1d)" in p for p in problems), (strategy, problems)
    # grid runs everything before the first Linear batch-parallel: the BatchNorm is whole there
    # and its statistics are the world's
    assert STRATEGIES.get("grid")().check_model(model, (1, 8, 8), GridShape(2, 1)) == []
    assert STRATEGIES.get("data")().check_model(model, (1, 8, 8), GridShape(1, 2)) == []


class _Gate(nn.Module):
    """A user's module with parameters and no rule."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.view(1, -1, 1, 1)


class _Net(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.conv, self.middle = nn.Conv2d(1, 4, 3, padding=1), middle
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.conv(x)) + self.conv(x))


def test_module_trees_are_split_by_rule_and_a_module_without_one_refused_by_name() -> None:
    from strategies.layers.tree import plan_tree

    for strategy in ("model", "grid"):
        assert STRATEGIES.get(strategy)().check_model(_Net(nn.ReLU()), (1, 8, 8),
                                                      GridShape(2, 1)) == []
    problems = STRATEGIES.get("model")().check_model(_Net(_Gate()), (1, 8, 8), GridShape(2, 1))
    assert len(problems) == 1 and problems[0].startswith(
        "strategy=model cannot split middle (_Gate) uses its tensor middle.scale directly in "
        "forward, which has no rule"), problems
    plan = plan_tree(_Net(nn.ReLU()), (1, 8, 8), "model", pr=2)
    rules = {step.node.name: (step.rule.name, step.out) for step in plan.steps}
    assert rules["conv"] == ("split", "split") and rules["middle"] == ("local", "split")
    assert rules["add"] == ("function", "split")  # both branches split the same way
    assert rules["head_1"] == ("split", "split") and rules["head_0"][1] == "whole"


def test_data_with_local_batch_norm_exchanges_no_statistics() -> None:
    """strategy.batch_norm=local: each rank's own rows, as DDP without SyncBatchNorm; global
    (the default) prices each BatchNorm's all-gather and all-reduce."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(),
                          nn.Linear(256, 10))
    grid = GridShape(1, 4)
    global_ops = STRATEGIES.get("data")().predict_ops(model, (1, 8, 8), grid, 16)
    local_ops = STRATEGIES.get("data")(batch_norm="local").predict_ops(model, (1, 8, 8), grid, 16)
    assert [op.layer for op in global_ops if op.layer.startswith("bn:")] == ["bn:1", "bn:1"]
    assert not [op for op in local_ops if op.layer.startswith("bn:")]


def test_per_sample_normalizations_run_batch_parallel_and_are_refused_elsewhere() -> None:
    net = _Net(nn.GroupNorm(2, 4))
    assert STRATEGIES.get("grid")().check_model(net, (1, 8, 8), GridShape(2, 1)) == []
    for strategy in ("model", "domain"):
        problems = STRATEGIES.get(strategy)().check_model(net, (1, 8, 8), GridShape(2, 1))
        assert len(problems) == 1 and "middle (GroupNorm): a per-sample normalization" in \
            problems[0], (strategy, problems)


class _PooledNormAct(nn.Module):
    """EfficientNet's squeeze-excite with timm's BatchNormAct2d after the pooling: a node of
    one value per channel and sample, its `self.training` traced as it was (batch statistics)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.corpus_models import BatchNormAct2d

        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.reduce = nn.Conv2d(4, 4, 1)
        self.norm = BatchNormAct2d(4)
        self.head = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = self.conv(x).mean((2, 3), keepdim=True)
        return self.head(self.norm(self.reduce(pooled)).flatten(1))


@pytest.mark.parametrize("strategy", ["model", "grid", "domain"])
def test_a_traced_graph_is_never_fed_one_value_per_channel_nor_moves_the_models_buffers(
        strategy: str, capfd: pytest.CaptureFixture[str]) -> None:
    model = _PooledNormAct()
    before = {name: b.clone() for name, b in model.named_buffers()}
    problems = STRATEGIES.get(strategy)().check_model(model, (1, 8, 8), GridShape(2, 1))
    # named by its module in one line (it once died in the probe, its stack printed)
    assert problems and all("\n" not in p for p in problems), problems
    assert all("Expected more than 1 value per channel" not in p for p in problems), problems
    assert "Traceback" not in capfd.readouterr().err
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name
