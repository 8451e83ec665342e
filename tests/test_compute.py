"""The compute-time model (runner.cost.compute, runner.cost.layers) and its rates' storage, on
hand-made rates (no calibration runs here)."""

from __future__ import annotations

import dataclasses
import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.cost.compute import (
    DEFAULT_RATES,
    FRESH_ALLOCATION,
    ComputeRates,
    ConvShape,
    curve_seconds,
    make_curve,
    make_gemm_table,
    matmul_seconds,
    oversubscription,
    pass_seconds,
)
from runner.cost.layers import (
    conv_layer_seconds,
    layer_seconds,
    linear_seconds,
    loss_seconds,
    output_shape,
)

RATES = ComputeRates(
    gemm=make_gemm_table({16: [(1e4, 1e9), (1e6, 2e10), (1e8, 4e10)],
                          256: [(3e7, 8e10), (1e9, 1e11)]}),
    conv=make_curve([(1e5, 2e9), (1e7, 5e10), (1e9, 1e11)]),
    memory=1e10,
    dispatch=2e-6,
    conv_narrow=make_curve([(1e5, 1e9), (1e8, 4e10)]),
    conv_backward=(1.0, 1.2),
    conv_narrow_backward=(4.0, 1.0),
    source="hand-made",
)


def test_a_curve_is_sorted_and_never_faster_for_more_flops() -> None:
    curve = make_curve([(1e8, 5e10), (1e4, 1e9), (1e6, 1e11)])  # 1e6 faster than 1e8 would be
    assert [f for f, _ in curve] == [1e4, 1e6, 1e8]
    times = [f / r for f, r in curve]
    assert times == sorted(times)
    with pytest.raises(ValueError):
        make_curve([])
    with pytest.raises(ValueError):
        make_curve([(1e4, 0.0)])


def test_interpolation_is_monotone_and_clamped() -> None:
    curve = make_curve([(1e4, 1e9), (1e6, 2e10), (1e8, 4e10)])
    flops = [10 ** (e / 4) for e in range(8, 44)]  # 1e2 .. 3e10
    seconds = [curve_seconds(curve, f) for f in flops]
    assert all(a <= b for a, b in pairwise(seconds))
    # on the points: the points; between: between them, log-log
    assert curve_seconds(curve, 1e6) == pytest.approx(1e6 / 2e10)
    assert 1e4 / 1e9 < curve_seconds(curve, 1e5) < 1e6 / 2e10
    assert curve_seconds(curve, 1e5) == pytest.approx((1e4 / 1e9 * 1e6 / 2e10) ** 0.5)
    # below the smallest point its time (a fixed cost), above the largest its rate
    assert curve_seconds(curve, 10) == curve_seconds(curve, 1e4) == pytest.approx(1e-5)
    assert curve_seconds(curve, 10, floor=False) == pytest.approx(10 / 1e9)
    assert curve_seconds(curve, 1e10) == pytest.approx(1e10 / 4e10)
    assert curve_seconds(curve, 0) == 0.0


def test_products_of_few_rows_run_below_the_peak() -> None:
    # per flop, 16 rows are slower than 256 (the weights are reused less)
    few, many = RATES.gemm_seconds(16, 1024, 1024), RATES.gemm_seconds(256, 1024, 1024)
    assert few / (16 * 1024 * 1024) > many / (256 * 1024 * 1024)
    # between the bands: between them; and the time grows with the rows
    rows = [1, 2, 8, 16, 32, 64, 128, 256, 512, 1024]
    seconds = [RATES.gemm_seconds(m, 1024, 1024) for m in rows]
    assert all(a < b for a, b in pairwise(seconds))
    # the smallest dimension decides, wherever it is
    assert RATES.gemm_seconds(1024, 16, 1024) == RATES.gemm_seconds(16, 1024, 1024)
    assert matmul_seconds(16, 1024, 1024, RATES) == pytest.approx(few + RATES.dispatch)
    # a single band (plain points) prices every shape
    single = dataclasses.replace(RATES, gemm=make_gemm_table([(1e4, 1e9), (1e8, 1e10)]))
    assert single.gemm_seconds(1, 1000, 5000) == pytest.approx(1e7 / (1e9 * 10 ** 0.75))


