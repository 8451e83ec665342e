"""The layouts of activations over the `Pr × Pc` grid, and the layouts of a Linear or Conv2d:
one class per layer layout, holding everything that follows from it.

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

Layer layouts (`LAYOUTS`, a `LayerLayout` subclass each):

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

A layer layout says which input it takes and which output it gives, the stand-in rank 0
computes with (for pricing), the communication it does inside (partial sums, halos), over which
ranks its parameters' gradients are summed, and how it builds this rank's module. A new layout
is a new subclass, registered in `LAYOUTS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.cartesian import CartesianPartition
from runner.core.comm import GridGroup
from runner.core.halo import HaloPlan
from runner.core.placement import place_block, place_rows
from runner.core.primitives import reduce_scatter
from runner.cost.collectives import CommOp
from strategies.layers.spatial import (
    WINDOWED,
    SpatialWindowed,
    SpatialWindowed2D,
    height_window,
    width_window,
)
from strategies.layers.split import SplitConv2d, SplitLinear

C, R = 0, 1  # grid dims: a rank's coordinates are (batch_index, model_index)
GroupName = Literal["world", "model", "batch", "self"]
# (bytes, dtype) of rank 0's parameters by the group their gradients are summed over
ParamGroups = dict[GroupName, list[tuple[int, torch.dtype]]]
# this rank's parameters by the group their gradients are summed over
HeldParams = dict[GroupName, list[nn.Parameter]]

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


# -- windowed layers on slabs and tiles (a domain convolution's, and pooling's) ---------------


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


def spatial_halo_ops(layer: nn.Module, takes: TensorLayout, grid: GridShape,
                     local_in: tuple[int, ...], sample: Sequence[int], itemsize: int,
                     label: str, input_grad: bool) -> list[CommOp]:
    """The halo exchanges of a windowed layer whose input is laid out as `takes` (none
    where the image is not split in space); `sample`: its input's per-sample shape."""
    if takes == SLAB:
        return halo_ops(layer, grid, local_in, sample[1], itemsize, label, input_grad)
    if takes == TILES_HW:
        return halo_ops_2d(layer, grid, local_in, sample, itemsize, label, input_grad)
    return []


def spatial_module(layer: nn.Module, takes: TensorLayout, grid: ProcessGrid,
                   in_shape: tuple[int, ...], overlap: bool) -> nn.Module:
    """A windowed layer on its input laid out as `takes`: with its halo exchanges where the
    image is split in space over more than one rank, else the layer itself."""
    if takes == SLAB and grid.pr > 1:
        assert isinstance(layer, WINDOWED)
        return SpatialWindowed(layer, grid.model, in_shape[1], overlap)
    if takes == TILES_HW and grid.size > 1:
        assert isinstance(layer, WINDOWED)
        return SpatialWindowed2D(layer, grid.model, grid.batch, in_shape[1], in_shape[2])
    return layer


# -- the layer layouts ---------------------------------------------------------------------------

LayerKind = Literal["linear", "conv"]


def empty_groups() -> ParamGroups:
    return {"world": [], "batch": [], "self": []}


def add_param(groups: ParamGroups, layer: nn.Module, group: GroupName, name: str,
              elements: int) -> None:
    """Rank 0's `elements` of `layer`'s parameter `name` (if it has one) in `group`."""
    param = dict(layer.named_parameters()).get(name)
    if param is not None:
        groups[group].append((elements * param.element_size(), param.dtype))


