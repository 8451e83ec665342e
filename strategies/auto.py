"""`strategy=auto`: each layer of a sequential model in the layout that minimises the predicted
step time, chosen by dynamic programming over the chain of layers (`strategies.layouts.chain`).

The state of the programme is the layout of the activation between two layers. A layer's
options are its layouts (or, for a layer without any, the layouts it can run in as given);
moving from a state to an option's input costs the redistribution, the option costs its own
communication, its gradient exchange and its compute, and leaves the activation in its output
layout. The model's input arrives as `rows` and its output must leave as `samples` (the row
contract), so the programme starts at one state and ends with the conversion to the other.
Exact for a chain: every cost depends only on the layouts on either side of it.

Predicted time is compute (this machine's calibrated rates, `runner.cost.compute`, slowed by
ranks sharing cores) plus the α–β time of every operation rank 0 issues. A user pins a layer's
layout by name (`strategy.layouts={fc1: 2d}`); the programme chooses the rest.

A model that is not a chain (a module tree: ResNets, a user's own modules) has branches whose
layouts would have to agree where they join; there `auto` compares the whole-model layouts of
`model`, `grid` and `domain` over the tree (`strategies.layers.tree`), pure data parallelism
and, for a model with a parallel plan by module name (declared by the model or derived from its
structure: `strategies.plans.module_plan`), `model` and `grid` by that plan, by the same
predicted step time, and uses the fastest; the summary and the planner say which, and every
candidate's predicted time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from runner.core import GridShape, ProcessGrid
from runner.cost.collectives import CommOp
from strategies.base import DEFAULT_PRICING, ParallelModel, PricingContext, Strategy
from strategies.exchange.buckets import predict_gradient_ops
from strategies.grid import GridParallel
from strategies.layers.spatial import windowed_problem
from strategies.layers.split import layer_label
from strategies.layouts.chain import (
    LayerPlan,
    PlanCosts,
    Pricing,
    Step,
    build_layered_model,
    layer_names,
    layout_problems,
    passthrough_options,
    step_param_groups,
)
from strategies.layouts.layer import (
    BATCH_ONLY,
    IMAGE_LAYOUTS,
    ROWS,
    SAMPLES,
    SPATIAL,
    TILES_HW,
    LayerLayout,
    TensorLayout,
    layer_kind,
    layouts_for,
)
from strategies.plans.costs import PlannedModule
from strategies.plans.module_plan import PlannedModel
from strategies.probe import random_draws
from strategies.registry import STRATEGIES, register_strategy

TREE_CHOICES = ("data", "grid", "model", "domain")
# those that split a model with a plan by module name by it, priced with it and without
PLANNED_CHOICES = ("grid", "model")


@dataclass(frozen=True)
class Option:
    """A way to run a layer: in a layer layout (None: as a layer without any, in the layout
    its input is given) on input laid out as `takes`, giving `gives`."""

    layout: LayerLayout | None
    takes: TensorLayout
    gives: TensorLayout
    passthrough: str = "keep"  # how a layer without layer layouts is described (`Step`)


@dataclass(frozen=True)
class Choice:
    """A plan and what it is predicted to cost rank 0 per step."""

    plan: LayerPlan
    seconds: float


def _options(layer: nn.Module, i: int, name: str, pricing: Pricing,
             pins: Mapping[str, str]) -> list[Option]:
    """The ways layer i can run."""

    def fits(layout: TensorLayout) -> bool:
        """A layout splitting the image in space needs a row (and column) on every rank of
        the layer's input and output."""
        return layout not in SPATIAL or (_fits(pricing, i, layout) and
                                         _fits(pricing, i + 1, layout))

    if layer_kind(layer) is not None:
        options = []
        for layout in layouts_for(layer):
            if name in pins and pins[name] != layout.name:
                continue
            if layout.takes in SPATIAL and not (fits(layout.takes) and _windowed_ok(layer)):
                continue
            options.append(Option(layout, layout.takes, layout.gives))
        return options
    ndim = len(pricing.shapes[i]) + 1
    if ndim == len(pricing.shapes[i + 1]) + 1 and ndim in (2, 4):
        return [Option(None, t, t) for t in passthrough_options(layer, ndim) if fits(t)]
    # a layer that changes the rank of its tensor (Flatten): on whole samples
    return [Option(None, t, t, "batch") for t in BATCH_ONLY]