def test_layer_seconds_grow_with_the_batch() -> None:
    cases = [(nn.Linear(256, 128), (256,)), (nn.Conv2d(16, 32, 3, padding=1), (16, 16, 16)),
             (nn.Conv2d(3, 16, 5), (3, 32, 32)), (nn.ReLU(), (32, 16, 16)),
             (nn.BatchNorm2d(32), (32, 16, 16)), (nn.MaxPool2d(2), (32, 16, 16)),
             (nn.GELU(), (512,)), (nn.LayerNorm(512), (512,)), (nn.Dropout(0.5), (512,)),
             (nn.AdaptiveAvgPool2d(1), (32, 8, 8))]
    for layer, sample in cases:
        seconds = [layer_seconds(layer, (batch, *sample), RATES) for batch in (4, 16, 64, 256)]
        assert all(0 < a < b for a, b in pairwise(seconds)), layer
        # large work: nearly proportional
        assert seconds[-1] / seconds[-2] > 1.5, layer


def test_layer_seconds_shrink_with_the_shards() -> None:
    whole = layer_seconds(nn.Linear(1024, 1024), (64, 1024), RATES)
    out_shard = layer_seconds(nn.Linear(1024, 256, device="meta"), (64, 1024), RATES)
    in_shard = layer_seconds(nn.Linear(256, 1024, device="meta"), (64, 256), RATES)
    assert out_shard < whole and in_shard < whole
    assert out_shard > whole / 4 / 2  # a shard's products run below the whole one's rate
    conv = nn.Conv2d(32, 64, 3, padding=1)
    whole = layer_seconds(conv, (32, 32, 16, 16), RATES)
    filters = layer_seconds(nn.Conv2d(32, 16, 3, padding=1, device="meta"), (32, 32, 16, 16),
                            RATES)
    slab = layer_seconds(conv, (32, 32, 4 + 2, 16), RATES)  # a height slab with its halo
    assert filters < whole and slab < whole


def test_without_the_input_gradient_a_layer_is_cheaper() -> None:
    for layer, shape in [(nn.Linear(512, 512), (64, 512)),
                         (nn.Conv2d(3, 32, 3, padding=1), (32, 3, 32, 32)),
                         (nn.Conv2d(32, 32, 3, padding=1), (32, 32, 16, 16)),
                         (nn.ReLU(), (64, 512))]:
        assert layer_seconds(layer, shape, RATES, input_grad=False) \
            < layer_seconds(layer, shape, RATES), layer
    m, k, n = 64, 512, 512
    skipped = linear_seconds(m, k, n, RATES) - linear_seconds(m, k, n, RATES, input_grad=False)
    assert skipped == pytest.approx(RATES.gemm_seconds(m, n, k))
    # a narrow convolution's input gradient is dear (4 forwards here)
    conv = nn.Conv2d(3, 32, 3, padding=1)
    shape = ConvShape(32, 3, 32, (32, 32), (3, 3))
    with_grad = conv_layer_seconds(shape, RATES)
    without = conv_layer_seconds(shape, RATES, input_grad=False)
    forward = RATES.conv_seconds(shape)
    assert with_grad - without == pytest.approx(4 * forward)
    assert layer_seconds(conv, (32, 3, 32, 32), RATES) == pytest.approx(with_grad)


def test_small_layers_cost_their_dispatch() -> None:
    slow = dataclasses.replace(RATES, dispatch=1e-3, linear_overhead=1e-3, conv_overhead=1e-3)
    for layer, shape in ((nn.Linear(4, 4), (2, 4)), (nn.ReLU(), (2, 4)),
                         (nn.BatchNorm1d(4), (2, 4)), (nn.Flatten(), (2, 4)),
                         (nn.Conv2d(2, 2, 3), (1, 2, 4, 4))):
        fast_s, slow_s = (layer_seconds(layer, shape, r) for r in (RATES, slow))
        assert slow_s >= 1e-3 > fast_s, layer
    assert layer_seconds(nn.Identity(), (2, 4), RATES) == 0.0
    assert layer_seconds(nn.Dropout(0.5).eval(), (64, 4096), RATES) == RATES.dispatch
    assert pass_seconds(1e6, RATES, calls=2) == pytest.approx(1e-4 + 2 * RATES.dispatch)