class LayerLayout:
    """A layout of a Linear or Conv2d: the input it takes, the output it gives, and what
    follows from them (its stand-in for pricing, its own communication, its gradient groups,
    this rank's module)."""

    name: ClassVar[str]
    kind: ClassVar[LayerKind]
    takes: ClassVar[TensorLayout]
    gives: ClassVar[TensorLayout]
    summary: ClassVar[str]

    def __repr__(self) -> str:
        return f"{self.kind}:{self.name}"

    def local_layer(self, layer: nn.Module, grid: GridShape) -> nn.Module:
        """A stand-in on the meta device with the shapes rank 0 computes with (for pricing)."""
        return layer

    def partial_sum_ops(self, layer: nn.Module, grid: GridShape, local_in: tuple[int, ...],
                        itemsize: int, label: str) -> list[CommOp]:
        """Where the local products are partial sums: the reduce-scatter forward and the
        all-gather of the gradient backward, each moving the whole partial output."""
        return []

    def halo_ops(self, layer: nn.Module, grid: GridShape, local_in: tuple[int, ...],
                 sample: Sequence[int], itemsize: int, label: str,
                 input_grad: bool) -> list[CommOp]:
        """Where the image is split in space: the halo exchanges (`sample`: the per-sample
        input shape, `itemsize`: the input's)."""
        return []

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        """(bytes, dtype) of each of rank 0's parameters, by the group its gradient is summed
        over: every rank (whole weights), the batch group (split over the model group), none
        (a 2-D block only this rank holds)."""
        raise NotImplementedError

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        """This rank's module and its parameters by gradient group (`in_shape`: the
        per-sample input shape)."""
        raise NotImplementedError


class LinearLayout(LayerLayout):
    """A layout of a Linear: which part of W (out × in) rank 0 holds says its stand-in."""

    kind: ClassVar[LayerKind] = "linear"

    def local_features(self, layer: nn.Linear, grid: GridShape) -> tuple[int, int]:
        """(output, input) features of rank 0's block of W."""
        return layer.out_features, layer.in_features

    def local_layer(self, layer: nn.Module, grid: GridShape) -> nn.Module:
        assert isinstance(layer, nn.Linear)
        out_f, in_f = self.local_features(layer, grid)
        return nn.Linear(in_f, out_f, bias=layer.bias is not None, device="meta")


class BatchLinear(LinearLayout):
    """W whole on every rank, each on its own samples."""

    name = "batch"
    takes = gives = SAMPLES
    summary = "batch-parallel, W whole"

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        assert isinstance(layer, nn.Linear)
        groups = empty_groups()
        add_param(groups, layer, "world", "weight", layer.out_features * layer.in_features)
        add_param(groups, layer, "world", "bias", layer.out_features)
        return groups

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        return layer, {"world": list(layer.parameters())}


class RowLinear(LinearLayout):
    """W's rows (output features) over the model group."""

    name = "row"
    takes, gives = ROWS, SPLIT
    summary = "W's rows over Pr (1.5-D)"

    def local_features(self, layer: nn.Linear, grid: GridShape) -> tuple[int, int]:
        return Partition(layer.out_features, grid.pr).sizes[0], layer.in_features

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        assert isinstance(layer, nn.Linear)
        groups = empty_groups()
        rows = Partition(layer.out_features, grid.pr).sizes[0]
        add_param(groups, layer, "batch", "weight", rows * layer.in_features)
        add_param(groups, layer, "batch", "bias", rows)
        return groups

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        assert isinstance(layer, nn.Linear)
        built = SplitLinear(layer, Partition(layer.out_features, grid.pr), grid.model_index)
        return built, {"batch": list(built.parameters())}


class PartialSumLayout(LinearLayout):
    """A block of W's columns on each rank of a group: its products are partial sums, reduce-
    scattered over that group."""

    def sum_group(self, grid: GridShape) -> tuple[GridGroup, int]:
        """The group over which the partial sums are reduce-scattered, and its size."""
        return "model", grid.pr

    def partial_sum_ops(self, layer: nn.Module, grid: GridShape, local_in: tuple[int, ...],
                        itemsize: int, label: str) -> list[CommOp]:
        assert isinstance(layer, nn.Linear)
        group, size = self.sum_group(grid)
        if size == 1:
            return []
        n = local_in[0] * self.local_features(layer, grid)[0] * itemsize
        return [CommOp("reduce_scatter", group, size, n, label),
                CommOp("allgather", group, size, n, label)]


