"""Per-layer layouts on the `Pr × Pc` grid: each layer of a sequential model in its own layout,
the activations moved between layouts by the core's general redistribution.

The integrated-parallelism paper prices each layer on its own; the linear-algebraic approach
(DistDL) partitions a layer's weight in two dimensions. Here every Linear and Conv2d gets one
of several layouts (`strategies.layouts.layer`: the activation layouts and the layer layouts),
each a rule that says how the layer's input must be laid out over the grid, how its output
comes out, which communication it does inside, and over which ranks its weights' gradients
are summed. Between two layers whose layouts disagree the activation is redistributed
(`runner.core.cartesian.redistribute`, whose adjoint is its backward), inside the model group
or the batch group when the other grid dimension is laid out alike on both sides.

Other layers keep the layout they are given where they can (activations anywhere; pooling
anywhere, with halos on slabs; BatchNorm where no rank holds a replica: statistics over the
ranks sharing its channels) and otherwise need the batch-only layouts `rows` or `samples`
(Flatten, Dropout, anything without a rule). A layer with parameters and no rule is refused.

The plan (`LayerPlan`) fixes a layout per layer and the conversions between; building the
model and predicting its communication both walk the same plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.cartesian import (
    CartesianPartition,
    redistribute,
    redistribute_recv_bytes,
    redistribute_send_bytes,
)
from runner.core.comm import GridGroup
from runner.cost.collectives import CommOp, comm_seconds, wait_seconds
from runner.cost.layers import layer_seconds
from strategies.base import ParallelModel, PricingContext, gradient_exchange
from strategies.layers.norm import (
    BATCH_NORMS,
    DistributedBatchNorm,
    batch_norm_comm_ops,
    batch_norm_problem,
)
from strategies.layers.spatial import WINDOWED, windowed_problem
from strategies.layers.split import (
    CHANNEL_LOCAL,
    activation_itemsize,
    layer_label,
    output_itemsizes,
    output_shapes,
)
from strategies.layouts.layer import (
    BATCH_ONLY,
    FLAT_LAYOUTS,
    IMAGE_LAYOUTS,
    NORM_LAYOUTS,
    ROWS,
    SAMPLES,
    SPATIAL,
    SPLIT,
    TILES_HW,
    C,
    HeldParams,
    LayerLayout,
    ParamGroups,
    R,
    TensorLayout,
    add_param,
    empty_groups,
    layer_kind,
    layout_named,
    layouts_for,
    spatial_halo_ops,
    spatial_module,
)

# A communication operator of the core (a torch.autograd.Function in Python) costs about this
# many framework dispatches forward and backward together, besides its data: 60 µs measured for
# a redistribution that moves nothing, at 2.4 µs a dispatch.
OPERATOR_CALLS = 25

# -- conversions between activation layouts ---------------------------------------------------


def needs_conversion(src: TensorLayout, dst: TensorLayout, shape: Sequence[int],
                     grid: tuple[int, int]) -> bool:
    """Whether some rank holds a different piece under `dst` than under `src`."""
    if src == dst:
        return False
    a, b = src.partition(shape, grid), dst.partition(shape, grid)
    return any(a.box(a.coords(rank)) != b.box(b.coords(rank)) for rank in range(a.size))


def conversion_group(src: TensorLayout, dst: TensorLayout) -> Literal["model", "batch", "world"]:
    """The smallest group a redistribution from `src` to `dst` stays inside: where grid dim C
    splits the same tensor dim outermost on both sides (or is a replica dim on both), data
    moves only between ranks of one batch index, the model group; likewise R for the batch
    group."""
    def alike(grid_dim: int) -> bool:
        a, b = src.position(grid_dim), dst.position(grid_dim)
        return a == b and (a is None or a[1] == 0)

    if alike(C):
        return "model"
    if alike(R):
        return "batch"
    return "world"


def group_partitions(src: TensorLayout, dst: TensorLayout, shape: Sequence[int],
                     grid: tuple[int, int], coords: tuple[int, int]
                     ) -> tuple[Literal["model", "batch", "world"], CartesianPartition,
                                CartesianPartition]:
    """The group of the redistribution and both partitions as that group sees them."""
    group = conversion_group(src, dst)
    a, b = src.partition(shape, grid), dst.partition(shape, grid)
    if group == "model":  # fix this rank's batch index: a partition over the model group
        return group, a.fix(C, coords[C]), b.fix(C, coords[C])
    if group == "batch":
        return group, a.fix(R, coords[R]), b.fix(R, coords[R])
    return group, a, b


def layer_names(model: nn.Sequential) -> list[str]:
    """Each layer's name in the model (its key in the Sequential: "0", "1", ... or the names
    an OrderedDict gave)."""
    return [name for name, _ in model.named_children()]


# -- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Layer `index` run in `layout` (a Linear's or Conv2d's; None for a layer without layer
    layouts, run in the layout its input is given), its input first redistributed from
    `before` to `takes` when they differ."""

    index: int
    layout: LayerLayout | None
    before: TensorLayout
    takes: TensorLayout
    gives: TensorLayout
    # how a layer without layer layouts is described: "keep" (as it is given its input) or
    # "batch" (whole samples: it changes the rank of its tensor)
    passthrough: str = "keep"

    @property
    def name(self) -> str:
        """The layout's name as the plan and the summary show it."""
        return self.layout.name if self.layout is not None else self.passthrough


