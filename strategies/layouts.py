"""Per-layer layouts on the `Pr × Pc` grid: each layer of a sequential model in its own layout,
the activations moved between layouts by the core's general redistribution.

The integrated-parallelism paper prices each layer on its own; the linear-algebraic approach
(DistDL) partitions a layer's weight in two dimensions. Here every Linear and Conv2d gets one
of several layouts, each a rule that says how the layer's input must be laid out over the
grid, how its output comes out, which communication it does inside, and over which ranks its
weights' gradients are summed. Between two layers whose layouts disagree the activation is
redistributed (`runner.core.cartesian.redistribute`, whose adjoint is its backward), inside the
model group or the batch group when the other grid dimension is laid out alike on both sides.

Activation layouts (`TensorLayout`) over grid dims C (the batch group's index, `Pc` of them)
and R (the model group's, `Pr`); a tensor dim split over (C, R) is split over C first, then
each piece over R (the row contract of `strategies.base`):

    rows     batch over C; replicated over R        the model's input
    samples  batch over (C, R)                       batch-parallel; the model's output
    split    batch over C, features over R           a column-parallel (Megatron) output
    slab     batch over C, height over R             domain parallelism (images)
    tiles_hw whole batch, height over R, width over C   domain parallelism in two dims
    cols     whole batch, features over C            the input of a 2-D layer
    cols_t   whole batch, features over R            the input of a transposed 2-D layer
    tiles    whole batch, features over (R, C)       the output of a 2-D layer
    tiles_t  whole batch, features over (C, R)       the output of a transposed 2-D layer

Layer layouts (`LAYOUTS`):

    Linear  batch    samples → samples  W whole, gradient summed over all P
            row      rows → split       W's rows over R (today's `grid` layout)
            col      split → split      W's columns over R; partial outputs reduce-scattered
                                        over R by features (Megatron's row-parallel)
            col_rows split → samples    the same, reduce-scattered by rows
            2d       cols → tiles       W[rows over R, columns over C]: no gradient exchange;
                                        partials reduce-scattered over C (DistDL's layout,
                                        with reduce-scatter where DistDL sum-reduces to a root)
            2d_t     cols_t → tiles_t   W[rows over C, columns over R], partials over R
    Conv2d  batch    samples → samples
            filters  rows → split       output channels over R, batch over C (the paper's
                                        integrated convolution)
            domain   slab → slab        height over R with halo exchange, batch over C
            domain_hw tiles_hw → tiles_hw  height over R, width over C, halos in both

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
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.cartesian import (
    CartesianPartition,
    redistribute,
    redistribute_recv_bytes,
    redistribute_send_bytes,
)
from runner.core.comm import GridGroup
from runner.core.compute import ComputeRates, layer_seconds
from runner.core.cost import CommOp, MachineCosts, comm_seconds, wait_seconds
from runner.core.halo import HaloPlan
from runner.core.placement import place_block, place_rows
from runner.core.primitives import reduce_scatter
from strategies.base import ParallelModel, gradient_exchange
from strategies.norm import (
    BATCH_NORMS,
    DistributedBatchNorm,
    batch_norm_comm_ops,
    batch_norm_problem,
)
from strategies.sharded import (
    CHANNEL_LOCAL,
    ShardedConv2d,
    ShardedLinear,
    activation_itemsize,
    layer_label,
    output_itemsizes,
    output_shapes,
)
from strategies.spatial import (
    WINDOWED,
    SpatialWindowed,
    SpatialWindowed2D,
    height_window,
    width_window,
    windowed_problem,
)

C, R = 0, 1  # grid dims: a rank's coordinates are (batch_index, model_index)
GroupName = Literal["world", "model", "batch", "self"]

# -- activation layouts ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorLayout:
    """Which grid dims split an activation's batch (dim 0), features or channels (dim 1) and,
    for images, height (dim 2); grid dims in none of them hold replicas."""

    name: str
    batch: tuple[int, ...] = ()
    features: tuple[int, ...] = ()
    height: tuple[int, ...] = ()
    width: tuple[int, ...] = ()

    def splits(self, ndim: int) -> tuple[tuple[int, ...], ...]:
        if ndim < 4 and (self.height or self.width):
            raise ValueError(f"layout {self.name} splits an image, the tensor has {ndim} dims")
        return ((self.batch, self.features, self.height, self.width) + ((),) * ndim)[:ndim]

    def partition(self, shape: Sequence[int], grid: tuple[int, int]) -> CartesianPartition:
        """The global tensor of `shape` (batch first) over a grid of sizes (Pc, Pr)."""
        return CartesianPartition(tuple(shape), grid, self.splits(len(shape)))

    def position(self, grid_dim: int) -> tuple[int, int] | None:
        """(tensor dim, depth) at which `grid_dim` splits, None where it is a replica dim."""
        for tensor_dim, dims in enumerate((self.batch, self.features, self.height,
                                           self.width)):
            if grid_dim in dims:
                return tensor_dim, dims.index(grid_dim)
        return None

    @property
    def replicated(self) -> bool:
        return any(self.position(d) is None for d in (C, R))

    def __repr__(self) -> str:
        return self.name


ROWS = TensorLayout("rows", batch=(C,))
SAMPLES = TensorLayout("samples", batch=(C, R))
SPLIT = TensorLayout("split", batch=(C,), features=(R,))
SLAB = TensorLayout("slab", batch=(C,), height=(R,))
COLS = TensorLayout("cols", features=(C,))
COLS_T = TensorLayout("cols_t", features=(R,))
TILES = TensorLayout("tiles", features=(R, C))
TILES_T = TensorLayout("tiles_t", features=(C, R))
TILES_HW = TensorLayout("tiles_hw", height=(R,), width=(C,))
FLAT_LAYOUTS = (ROWS, SAMPLES, SPLIT, COLS, COLS_T, TILES, TILES_T)
IMAGE_LAYOUTS = (ROWS, SAMPLES, SPLIT, SLAB, TILES_HW)
SPATIAL = (SLAB, TILES_HW)  # an image split in space: windows need halos
BATCH_ONLY = (ROWS, SAMPLES)
# BatchNorm needs every rank to hold distinct data of its channels (a replica would hold a
# partial gradient of the weights that no exchange sums): the layouts without replicas.
NORM_LAYOUTS = (SAMPLES, SPLIT, SLAB, TILES_HW)


# A communication operator of the core (a torch.autograd.Function in Python) costs about this
# many framework dispatches forward and backward together, besides its data: 60 µs measured for
# a redistribution that moves nothing, at 2.4 µs a dispatch.
OPERATOR_CALLS = 25


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


# -- layer layouts ------------------------------------------------------------------------------

LayerKind = Literal["linear", "conv"]


@dataclass(frozen=True)
class LayerLayout:
    """A layout of a Linear or Conv2d: the input it needs and the output it gives."""

    name: str
    kind: LayerKind
    takes: TensorLayout
    gives: TensorLayout
    summary: str


LAYOUTS: dict[tuple[LayerKind, str], LayerLayout] = {
    (layout.kind, layout.name): layout for layout in (
        LayerLayout("batch", "linear", SAMPLES, SAMPLES, "batch-parallel, W whole"),
        LayerLayout("row", "linear", ROWS, SPLIT, "W's rows over Pr (1.5-D)"),
        LayerLayout("col", "linear", SPLIT, SPLIT, "W's columns over Pr, reduce-scatter"),
        LayerLayout("col_rows", "linear", SPLIT, SAMPLES,
                    "W's columns over Pr, reduce-scatter by rows"),
        LayerLayout("2d", "linear", COLS, TILES, "W in 2-D: rows over Pr, columns over Pc"),
        LayerLayout("2d_t", "linear", COLS_T, TILES_T,
                    "W in 2-D: rows over Pc, columns over Pr"),
        LayerLayout("batch", "conv", SAMPLES, SAMPLES, "batch-parallel, filters whole"),
        LayerLayout("filters", "conv", ROWS, SPLIT, "filters over Pr, batch over Pc"),
        LayerLayout("domain", "conv", SLAB, SLAB, "height over Pr (halos), batch over Pc"),
        LayerLayout("domain_hw", "conv", TILES_HW, TILES_HW,
                    "height over Pr, width over Pc (halos in both), whole batch"),
    )}
LAYOUT_NAMES = sorted({name for _, name in LAYOUTS})


def layer_kind(layer: nn.Module) -> LayerKind | None:
    if isinstance(layer, nn.Linear):
        return "linear"
    if isinstance(layer, nn.Conv2d) and layer.groups == 1:
        return "conv"
    return None


def layouts_for(layer: nn.Module) -> list[LayerLayout]:
    kind = layer_kind(layer)
    return [layout for (k, _), layout in LAYOUTS.items() if k == kind]


def layer_names(model: nn.Sequential) -> list[str]:
    """Each layer's name in the model (its key in the Sequential: "0", "1", ... or the names
    an OrderedDict gave)."""
    return [name for name, _ in model.named_children()]


# -- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Layer `index` run in `layout` (a LayerLayout's name for Linear/Conv2d, else "keep" or
    "batch"), its input first redistributed from `before` to `takes` when they differ."""

    index: int
    layout: str
    before: TensorLayout
    takes: TensorLayout
    gives: TensorLayout