def test_unknown_layers_and_module_trees_are_priced() -> None:
    class Scale(nn.Module):  # an unknown leaf with a parameter
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(256, 256))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    class Plain(nn.Module):  # an unknown leaf without
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    class Block(nn.Module):  # a residual block: a module tree, not a Sequential
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(16, 16, 3, padding=1)
            self.norm = nn.BatchNorm2d(16)
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.norm(self.conv(x)) + x)

    shape = (64, 256)
    assert layer_seconds(Scale(), shape, RATES) > layer_seconds(Plain(), shape, RATES) > 0
    # as dense a layer as a Linear of as many weights: not cheaper than one
    assert layer_seconds(Scale(), shape, RATES) >= layer_seconds(nn.Linear(256, 256), shape,
                                                                 RATES)
    block, image = Block(), (8, 16, 16, 16)
    leaves = sum(layer_seconds(m, image, RATES) for m in (block.conv, block.norm, block.act))
    assert layer_seconds(block, image, RATES) > leaves
    # a Sequential is its layers in turn, each on its input's shape
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(8 * 15 * 15, 10))
    parts = [layer_seconds(model[0], (4, 3, 32, 32), RATES, input_grad=False),
             layer_seconds(model[1], (4, 8, 30, 30), RATES),
             layer_seconds(model[2], (4, 8, 30, 30), RATES),
             layer_seconds(model[3], (4, 8, 15, 15), RATES),
             layer_seconds(model[4], (4, 1800), RATES)]
    assert layer_seconds(model, (4, 3, 32, 32), RATES, input_grad=False) == \
        pytest.approx(sum(parts))
    assert output_shape(model, (4, 3, 32, 32)) == (4, 10)
    # token ids into an embedding: priced, its dense gradient's table included
    bag = nn.EmbeddingBag(10_000, 64)
    assert layer_seconds(bag, (32, 20), RATES) > RATES.elementwise_seconds(10_000 * 64 * 4)


def test_fresh_memory_is_priced_above_the_allocators_threshold() -> None:
    assert RATES.allocation_seconds(FRESH_ALLOCATION) == 0.0
    assert RATES.allocation_seconds(2 * FRESH_ALLOCATION) == \
        pytest.approx(2 * FRESH_ALLOCATION / RATES.fresh_memory)
    # a 4096² Linear's weight gradient (64 MiB) is mapped afresh every step
    big, small = (linear_seconds(64, 4096, 4096, r) for r in
                  (RATES, dataclasses.replace(RATES, fresh_memory=1e15)))
    assert big - small == pytest.approx(4096 * 4096 * 4 / RATES.fresh_memory, rel=1e-3)


def test_the_loss() -> None:
    assert loss_seconds(64, 10, RATES) > RATES.backward_start
    assert loss_seconds(256, 1000, RATES) > loss_seconds(64, 1000, RATES) \
        > loss_seconds(64, 10, RATES)


def test_oversubscription() -> None:
    assert oversubscription(1, 2) == 1.0
    assert oversubscription(2, 2) == 1.0
    assert oversubscription(4, 2) == 2.0
    assert oversubscription(3, 2) == 1.5
    assert oversubscription(2, 0) == 2.0  # no cores known: as one


def test_rates_round_trip_through_json() -> None:
    stored = json.loads(json.dumps(RATES.to_dict()))
    again = ComputeRates.from_dict(stored, source="calibrated (x)")
    assert again == dataclasses.replace(RATES, source="calibrated (x)")
    assert again.source == "calibrated (x)"
    # the defaults are well formed, and price what they are asked
    assert ComputeRates.from_dict(DEFAULT_RATES.to_dict()) == \
        dataclasses.replace(DEFAULT_RATES, source="calibrated")
    assert DEFAULT_RATES.source == "default"
    for kind in ("relu", "max_pool", "dropout", "cross_entropy"):
        assert DEFAULT_RATES.kind_seconds(kind, 1 << 20) > 0
    with pytest.raises(ValueError):
        DEFAULT_RATES.kind_seconds("nope", 1)
    with pytest.raises(KeyError):
        ComputeRates.from_dict({"conv": []})
    with pytest.raises(ValueError):
        ComputeRates.from_dict({**stored, "memory": -1})


def write_calibration(path: Path, compute: object | None) -> None:
    stored: dict[str, object] = {"collective": {"alpha": 1e-6, "beta": 1e-10}}
    if compute is not None:
        stored["compute"] = compute
    path.write_text(json.dumps(stored))