@dataclass(frozen=True)
class LayerPlan:
    steps: tuple[Step, ...]
    final: TensorLayout  # the last layer's output layout, redistributed to `samples` at the end

    def describe(self, names: Sequence[str]) -> list[str]:
        return [f"{names[s.index]}: {s.name} ({s.takes}→{s.gives})" for s in self.steps]

    def layer_layouts(self, names: Sequence[str]) -> dict[str, str]:
        """Layer name → its layer layout's name, for the layers that have one."""
        return {names[s.index]: s.layout.name for s in self.steps if s.layout is not None}


def passthrough_options(layer: nn.Module, ndim: int) -> tuple[TensorLayout, ...]:
    """The layouts a layer without a layer layout can run in, as it is given them."""
    if isinstance(layer, BATCH_NORMS):
        return NORM_LAYOUTS if ndim == 4 else (SAMPLES, SPLIT)
    if isinstance(layer, CHANNEL_LOCAL):
        if isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)):
            return IMAGE_LAYOUTS if windowed_problem(layer) is None else (ROWS, SAMPLES, SPLIT)
        return IMAGE_LAYOUTS if ndim == 4 else FLAT_LAYOUTS
    return BATCH_ONLY  # Flatten, Dropout, anything else without parameters: whole samples


def passthrough_param_groups(layer: nn.Module, takes: TensorLayout, grid: GridShape
                             ) -> ParamGroups:
    """A layer without layer layouts, its input laid out as `takes`: its parameters (a
    BatchNorm's, the only such layer with any) by gradient group, as `param_groups` gives a
    layout's: on split channels a tile summed over the batch group, else whole over all."""
    groups = empty_groups()
    for name, param in layer.named_parameters():
        if takes == SPLIT:
            add_param(groups, layer, "batch", name, Partition(param.numel(), grid.pr).sizes[0])
        else:
            add_param(groups, layer, "world", name, param.numel())
    return groups


def step_param_groups(layer: nn.Module, step: Step, grid: GridShape) -> ParamGroups:
    """Rank 0's parameters of `layer` run as `step`, by gradient group."""
    if step.layout is not None:
        return step.layout.param_groups(layer, grid)
    return passthrough_param_groups(layer, step.takes, grid)