@dataclass(frozen=True)
class LayerPlan:
    steps: tuple[Step, ...]
    final: TensorLayout  # the last layer's output layout, redistributed to `samples` at the end

    def describe(self, names: Sequence[str]) -> list[str]:
        return [f"{names[s.index]}: {s.layout} ({s.takes}→{s.gives})" for s in self.steps]


def passthrough_options(layer: nn.Module, ndim: int) -> tuple[TensorLayout, ...]:
    """The layouts a layer without a layer layout can run in, as it is given them."""
    if isinstance(layer, BATCH_NORMS):
        return NORM_LAYOUTS if ndim == 4 else (SAMPLES, SPLIT)
    if isinstance(layer, CHANNEL_LOCAL):
        if isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)):
            return IMAGE_LAYOUTS if windowed_problem(layer) is None else (ROWS, SAMPLES, SPLIT)
        return IMAGE_LAYOUTS if ndim == 4 else FLAT_LAYOUTS
    return BATCH_ONLY  # Flatten, Dropout, anything else without parameters: whole samples


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
        elif isinstance(layer, nn.Conv2d) and pins.get(names[i]) in ("domain", "domain_hw"):
            problem = windowed_problem(layer)
            pinned = f"strategy.layouts.{names[i]}={pins[names[i]]}"
            height = min(shapes[i][1], shapes[i + 1][1])
            width = min(shapes[i][2], shapes[i + 1][2])
            if problem is not None:
                problems.append(f"{label}: {problem}")
            elif height < grid.pr:
                problems.append(f"{label}: {pinned} splits height {height} over "
                                f"grid.pr={grid.pr}: every rank needs a row")
            elif pins[names[i]] == "domain_hw" and width < grid.pc:
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
    (`costs`), compute from this machine's rates (`rates`)."""

    def __init__(self, model: nn.Sequential, sample_shape: Sequence[int], grid: GridShape,
                 batch: int, costs: MachineCosts, rates: ComputeRates,
                 compute_dtype: torch.dtype | None, bucket_caps: tuple[int, int],
                 slowdown: float = 1.0) -> None:
        self.layers = list(model)
        self.slowdown = slowdown
        self.grid_sizes = (grid.pc, grid.pr)
        self.grid, self.batch = grid, batch
        self.costs, self.rates, self.caps = costs, rates, bucket_caps
        self.shapes = [tuple(sample_shape), *output_shapes(self.layers, sample_shape)]
        self.itemsizes = output_itemsizes(self.layers, compute_dtype)
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

    def layer(self, i: int, layout: str, takes: TensorLayout) -> PlanCosts:
        """Layer i in `layout` on input laid out as `takes`: its own communication, its
        gradient exchange, its compute."""
        layer, grid = self.layers[i], self.grid
        label = layer_label(i, layer)
        local_in = self.local_shape(takes, i)
        costs = PlanCosts()
        input_grad = self.grad_before[i]
        itemsize = self.itemsizes[i + 1]
        kind = layer_kind(layer)
        if kind is not None and partial_sum_ops(layer, layout, grid, local_in, 1, label):
            costs.compute_s += OPERATOR_CALLS * self.rates.dispatch  # the reduce-scatter's
        if kind is not None:
            built = local_layer(layer, layout, grid)
            costs.compute_s += layer_seconds(built, local_in, self.rates, input_grad=input_grad)
            costs.ops += partial_sum_ops(layer, layout, grid, local_in, itemsize, label)
            costs.ops += self.gradient_ops(layer, layout, label)
            if layout == "domain":
                costs.ops += halo_ops(layer, grid, local_in, self.shapes[i][1],
                                      self.itemsizes[i], label, input_grad)
            elif layout == "domain_hw":
                costs.ops += halo_ops_2d(layer, grid, local_in, self.shapes[i],
                                         self.itemsizes[i], label, input_grad)
            return costs
        costs.compute_s = layer_seconds(layer, local_in, self.rates, input_grad=input_grad)
        if isinstance(layer, WINDOWED) and takes == SLAB:
            costs.ops += halo_ops(layer, grid, local_in, self.shapes[i][1], self.itemsizes[i],
                                  label, input_grad)
        elif isinstance(layer, WINDOWED) and takes == TILES_HW:
            costs.ops += halo_ops_2d(layer, grid, local_in, self.shapes[i],
                                     self.itemsizes[i], label, input_grad)
        if isinstance(layer, BATCH_NORMS):
            group, size = norm_group(takes, grid)
            channels = self.local_shape(takes, i)[1]
            costs.ops += batch_norm_comm_ops(group, size, channels, self.stats_itemsize,
                                             f"bn:{i}")
            costs.ops += self.gradient_ops(layer, "norm:" + takes.name, label)
        return costs

    def gradient_ops(self, layer: nn.Module, layout: str, label: str) -> list[CommOp]:
        """The layer's gradient all-reduces alone (the plan's buckets merge them; this prices
        them for the choice)."""
        ops: list[CommOp] = []
        groups = param_groups_of(layer, layout, self.grid)
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