def test_load_compute_rates(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from runner.config.machine import load_compute_rates

    path = tmp_path / "calibration.json"
    monkeypatch.setenv("GRIDRUN_CALIBRATION", str(path))
    assert load_compute_rates() is DEFAULT_RATES  # not calibrated
    write_calibration(path, None)  # calibrated before compute rates were measured
    assert load_compute_rates() is DEFAULT_RATES
    write_calibration(path, RATES.to_dict())
    loaded = load_compute_rates()
    assert loaded == dataclasses.replace(RATES, source=f"calibrated ({path})")
    assert str(path) in loaded.source
    for broken in ("{not json", json.dumps({"compute": {"gemm": "x"}}),
                   json.dumps({"compute": {**RATES.to_dict(), "dispatch": "slow"}}),
                   json.dumps([1, 2])):
        path.write_text(broken)
        assert load_compute_rates() is DEFAULT_RATES, broken


class ScoredBlock(nn.Module):
    """Attention written in the block's own forward: its products, softmax and residual sum
    run between the leaf modules, where no leaf's price sees them."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return x + self.out(scores @ v)


def test_the_operators_between_leaves_are_recorded_with_their_owner_and_backward() -> None:
    from strategies.probe import operator_calls

    model = nn.Sequential(ScoredBlock(), nn.ReLU())
    found = operator_calls(model, (5, 16))
    names = [c.call.name for c in found]
    assert names.count("bmm") == 2 and "softmax" in names and "add" in names
    assert "relu" not in names and "addmm" not in names  # the leaves' own: priced as leaves
    assert all(c.owner is model[0] for c in found)  # run by the block's forward
    products = [c.call for c in found if c.call.name == "bmm"]
    assert products[0].shapes == ((1, 5, 16), (1, 16, 5)) and products[0].backward


def test_an_operator_is_priced_by_its_kind_on_the_rows_and_share_a_rank_runs() -> None:
    from runner.cost.layers import OperatorCall, operator_seconds

    product = OperatorCall("bmm", ((1, 64, 32), (1, 32, 64)), 0, backward=True)
    one, eight = operator_seconds(product, 1, RATES), operator_seconds(product, 8, RATES)
    assert eight == pytest.approx(8 * (one - 2 * RATES.dispatch) + 2 * RATES.dispatch)
    assert operator_seconds(product, 8, RATES, share=0.5) < eight  # half the heads
    forward_only = dataclasses.replace(product, backward=False)
    assert operator_seconds(forward_only, 8, RATES) < eight / 2  # one product of three
    view = OperatorCall("transpose", ((1, 64, 32),), 8192, backward=True)
    assert operator_seconds(view, 8, RATES) == 2 * RATES.dispatch  # no kernel
    mul = OperatorCall("mul", ((1, 64, 32), (1, 64, 32)), 3 * 8192, backward=True)
    assert operator_seconds(mul, 8, RATES) == pytest.approx(
        3 * RATES.elementwise_seconds(0.5 * 3 * 8192 * 8) + 2 * RATES.dispatch)
    attention = OperatorCall("_scaled_dot_product_flash_attention_for_cpu",
                             ((1, 4, 64, 8), (1, 4, 64, 8), (1, 4, 64, 8)), 0, backward=True)
    assert operator_seconds(attention, 8, RATES, share=0.5) < operator_seconds(attention, 8,
                                                                               RATES)


def test_a_step_prices_the_operators_a_forward_runs_between_its_leaves() -> None:
    from runner.core import GridShape
    from strategies import STRATEGIES, PricingContext

    data = STRATEGIES.get("data")(pricing=PricingContext(rates=RATES, global_batch=8))
    block = ScoredBlock()
    leaves_only = nn.Sequential(nn.Linear(16, 48), nn.Linear(16, 16))
    with_functions = data.predict_compute_seconds(block, (64, 16), GridShape(1, 1), 8)
    # the two Linears alone (the second on the first's input width: the same products)
    by_leaves = (layer_seconds(leaves_only[0], (8, 64, 16), RATES, input_grad=False)
                 + layer_seconds(leaves_only[1], (8, 64, 16), RATES))
    assert with_functions > by_leaves * 1.05  # the attention products and softmax


def test_an_optimizer_with_more_state_costs_more_passes_per_step() -> None:
    from runner.config.schema import Plugin
    from runner.training.assembly import optimizer_kind
    from strategies.base import UPDATE_PASSES, update_passes

    assert update_passes("sgd") == UPDATE_PASSES < update_passes("adam") < update_passes("adamw")
    assert optimizer_kind(Plugin("adamw")) == "adamw"
    assert optimizer_kind(Plugin("target", target="torch.optim.Adam")) == "adam"