class ColLinear(PartialSumLayout):
    """W's columns (input features) over the model group, the partial outputs reduce-scattered
    by features; the bias a tile of the outputs."""

    name = "col"
    takes = gives = SPLIT
    summary = "W's columns over Pr, reduce-scatter"
    # the tensor dim the partial outputs are reduce-scattered along: 1 features, 0 rows
    scatter_dim: ClassVar[int] = 1

    def local_features(self, layer: nn.Linear, grid: GridShape) -> tuple[int, int]:
        return layer.out_features, Partition(layer.in_features, grid.pr).sizes[0]

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        assert isinstance(layer, nn.Linear)
        groups = empty_groups()
        out_f, in_f = self.local_features(layer, grid)
        add_param(groups, layer, "batch", "weight", out_f * in_f)
        if self.scatter_dim == 1:
            add_param(groups, layer, "batch", "bias", Partition(out_f, grid.pr).sizes[0])
        else:
            add_param(groups, layer, "world", "bias", out_f)
        return groups

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        assert isinstance(layer, nn.Linear)
        cols = Partition(layer.in_features, grid.pr).slice(grid.model_index)
        block = PartialSumLinear(layer, slice(0, layer.out_features), cols, grid.model,
                                 self.scatter_dim, label)
        # the bias: a tile of the outputs over the model group (by features), or whole
        # and added on every rank's own rows (by rows)
        bias = [] if block.bias is None else [block.bias]
        if self.scatter_dim == 1:
            return block, {"batch": [block.weight, *bias]}
        return block, {"batch": [block.weight], "world": bias}


class ColRowsLinear(ColLinear):
    """`col` with the partial outputs reduce-scattered by rows: each rank its own samples,
    the bias whole."""

    name = "col_rows"
    takes, gives = SPLIT, SAMPLES
    summary = "W's columns over Pr, reduce-scatter by rows"
    scatter_dim = 0


class Linear2D(PartialSumLayout):
    """W in 2-D, rows over the model group and columns over the batch group: a block and a
    tile of the bias that only this rank holds, partials reduce-scattered over the batch
    group."""

    name = "2d"
    takes, gives = COLS, TILES
    summary = "W in 2-D: rows over Pr, columns over Pc"

    def split_sizes(self, grid: GridShape) -> tuple[int, int]:
        """How many pieces W's rows and its columns are split into."""
        return grid.pr, grid.pc

    def sum_group(self, grid: GridShape) -> tuple[GridGroup, int]:
        return "batch", grid.pc

    def local_features(self, layer: nn.Linear, grid: GridShape) -> tuple[int, int]:
        outer, inner = self.split_sizes(grid)
        return (Partition(layer.out_features, outer).sizes[0],
                Partition(layer.in_features, inner).sizes[0])

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        assert isinstance(layer, nn.Linear)
        groups = empty_groups()
        rows, cols = self.local_features(layer, grid)
        add_param(groups, layer, "self", "weight", rows * cols)
        add_param(groups, layer, "self", "bias", Partition(rows, self.split_sizes(grid)[1])
                  .sizes[0])
        return groups

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        assert isinstance(layer, nn.Linear)
        r, c = grid.model_index, grid.batch_index
        block = PartialSumLinear(layer, Partition(layer.out_features, grid.pr).slice(r),
                                 Partition(layer.in_features, grid.pc).slice(c), grid.batch, 1,
                                 label)
        return block, {"self": list(block.parameters())}


class Linear2DT(Linear2D):
    """W in 2-D the other way round: rows over the batch group, columns over the model group,
    partials reduce-scattered over the model group."""

    name = "2d_t"
    takes, gives = COLS_T, TILES_T
    summary = "W in 2-D: rows over Pc, columns over Pr"

    def split_sizes(self, grid: GridShape) -> tuple[int, int]:
        return grid.pc, grid.pr

    def sum_group(self, grid: GridShape) -> tuple[GridGroup, int]:
        return "model", grid.pr

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        assert isinstance(layer, nn.Linear)
        r, c = grid.model_index, grid.batch_index
        block = PartialSumLinear(layer, Partition(layer.out_features, grid.pc).slice(c),
                                 Partition(layer.in_features, grid.pr).slice(r), grid.model, 1,
                                 label)
        return block, {"self": list(block.parameters())}