def local_layer(layer: nn.Module, layout: str, grid: GridShape) -> nn.Module:
    """A stand-in on the meta device with the shapes rank 0 computes with (for pricing)."""
    if isinstance(layer, nn.Linear):
        out_f, in_f = layer.out_features, layer.in_features
        if layout == "row":
            out_f = Partition(out_f, grid.pr).sizes[0]
        elif layout in ("col", "col_rows"):
            in_f = Partition(in_f, grid.pr).sizes[0]
        elif layout == "2d":
            out_f, in_f = Partition(out_f, grid.pr).sizes[0], Partition(in_f, grid.pc).sizes[0]
        elif layout == "2d_t":
            out_f, in_f = Partition(out_f, grid.pc).sizes[0], Partition(in_f, grid.pr).sizes[0]
        return nn.Linear(in_f, out_f, bias=layer.bias is not None, device="meta")
    assert isinstance(layer, nn.Conv2d)
    if layout != "filters":
        return layer
    return nn.Conv2d(layer.in_channels, Partition(layer.out_channels, grid.pr).sizes[0],
                     layer.kernel_size, layer.stride, layer.padding, layer.dilation,  # type: ignore[arg-type]
                     bias=layer.bias is not None, device="meta")


def partial_sum_ops(layer: nn.Module, layout: str, grid: GridShape,
                    local_in: tuple[int, ...], itemsize: int, label: str) -> list[CommOp]:
    """A layout whose local products are partial sums: the reduce-scatter forward and the
    all-gather of the gradient backward, each moving the whole partial output."""
    if not isinstance(layer, nn.Linear) or layout not in ("col", "col_rows", "2d", "2d_t"):
        return []
    group: GridGroup = "batch" if layout == "2d" else "model"
    size = grid.pc if layout == "2d" else grid.pr
    if size == 1:
        return []
    out_f = layer.out_features
    if layout == "2d":
        out_f = Partition(out_f, grid.pr).sizes[0]
    elif layout == "2d_t":
        out_f = Partition(out_f, grid.pc).sizes[0]
    n = local_in[0] * out_f * itemsize
    return [CommOp("reduce_scatter", group, size, n, label),
            CommOp("allgather", group, size, n, label)]