def layout_problems(model: nn.Sequential, sample_shape: Sequence[int], grid: GridShape,
                    pins: Mapping[str, str]) -> list[str]:
    """Every reason `model` cannot be laid out layer by layer (empty: it can)."""
    problems: list[str] = []
    names = layer_names(model)
    for name, layout in pins.items():
        if name not in names:
            problems.append(f"strategy.layouts: no layer named '{name}' (layers: "
                            f"{', '.join(names)})")
            continue
        layer = model[names.index(name)]
        known = [lay.name for lay in layouts_for(layer)]
        if layout not in known:
            problems.append(f"strategy.layouts.{name}={layout}: a {type(layer).__name__} takes "
                            f"{', '.join(known) or 'no layout (it has none to choose)'}")
    shapes = [tuple(sample_shape), *output_shapes(list(model), sample_shape)]
    for i, layer in enumerate(model):
        label = f"layer {names[i]} ({type(layer).__name__})"
        if isinstance(layer, nn.Conv2d) and layer.groups != 1:
            problems.append(f"{label} is a grouped convolution")
        elif isinstance(layer, BATCH_NORMS):
            problem = batch_norm_problem(layer)
            if problem is not None:
                problems.append(f"{label}: {problem}")
        elif layer_kind(layer) is None and any(True for _ in layer.parameters()):
            problems.append(f"{label} has parameters and no layout (Linear, Conv2d and "
                            f"BatchNorm have)")
        elif (isinstance(layer, nn.Conv2d)
              and (spatial := layout_named(layer, pins.get(names[i], ""))) is not None
              and spatial.takes in SPATIAL):
            problem = windowed_problem(layer)
            pinned = f"strategy.layouts.{names[i]}={spatial.name}"
            height = min(shapes[i][1], shapes[i + 1][1])
            width = min(shapes[i][2], shapes[i + 1][2])
            if problem is not None:
                problems.append(f"{label}: {problem}")
            elif height < grid.pr:
                problems.append(f"{label}: {pinned} splits height {height} over "
                                f"grid.pr={grid.pr}: every rank needs a row")
            elif spatial.takes == TILES_HW and width < grid.pc:
                problems.append(f"{label}: {pinned} splits width {width} over "
                                f"grid.pc={grid.pc}: every rank needs a column")
    return problems


# -- what a plan costs --------------------------------------------------------------------------


@dataclass
class PlanCosts:
    """What a layer or conversion costs rank 0 per step: operations and compute seconds."""

    ops: list[CommOp] = field(default_factory=list)
    compute_s: float = 0.0