class ConvLayout(LayerLayout):
    """A layout of an (ungrouped) Conv2d: by default the filters whole on every rank."""

    kind: ClassVar[LayerKind] = "conv"

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        assert isinstance(layer, nn.Conv2d)
        groups = empty_groups()
        add_param(groups, layer, "world", "weight", layer.weight.numel())
        add_param(groups, layer, "world", "bias", layer.out_channels)
        return groups

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        return (spatial_module(layer, self.takes, grid, in_shape, overlap),
                {"world": list(layer.parameters())})


class BatchConv(ConvLayout):
    """The filters whole on every rank, each on its own samples."""

    name = "batch"
    takes = gives = SAMPLES
    summary = "batch-parallel, filters whole"


class FilterConv(ConvLayout):
    """The filters (output channels) over the model group, the batch over the batch group."""

    name = "filters"
    takes, gives = ROWS, SPLIT
    summary = "filters over Pr, batch over Pc"

    def local_layer(self, layer: nn.Module, grid: GridShape) -> nn.Module:
        assert isinstance(layer, nn.Conv2d)
        return nn.Conv2d(layer.in_channels, Partition(layer.out_channels, grid.pr).sizes[0],
                         layer.kernel_size, layer.stride, layer.padding, layer.dilation,  # type: ignore[arg-type]
                         bias=layer.bias is not None, device="meta")

    def param_groups(self, layer: nn.Module, grid: GridShape) -> ParamGroups:
        assert isinstance(layer, nn.Conv2d)
        groups = empty_groups()
        filters = Partition(layer.out_channels, grid.pr).sizes[0]
        add_param(groups, layer, "batch", "weight",
                  filters * (layer.weight.numel() // layer.out_channels))
        add_param(groups, layer, "batch", "bias", filters)
        return groups

    def build(self, layer: nn.Module, grid: ProcessGrid, in_shape: tuple[int, ...],
              overlap: bool, label: str) -> tuple[nn.Module, HeldParams]:
        assert isinstance(layer, nn.Conv2d)
        built = SplitConv2d(layer, Partition(layer.out_channels, grid.pr), grid.model_index)
        return built, {"batch": list(built.parameters())}


class DomainConv(ConvLayout):
    """The image's height over the model group (halo rows exchanged), the batch over the
    batch group."""

    name = "domain"
    takes = gives = SLAB
    summary = "height over Pr (halos), batch over Pc"

    def halo_ops(self, layer: nn.Module, grid: GridShape, local_in: tuple[int, ...],
                 sample: Sequence[int], itemsize: int, label: str,
                 input_grad: bool) -> list[CommOp]:
        return spatial_halo_ops(layer, self.takes, grid, local_in, sample, itemsize, label,
                                input_grad)


class DomainHWConv(DomainConv):
    """The image's height over the model group and its width over the batch group (halos in
    both), the whole batch on every rank."""

    name = "domain_hw"
    takes = gives = TILES_HW
    summary = "height over Pr, width over Pc (halos in both), whole batch"


LAYOUTS: dict[tuple[LayerKind, str], LayerLayout] = {
    (layout.kind, layout.name): layout for layout in (
        BatchLinear(), RowLinear(), ColLinear(), ColRowsLinear(), Linear2D(), Linear2DT(),
        BatchConv(), FilterConv(), DomainConv(), DomainHWConv(),
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


def layout_named(layer: nn.Module, name: str) -> LayerLayout | None:
    """The layout of `layer`'s kind called `name` (None: no such layout)."""
    kind = layer_kind(layer)
    return None if kind is None else LAYOUTS.get((kind, name))


# -- the modules the layouts build ------------------------------------------------------------


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