def halo_ops(layer: nn.Module, grid: GridShape, local_in: tuple[int, ...], height: int,
             itemsize: int, label: str, input_grad: bool) -> list[CommOp]:
    """A windowed layer on height slabs: the halo rows forward and their gradients back (only
    when its input has a gradient), as `strategies.domain` predicts them."""
    if grid.pr == 1:
        return []
    assert isinstance(layer, WINDOWED)
    rows, channels, _, width = local_in
    plan = HaloPlan(height, height_window(layer), grid.pr, 0)
    row_bytes = rows * channels * width * itemsize
    received = [piece for piece in plan.pieces if piece[0] != 0]
    if not (plan.sends or received):
        return []
    messages = max(len(plan.sends), len(received))
    ops = [CommOp("exchange", "model", grid.pr, plan.send_rows * row_bytes, label, messages)]
    if input_grad:
        ops.append(CommOp("exchange", "model", grid.pr, plan.recv_rows * row_bytes, label,
                          messages))
    return ops


def halo_ops_2d(layer: nn.Module, grid: GridShape, local_in: tuple[int, ...],
                sample: Sequence[int], itemsize: int, label: str, input_grad: bool
                ) -> list[CommOp]:
    """A windowed layer on tiles (`SpatialWindowed2D`): the halo rows over the model group,
    then the halo columns of the row-extended tile over the batch group; back again for the
    gradients when the input has one."""
    assert isinstance(layer, WINDOWED)
    rows, channels, _, width = local_in
    hp = HaloPlan(sample[1], height_window(layer), grid.pr, 0)
    wp = HaloPlan(sample[2], width_window(layer), grid.pc, 0)
    extended = (hp.window_rows[1] - hp.window_rows[0]) + hp.pad_before + hp.pad_after
    ops: list[CommOp] = []
    exchanges: tuple[tuple[GridGroup, int, HaloPlan, int], ...] = (
        ("model", grid.pr, hp, rows * channels * width * itemsize),
        ("batch", grid.pc, wp, rows * channels * extended * itemsize))
    for group, size, plan, line_bytes in exchanges:
        received = [piece for piece in plan.pieces if piece[0] != 0]
        if size == 1 or not (plan.sends or received):
            continue
        messages = max(len(plan.sends), len(received))
        ops.append(CommOp("exchange", group, size, plan.send_rows * line_bytes, label,
                          messages))
        if input_grad:
            ops.append(CommOp("exchange", group, size, plan.recv_rows * line_bytes, label,
                              messages))
    return ops