def _fits(pricing: Pricing, i: int, layout: TensorLayout) -> bool:
    shape = pricing.shapes[i]
    if len(shape) != 3:
        return False
    return shape[1] >= pricing.grid.pr and (layout != TILES_HW or shape[2] >= pricing.grid.pc)


def _windowed_ok(layer: nn.Module) -> bool:
    return not isinstance(layer, nn.Conv2d) or windowed_problem(layer) is None


def choose_plan(model: nn.Sequential, pricing: Pricing,
                pins: Mapping[str, str] | None = None) -> Choice:
    """The plan of least predicted step time (pinned layers keep their layouts)."""
    pins = dict(pins or {})
    names = layer_names(model)
    layers = list(model)
    conversions: dict[tuple[int, TensorLayout, TensorLayout], float] = {}
    costs_of: dict[tuple[int, LayerLayout | None, TensorLayout], float] = {}

    def seconds(costs: PlanCosts) -> float:
        return costs.compute_s * pricing.slowdown + pricing.seconds(costs.ops)

    def convert(i: int, src: TensorLayout, dst: TensorLayout) -> float:
        key = (i, src, dst)
        if key not in conversions:
            conversions[key] = seconds(pricing.conversion(src, dst, i, "convert"))
        return conversions[key]

    best: dict[TensorLayout, tuple[float, tuple[Step, ...]]] = {ROWS: (0.0, ())}
    for i, layer in enumerate(layers):
        options = _options(layer, i, names[i], pricing, pins)
        reached: dict[TensorLayout, tuple[float, tuple[Step, ...]]] = {}
        for state, (so_far, steps) in best.items():
            for option in options:
                takes, gives = option.takes, option.gives
                key = (i, option.layout, takes)
                if key not in costs_of:
                    costs_of[key] = seconds(pricing.layer(i, option.layout, takes))
                total = so_far + convert(i, state, takes) + costs_of[key]
                if gives not in reached or total < reached[gives][0]:
                    # a layout laid out alike on this grid needs no conversion: none is built
                    before = state if pricing.differ(state, takes, i) else takes
                    step = Step(i, option.layout, before, takes, gives, option.passthrough)
                    reached[gives] = (total, (*steps, step))
        if not reached:
            raise ValueError(f"layer {names[i]} ({type(layer).__name__}) has no layout here")
        best = reached
    end = len(layers)
    final = min(best, key=lambda s: best[s][0] + convert(end, s, SAMPLES))
    total, steps = best[final]
    return Choice(LayerPlan(steps, final if pricing.differ(final, SAMPLES, end) else SAMPLES),
                  total + convert(end, final, SAMPLES))


def plan_ops(model: nn.Sequential, plan: LayerPlan, pricing: Pricing) -> list[CommOp]:
    """Every operation rank 0 issues per step under `plan`, in the buckets the built model
    makes (what the counted communicator records)."""
    layers = list(model)
    ops: list[CommOp] = []
    grads: dict[str, list[tuple[str, list[tuple[int, torch.dtype]]]]] = {
        "batch": [], "world": [], "self": []}
    for step in plan.steps:
        layer = layers[step.index]
        label = layer_label(step.index, layer)
        ops += pricing.conversion(step.before, step.takes, step.index, label).ops
        costs = pricing.layer(step.index, step.layout, step.takes)
        ops += [op for op in costs.ops if op.op != "iallreduce"]  # buckets below instead
        for group, items in step_param_groups(layer, step, pricing.grid).items():
            if items:
                grads[group].append((label, items))
    ops += pricing.conversion(plan.final, SAMPLES, len(layers), "output").ops
    sizes = {"batch": pricing.grid.pc, "world": pricing.grid.size, "self": 1}
    for group in ("batch", "world"):
        ops += predict_gradient_ops(grads[group], group, sizes[group],  # type: ignore[arg-type]
                                    *pricing.caps)
    return ops