class Pricing:
    """Prices steps of a plan for one model, grid and batch: communication from the α–β model
    (`costs`), compute from this machine's rates (`rates`), both from the strategy's pricing
    context."""

    def __init__(self, model: nn.Sequential, sample_shape: Sequence[int], grid: GridShape,
                 batch: int, context: PricingContext, bucket_caps: tuple[int, int]) -> None:
        self.layers = list(model)
        self.slowdown = context.slowdown
        self.grid_sizes = (grid.pc, grid.pr)
        self.grid, self.batch = grid, batch
        self.costs, self.rates, self.caps = context.costs, context.rates, bucket_caps
        self.shapes = [tuple(sample_shape), *output_shapes(self.layers, sample_shape)]
        self.itemsizes = output_itemsizes(self.layers, context.compute_dtype)
        self.stats_itemsize = activation_itemsize(self.layers)
        # the activation before layer i has a gradient exactly when a layer before it has
        # parameters: only then do its conversions run backward
        has_params = [any(True for _ in layer.parameters()) for layer in self.layers]
        self.grad_before = [any(has_params[:i]) for i in range(len(self.layers) + 1)]
        self._differ: dict[tuple[TensorLayout, TensorLayout, int], bool] = {}

    def global_shape(self, i: int) -> tuple[int, ...]:
        """The global activation before layer i (i = len: the model's output)."""
        return (self.batch, *self.shapes[i])

    def local_shape(self, layout: TensorLayout, i: int) -> tuple[int, ...]:
        return layout.partition(self.global_shape(i), self.grid_sizes).local_shape((0, 0))

    def seconds(self, ops: list[CommOp]) -> float:
        return comm_seconds(ops, self.costs) + wait_seconds(ops, self.costs, self.slowdown)

    def differ(self, src: TensorLayout, dst: TensorLayout, i: int) -> bool:
        """Whether the activation before layer i must move to go from `src` to `dst`."""
        key = (src, dst, i)
        if key not in self._differ:
            self._differ[key] = needs_conversion(src, dst, self.global_shape(i),
                                                 self.grid_sizes)
        return self._differ[key]

    def conversion(self, src: TensorLayout, dst: TensorLayout, i: int, label: str) -> PlanCosts:
        """Redistributing the activation before layer i from `src` to `dst` (nothing where
        both lay it out alike on this grid: `rows` is `samples` when Pr = 1)."""
        if not self.differ(src, dst, i):
            return PlanCosts()
        group, a, b = group_partitions(src, dst, self.global_shape(i), self.grid_sizes, (0, 0))
        size = a.size
        itemsize = self.itemsizes[i]
        sent, moves = redistribute_send_bytes(a, b, 0, itemsize)
        costs = PlanCosts()
        if moves:
            costs.ops.append(CommOp("alltoallv", group, size, sent, label))
            if self.grad_before[i]:
                costs.ops.append(CommOp("alltoallv", group, size,
                                        redistribute_recv_bytes(a, b, 0, itemsize)[0], label))
        # packing and unpacking: a pass over what moves, each way; the copy of what stays;
        # the operator's own calls forward and backward
        moved = sum(op.nbytes for op in costs.ops)
        local = math.prod(b.local_shape(b.coords(0))) * itemsize
        costs.compute_s = (self.rates.elementwise_seconds(2 * moved + local)
                           + OPERATOR_CALLS * self.rates.dispatch)
        return costs

    def layer(self, i: int, layout: LayerLayout | None, takes: TensorLayout) -> PlanCosts:
        """Layer i in `layout` (None: a layer without layer layouts) on input laid out as
        `takes`: its own communication, its gradient exchange, its compute."""
        layer, grid = self.layers[i], self.grid
        label = layer_label(i, layer)
        local_in = self.local_shape(takes, i)
        costs = PlanCosts()
        input_grad = self.grad_before[i]
        if layout is not None:
            partial_sums = layout.partial_sum_ops(layer, grid, local_in, self.itemsizes[i + 1],
                                                  label)
            if partial_sums:
                costs.compute_s += OPERATOR_CALLS * self.rates.dispatch  # the reduce-scatter's
            costs.compute_s += layer_seconds(layout.local_layer(layer, grid), local_in,
                                             self.rates, input_grad=input_grad)
            costs.ops += partial_sums
            costs.ops += self.gradient_ops(layout.param_groups(layer, grid), label)
            costs.ops += layout.halo_ops(layer, grid, local_in, self.shapes[i],
                                         self.itemsizes[i], label, input_grad)
            return costs
        costs.compute_s = layer_seconds(layer, local_in, self.rates, input_grad=input_grad)
        if isinstance(layer, WINDOWED):
            costs.ops += spatial_halo_ops(layer, takes, grid, local_in, self.shapes[i],
                                          self.itemsizes[i], label, input_grad)
        if isinstance(layer, BATCH_NORMS):
            group, size = norm_group(takes, grid)
            channels = self.local_shape(takes, i)[1]
            costs.ops += batch_norm_comm_ops(group, size, channels, self.stats_itemsize,
                                             f"bn:{i}")
            costs.ops += self.gradient_ops(passthrough_param_groups(layer, takes, grid), label)
        return costs

    def gradient_ops(self, groups: ParamGroups, label: str) -> list[CommOp]:
        """A layer's gradient all-reduces alone, its parameters by group as given (the plan's
        buckets merge them; this prices them for the choice)."""
        ops: list[CommOp] = []
        shared: tuple[tuple[Literal["world", "batch"], int], ...] = (
            ("world", self.grid.size), ("batch", self.grid.pc))
        for group, size in shared:
            items = groups[group]
            if size > 1 and items:
                ops.append(CommOp("iallreduce", group, size, sum(n for n, _ in items), label))
        return ops


def norm_group(layout: TensorLayout, grid: GridShape) -> tuple[GridGroup, int]:
    """The ranks a BatchNorm's statistics come from: those holding its channels."""
    if layout == SPLIT:
        return "batch", grid.pc
    return "world", grid.size

# -- the model a plan builds --------------------------------------------------------------------


class BatchRows:
    """The global batch of the current forward: a whole-batch layout needs every batch group's
    row count, which a rank's own rows do not say (`LayeredModel.input_rows` records it)."""

    def __init__(self) -> None:
        self.total: int | None = None