def param_groups_of(layer: nn.Module, layout: str, grid: GridShape
                    ) -> dict[GroupName, list[tuple[int, torch.dtype]]]:
    """(bytes, dtype) of each of rank 0's parameters of `layer` in `layout`, by the group its
    gradient is summed over: every rank (whole weights), the batch group (split over the model
    group), none (a 2-D block only this rank holds)."""
    groups: dict[GroupName, list[tuple[int, torch.dtype]]] = {"world": [], "batch": [],
                                                              "self": []}
    params = dict(layer.named_parameters())

    def add(group: GroupName, name: str, elements: int) -> None:
        if name in params:
            groups[group].append((elements * params[name].element_size(),
                                  params[name].dtype))

    if layout.startswith("norm:"):
        split = layout == "norm:split"
        for name, p in params.items():
            add("batch" if split else "world", name,
                Partition(p.numel(), grid.pr).sizes[0] if split else p.numel())
        return groups
    if isinstance(layer, nn.Linear):
        out_f, in_f = layer.out_features, layer.in_features
        if layout == "batch":
            add("world", "weight", out_f * in_f)
            add("world", "bias", out_f)
        elif layout == "row":
            rows = Partition(out_f, grid.pr).sizes[0]
            add("batch", "weight", rows * in_f)
            add("batch", "bias", rows)
        elif layout in ("col", "col_rows"):
            add("batch", "weight", out_f * Partition(in_f, grid.pr).sizes[0])
            if layout == "col":
                add("batch", "bias", Partition(out_f, grid.pr).sizes[0])
            else:
                add("world", "bias", out_f)
        else:  # 2d, 2d_t: a block and a tile of the bias that only this rank holds
            outer, inner = (grid.pr, grid.pc) if layout == "2d" else (grid.pc, grid.pr)
            rows = Partition(out_f, outer).sizes[0]
            add("self", "weight", rows * Partition(in_f, inner).sizes[0])
            add("self", "bias", Partition(rows, inner).sizes[0])
        return groups
    assert isinstance(layer, nn.Conv2d)
    per_filter = layer.weight.numel() // layer.out_channels
    if layout == "filters":
        filters = Partition(layer.out_channels, grid.pr).sizes[0]
        add("batch", "weight", filters * per_filter)
        add("batch", "bias", filters)
    else:
        add("world", "weight", layer.weight.numel())
        add("world", "bias", layer.out_channels)
    return groups


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