def plan_compute_seconds(model: nn.Sequential, plan: LayerPlan, pricing: Pricing) -> float:
    """Rank 0's compute per step under `plan` (conversions' packing included), unslowed."""
    total = 0.0
    for step in plan.steps:
        total += pricing.conversion(step.before, step.takes, step.index, "").compute_s
        total += pricing.layer(step.index, step.layout, step.takes).compute_s
    return total + pricing.conversion(plan.final, SAMPLES, len(list(model)), "").compute_s


@register_strategy("auto")
class AutoLayout(Strategy):
    """Per-layer layouts chosen by predicted step time (see the module docstring)."""

    # A layout may hold a weight on one rank only: no model group is a replica of its own.
    synchronous_only = True

    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 overlap: bool = True, layouts: dict[str, str] | None = None, *,
                 pricing: PricingContext = DEFAULT_PRICING) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, pricing=pricing)
        self.overlap = overlap
        # config keys may come as ints (`layouts={3: 2d}`): layer names are strings
        self.pins = {str(k): str(v) for k, v in (layouts or {}).items()}
        self._plans: dict[tuple[object, ...], tuple[LayerPlan, Pricing]] = {}
        self._trees: dict[tuple[object, ...], Strategy] = {}
        self._tree_labels: dict[tuple[object, ...], str] = {}
        self._tree_reasons: dict[tuple[object, ...], str] = {}
        self._random_draws: dict[tuple[object, ...], list[str]] = {}

    def splits_parameters(self, grid: GridShape) -> bool:
        return grid.size > 1  # a 2-D layout splits weights over the batch group too

    def plan_pricing(self, model: nn.Sequential, sample_shape: Sequence[int], grid: GridShape,
                     global_batch: int) -> Pricing:
        """What each step of a plan for `model` costs, at this strategy's pricing context."""
        return Pricing(model, sample_shape, grid, global_batch, self.pricing, self.bucket_caps)

    def choose(self, model: nn.Sequential, sample_shape: Sequence[int], grid: GridShape,
               global_batch: int) -> Choice:
        return choose_plan(model, self.plan_pricing(model, sample_shape, grid, global_batch),
                           self.pins)

    def _tree_choice(self, model: nn.Module, sample_shape: tuple[int, ...],
                     grid: GridShape, global_batch: int) -> Strategy:
        """For a module tree: the whole-model strategy of least predicted step time among
        those that can run it here."""
        # predictions, the summary and the planner ask for the same choice in turn; each
        # candidate's prediction traces the tree
        key = (repr(model), tuple(sample_shape), grid, global_batch)
        if key in self._trees:
            return self._trees[key]
        best: tuple[float, Strategy, str] | None = None
        refusals: list[str] = []
        priced: list[tuple[str, float]] = []
        with torch.random.fork_rng(devices=[]):  # pricing builds layers: the run's draws stay
            for name in TREE_CHOICES:
                for planned in ((True, False) if name in PLANNED_CHOICES else (None,)):
                    found = self._price(name, model, sample_shape, grid, global_batch,
                                        refusals, planned)
                    if found is None:
                        continue
                    priced.append((found[2], found[0]))
                    if best is None or found[0] < best[0]:
                        best = found
        if best is None:
            raise ValueError(f"no strategy runs {type(model).__name__} on grid.pr={grid.pr} x "
                             f"grid.pc={grid.pc}: {'; '.join(refusals)}; strategy=data trains "
                             f"it whole on grid.pr=1 grid.pc={grid.size}")
        self._trees[key] = best[1]
        others = ", ".join(f"{label} {seconds * 1e3:,.3f} ms" for label, seconds in priced
                           if label != best[2])
        self._tree_labels[key] = best[2]
        self._tree_reasons[key] = (f"{best[2]}: {best[0] * 1e3:,.3f} ms predicted per step, the "
                                   f"fastest" + (f" ({others})" if others else ""))
        return best[1]

    def tree_choice(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> tuple[Strategy, str, str]:
        """For a module tree: the chosen strategy, its name as the summary shows it (with the
        source of its plan, if it splits by one) and why (every candidate's predicted step)."""
        chosen = self._tree_choice(model, sample_shape, grid, global_batch)
        key = (repr(model), tuple(sample_shape), grid, global_batch)
        return chosen, self._tree_labels[key], self._tree_reasons[key]

    def reproduces_random_draws(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape) -> bool:
        if isinstance(model, nn.Sequential) or self.pricing.global_batch is None:
            return grid.size == 1
        chosen = self._tree_choice(model, sample_shape, grid, self.pricing.global_batch)
        return chosen.reproduces_random_draws(model, sample_shape, grid)

    def draws_rows_alike(self, model: nn.Module, sample_shape: tuple[int, ...],
                         grid: GridShape) -> bool:
        if isinstance(model, nn.Sequential) or self.pricing.global_batch is None:
            return False
        chosen = self._tree_choice(model, sample_shape, grid, self.pricing.global_batch)
        return chosen.draws_rows_alike(model, sample_shape, grid)

    def _price(self, name: str, model: nn.Module, sample_shape: tuple[int, ...],
               grid: GridShape, global_batch: int, refusals: list[str],
               planned: bool | None = None) -> tuple[float, Strategy, str] | None:
        """Strategy `name`'s predicted step time for the whole model, the strategy and its
        label, or None (its first reason then joins `refusals`). `planned`: by the model's
        plan by module name (None where it has none), or by the torch.fx rules."""
        strategy = STRATEGIES.get(name)(
            self.bucket_cap_bytes / (1 << 20), self.first_bucket_bytes / (1 << 20),
            pricing=replace(self.pricing, global_batch=global_batch))
        label = name
        if planned is not None and isinstance(strategy, GridParallel):
            plan = strategy.module_plan(model, sample_shape, grid.pr)
            if planned:
                if plan is None:
                    return None
                label = f"{name} by the plan {plan.source}"
            else:
                strategy.use_plans = False
                label = f"{name} by torch.fx rules" if plan is not None else name
        why = strategy.check(grid, global_batch) or strategy.check_model(model, sample_shape, grid)
        if not why and not strategy.reproduces_random_draws(model, sample_shape, grid):
            draws = self._draws(model, sample_shape)
            if draws:  # validation would refuse it: a candidate only where it runs
                why = [f"{label} draws random numbers per rank ({draws[0]})"]
        if why:
            refusals.append(why[0])
            return None
        return (strategy.predict_step_seconds(model, sample_shape, grid, global_batch),
                strategy, label)

    def _draws(self, model: nn.Module, sample_shape: tuple[int, ...]) -> list[str]:
        """The model's random draws in a training forward (`probe.random_draws`), once."""
        key = (repr(model), tuple(sample_shape))
        if key not in self._random_draws:
            self._random_draws[key] = random_draws(model, sample_shape)
        return self._random_draws[key]

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        if not isinstance(model, nn.Sequential):
            if self.pins:
                return ["strategy.layouts pins layers of an nn.Sequential; this model is a "
                        f"{type(model).__name__} (auto picks one layout for all of it)"]
            if self.pricing.global_batch is None:
                return []
            try:  # where grid.pr = 1 strategy=data is always a choice
                self._tree_choice(model, sample_shape, grid, self.pricing.global_batch)
            except ValueError as exc:
                return [f"strategy=auto: {exc}"]
            return []
        problems = layout_problems(model, sample_shape, grid, self.pins)
        if problems or self.pricing.global_batch is None:
            return problems
        try:
            self.choose(model, sample_shape, grid, self.pricing.global_batch)
        except ValueError as exc:
            problems.append(f"strategy=auto: {exc}")
        return problems

    def _plan(self, model: nn.Sequential, sample_shape: Sequence[int], grid: GridShape,
              global_batch: int | None) -> tuple[LayerPlan, Pricing]:
        batch = global_batch if global_batch is not None else self.pricing.global_batch
        if batch is None:
            raise ValueError("strategy=auto needs the global batch size to choose layouts")
        # the planner asks for ops, bytes, compute and layouts of one plan in turn
        key = (repr(model), tuple(sample_shape), grid, batch, tuple(sorted(self.pins.items())))
        if key not in self._plans:
            pricing = self.plan_pricing(model, sample_shape, grid, batch)
            self._plans[key] = (choose_plan(model, pricing, self.pins).plan, pricing)
        return self._plans[key]

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        if not sync_replica_gradients:
            raise ValueError("strategy=auto lays layers out over the whole grid: it trains with "
                             "synchronous optimizers only (a model group is no replica here)")
        if not isinstance(model, nn.Sequential):
            batch = self.pricing.global_batch
            assert batch is not None
            chosen, label, why = self.tree_choice(model, sample_shape, grid.shape, batch)
            whole = chosen.parallelize(model, sample_shape, grid, sync_replica_gradients)
            styles = getattr(whole, "layouts", None) if isinstance(whole, PlannedModel) else None
            whole.layouts = {"(whole model)": label,  # type: ignore[assignment]
                             **(styles or {})}
            whole.auto_choice = why  # type: ignore[assignment]
            return whole
        plan, _ = self._plan(model, sample_shape, grid.shape, None)
        # Every rank must build the same plan (a calibration file differing between hosts
        # would otherwise make them disagree): rank 0's layouts are pinned on all.
        names = layer_names(model)
        mine = plan.layer_layouts(names)
        agreed = grid.world.allgather_object(mine)[0]
        if agreed != mine:
            saved, self.pins = self.pins, agreed
            plan, _ = self._plan(model, sample_shape, grid.shape, None)
            self.pins = saved
        pmodel = build_layered_model(model, sample_shape, grid, plan, self.bucket_caps,
                                     self.overlap)
        pmodel.layouts = plan.layer_layouts(names)
        return pmodel

    def describe_plan(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                      global_batch: int) -> dict[str, str]:
        """Layer name → chosen layout (for the planner and the summary)."""
        if not isinstance(model, nn.Sequential):
            return {"(whole model)": self.tree_choice(model, sample_shape, grid,
                                                      global_batch)[1]}
        plan, _ = self._plan(model, sample_shape, grid, global_batch)
        return plan.layer_layouts(layer_names(model))

    def plan_modules(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                     global_batch: int) -> tuple[str, list[PlannedModule]] | None:
        """The chosen strategy's plan by module name, for a module tree split by one (see
        `GridParallel.plan_modules`)."""
        if isinstance(model, nn.Sequential):
            return None
        chosen = self._tree_choice(model, sample_shape, grid, global_batch)
        if not isinstance(chosen, GridParallel):
            return None
        return chosen.plan_modules(model, sample_shape, grid, global_batch)

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        if not isinstance(model, nn.Sequential):
            chosen = self._tree_choice(model, sample_shape, grid, global_batch)
            return chosen.predict_ops(model, sample_shape, grid, global_batch)
        plan, pricing = self._plan(model, sample_shape, grid, global_batch)
        return plan_ops(model, plan, pricing)

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if not isinstance(model, nn.Sequential):
            chosen = self._tree_choice(model, sample_shape, grid, global_batch)
            return chosen.predict_compute_seconds(model, sample_shape, grid, global_batch)
        plan, pricing = self._plan(model, sample_shape, grid, global_batch)
        return plan_compute_seconds(model, plan, pricing)

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        batch = self.pricing.global_batch or grid.size
        if not isinstance(model, nn.Sequential):
            chosen = self._tree_choice(model, sample_shape, grid, batch)
            return chosen.predict_param_bytes(model, sample_shape, grid)
        plan, _ = self._plan(model, sample_shape, grid, batch)
        layers = list(model)
        total = 0
        for step in plan.steps:
            layer = layers[step.index]
            total += sum(n for items in step_param_groups(layer, step, grid).values()
                         for n, _ in items)
        return total

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if not isinstance(model, nn.Sequential):
            chosen = self._tree_choice(model, sample_shape, grid, global_batch)
            return chosen.predict_activation_bytes(model, sample_shape, grid, global_batch)
        plan, pricing = self._plan(model, sample_shape, grid, global_batch)
        total = 0
        for step in plan.steps:
            i = step.index
            if step.before != step.takes:
                total += _elements(pricing.local_shape(step.takes, i)) * pricing.itemsizes[i]
            total += (_elements(pricing.local_shape(step.gives, i + 1))
                      * pricing.itemsizes[i + 1])
        return total


def _elements(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["IMAGE_LAYOUTS", "AutoLayout", "Choice", "choose_plan", "plan_ops"]