class Redistribute(nn.Module):
    """The activation before a layer, from one layout to another (over the smallest group)."""

    def __init__(self, src: TensorLayout, dst: TensorLayout, sample_shape: tuple[int, ...],
                 grid: ProcessGrid, rows: BatchRows, label: str) -> None:
        super().__init__()
        self.src, self.dst, self.sample_shape = src, dst, sample_shape
        self.grid, self.rows, self.label = grid, rows, label
        group = conversion_group(src, dst)
        self.comm = {"model": grid.model, "batch": grid.batch, "world": grid.world}[group]
        self._parts: dict[int, tuple[CartesianPartition, CartesianPartition]] = {}

    def extra_repr(self) -> str:
        return f"{self.src} → {self.dst} over {self.comm.name}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.rows.total
        if total is None:
            raise RuntimeError("LayeredModel.input_rows(global rows) must be called before a "
                               "forward: whole-batch layouts need the global batch")
        parts = self._parts.get(total)
        if parts is None:
            coords = (self.grid.batch_index, self.grid.model_index)
            _, a, b = group_partitions(self.src, self.dst, (total, *self.sample_shape),
                                       (self.grid.pc, self.grid.pr), coords)
            parts = self._parts[total] = (a, b)
        return redistribute(x, self.comm, parts[0], parts[1], label=self.label)


class LayeredModel(ParallelModel):
    """The layers of a `LayerPlan` and the conversions between them; ends on this rank's rows."""

    def __init__(self, grid: ProcessGrid, body: nn.Sequential, rows: BatchRows) -> None:
        super().__init__(grid)
        self.body, self.rows = body, rows
        self.layouts: dict[str, str] = {}  # layer name → its layout (for the summary)

    def input_rows(self, global_rows: int) -> slice:
        self.rows.total = global_rows
        return super().input_rows(global_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def build_layered_model(model: nn.Sequential, sample_shape: tuple[int, ...], grid: ProcessGrid,
                        plan: LayerPlan, bucket_caps: tuple[int, int],
                        overlap: bool = True) -> LayeredModel:
    layers = list(model)
    shapes = [tuple(sample_shape), *output_shapes(layers, sample_shape)]
    rows = BatchRows()
    modules: list[nn.Module] = []
    groups: HeldParams = {"world": [], "batch": [], "self": []}
    for step in plan.steps:
        i, layer = step.index, layers[step.index]
        label = layer_label(i, layer)
        if step.before != step.takes:  # (a no-op on this grid is never planned: see below)
            modules.append(Redistribute(step.before, step.takes, shapes[i], grid, rows, label))
        if step.layout is not None:
            built, held = step.layout.build(layer, grid, shapes[i], overlap, label)
        else:
            built, held = _build_passthrough(layer, step, grid, shapes[i], overlap)
        modules.append(built)
        for group, params in held.items():
            groups[group] += params
    if plan.final != SAMPLES:
        modules.append(Redistribute(plan.final, SAMPLES, shapes[-1], grid, rows, "output"))
    pmodel = LayeredModel(grid, nn.Sequential(*modules), rows)
    scale = 1.0 / grid.size
    comms = {"world": grid.world, "batch": grid.batch,
             "self": CountedComm(None, grid.counter, "self")}
    for group in ("batch", "world", "self"):
        pmodel.reducers += gradient_exchange(groups[group], comms[group], scale, *bucket_caps)
    return pmodel


def _build_passthrough(layer: nn.Module, step: Step, grid: ProcessGrid,
                       in_shape: tuple[int, ...], overlap: bool) -> tuple[nn.Module, HeldParams]:
    """This rank's module for a layer without layer layouts, and its parameters by gradient
    group."""
    if isinstance(layer, BATCH_NORMS):
        if step.takes == SPLIT:
            channels = Partition(layer.num_features, grid.pr).slice(grid.model_index)
            norm = DistributedBatchNorm(layer, grid.batch, f"bn:{step.index}", channels)
            return norm, {"batch": list(norm.parameters())}
        norm = DistributedBatchNorm(layer, grid.world, f"bn:{step.index}")
        return norm, {"world": list(norm.parameters())}
    if isinstance(layer, WINDOWED):
        return (spatial_module(layer, step.takes, grid, in_shape, overlap),
                {"world": list(layer.parameters())})
    return layer, {"world": list(layer.parameters())}