class PartialSumLinear(nn.Module):
    """A block of a Linear's weight, W[out_rows, in_cols], whose products are partial sums over
    `comm` (the ranks holding the other columns): reduce-scattered by features (`dim` 1: this
    rank's tile of `out_rows`, and its tile of the bias) or by rows (`dim` 0: this rank's rows,
    the whole bias, `out_rows` then being every output)."""

    def __init__(self, linear: nn.Linear, out_rows: slice, in_cols: slice, comm: CountedComm,
                 dim: int, label: str) -> None:
        super().__init__()
        self.comm, self.dim, self.label = comm, dim, label
        self.weight = nn.Parameter(linear.weight.detach()[out_rows, in_cols].clone())
        place_block(self.weight, linear.weight, out_rows, in_cols)
        self.out_part = Partition(out_rows.stop - out_rows.start, comm.size)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            tile = (self.out_part.slice(comm.rank) if dim == 1 else slice(0, self.out_part.total))
            rows = slice(out_rows.start + tile.start, out_rows.start + tile.stop)
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
            place_rows(self.bias, linear.bias, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        part = self.out_part if self.dim == 1 else Partition(x.shape[0], self.comm.size)
        y = reduce_scatter(partial, self.comm, self.dim, part, label=self.label)
        return y if self.bias is None else y + self.bias


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
    groups: dict[GroupName, list[nn.Parameter]] = {"world": [], "batch": [], "self": []}
    r, c = grid.model_index, grid.batch_index
    for step in plan.steps:
        i, layer = step.index, layers[step.index]
        label = layer_label(i, layer)
        if step.before != step.takes:  # (a no-op on this grid is never planned: see below)
            modules.append(Redistribute(step.before, step.takes, shapes[i], grid, rows, label))
        built, held = _build_layer(layer, step, grid, shapes[i], overlap, label, r, c)
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


def _build_layer(layer: nn.Module, step: Step, grid: ProcessGrid, in_shape: tuple[int, ...],
                 overlap: bool, label: str, r: int, c: int
                 ) -> tuple[nn.Module, dict[GroupName, list[nn.Parameter]]]:
    """This rank's module for `step` and its parameters by gradient group."""
    layout = step.layout
    if isinstance(layer, nn.Linear):
        out_f, in_f = layer.out_features, layer.in_features
        if layout == "batch":
            return layer, {"world": list(layer.parameters())}
        if layout == "row":
            built: nn.Module = ShardedLinear(layer, Partition(out_f, grid.pr), r)
            return built, {"batch": list(built.parameters())}
        if layout in ("col", "col_rows"):
            cols = Partition(in_f, grid.pr).slice(r)
            dim = 1 if layout == "col" else 0
            block = PartialSumLinear(layer, slice(0, out_f), cols, grid.model, dim, label)
            # the bias: a tile of the outputs over the model group (by features), or whole
            # and added on every rank's own rows (by rows)
            bias = [] if block.bias is None else [block.bias]
            if dim == 1:
                return block, {"batch": [block.weight, *bias]}
            return block, {"batch": [block.weight], "world": bias}
        if layout == "2d":
            block = PartialSumLinear(layer, Partition(out_f, grid.pr).slice(r),
                                     Partition(in_f, grid.pc).slice(c), grid.batch, 1, label)
        else:  # 2d_t
            block = PartialSumLinear(layer, Partition(out_f, grid.pc).slice(c),
                                     Partition(in_f, grid.pr).slice(r), grid.model, 1, label)
        return block, {"self": list(block.parameters())}
    if isinstance(layer, nn.Conv2d) and layout == "filters":
        built = ShardedConv2d(layer, Partition(layer.out_channels, grid.pr), r)
        return built, {"batch": list(built.parameters())}
    if isinstance(layer, WINDOWED) and step.takes == SLAB and grid.pr > 1:
        windowed: nn.Module = SpatialWindowed(layer, grid.model, in_shape[1], overlap)
        return windowed, {"world": list(layer.parameters())}
    if isinstance(layer, WINDOWED) and step.takes == TILES_HW and grid.size > 1:
        windowed = SpatialWindowed2D(layer, grid.model, grid.batch, in_shape[1], in_shape[2])
        return windowed, {"world": list(layer.parameters())}
    if isinstance(layer, BATCH_NORMS):
        if step.takes == SPLIT:
            channels = Partition(layer.num_features, grid.pr).slice(r)
            norm = DistributedBatchNorm(layer, grid.batch, f"bn:{step.index}", channels)
            return norm, {"batch": list(norm.parameters())}
        norm = DistributedBatchNorm(layer, grid.world, f"bn:{step.index}")
        return norm, {"world": list(norm.parameters())}
    return layer, {"world": list(layer.parameters())}
