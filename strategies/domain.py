"""`strategy=domain`: each sample split in height over the model group, the batch over `Pc`.

Convolutions and pooling run on height slabs (NCHW, contiguous rows): before each one, a halo
exchange over the model group brings the rows the slab's outputs read from the neighbours
(`runner.core.halo`). The exchange is posted non-blocking and the output rows that need only the
rank's own rows are computed while the halos travel; the rows near the slab's edges follow.
Activations act row by row, so they run on the slab as it is. Where the spatial part ends (the
first other layer, typically Flatten), an all-gather of the height over the model group
(adjoint: reduce-scatter) moves the activations into the grid strategy's fully-connected
layout, and the fully-connected layers are split as in `strategy=grid`.

Weights of the spatial layers are replicated and all-reduced over all P ranks; this is what lets
training scale past the batch size, since one sample is worked on by `Pr` ranks.

A GPT's domain is its sequence: for a `strategies.transformer.GPT` each sequence is split over
the model group instead (sequence parallelism, `strategies.sequence`; `kv_exchange` chooses how
attention's keys and values travel).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.compute import DEFAULT_RATES, ComputeRates
from runner.core.cost import DEFAULT_COSTS, CommOp, MachineCosts
from runner.core.halo import HaloPlan, Window, halo_exchange, halo_window, start_halo_exchange
from runner.core.primitives import all_gather
from strategies.base import ParallelModel, Strategy, predict_step, split_model_exchanges
from strategies.buckets import predict_gradient_ops
from strategies.grid import sequential_problems
from strategies.norm import batch_norm_ops, distribute_batch_norms
from strategies.registry import register_strategy
from strategies.sequence import (
    KV_EXCHANGES,
    build_sequence_parallel,
    choose_kv_exchange,
    sequence_activation_elements,
    sequence_compute_seconds,
    sequence_ops,
    sequence_param_bytes,
    sequence_problems,
)
from strategies.sharded import (
    CHANNEL_LOCAL,
    activation_itemsize,
    activation_ops,
    body_activation_elements,
    body_norm_ops,
    build_sharded,
    layer_label,
    output_itemsizes,
    output_shapes,
    plan_layers,
    rank0_param_items,
    split_param_bytes,
    whole_norm_problems,
    whole_param_items,
)
from strategies.transformer import GPT, is_gpt

Windowed = nn.Conv2d | nn.MaxPool2d | nn.AvgPool2d
WINDOWED = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)  # left to inference: isinstance narrows
# Row-local: activations; and BatchNorm2d, whose statistics are reduced over the slabs and rows
# of every rank (`strategies.norm`).
ROW_LOCAL = (*(t for t in CHANNEL_LOCAL if t not in (nn.MaxPool2d, nn.AvgPool2d)),
             nn.BatchNorm2d)


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _padding(layer: Windowed) -> tuple[int, int]:
    if isinstance(layer.padding, str):  # Conv2d(padding="same" or "valid")
        raise ValueError(f"{layer}: padding='{layer.padding}' is not supported, give it in rows")
    return _pair(layer.padding)


def windowed_problem(layer: Windowed) -> str | None:
    """Why a height slab cannot compute `layer` as the whole image does (None: it can)."""
    if isinstance(layer, nn.Conv2d) and isinstance(layer.padding, str):
        return (f"padding='{layer.padding}' is not supported under strategy=domain; give the "
                f"padding in rows")
    if isinstance(layer, nn.Conv2d) and layer.padding_mode != "zeros":
        return (f"padding_mode='{layer.padding_mode}' pads at the image's edges, which a "
                f"height slab does not hold")
    if isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)) and layer.ceil_mode:
        return "ceil_mode is not supported"
    if isinstance(layer, nn.AvgPool2d) and not layer.count_include_pad and _pair(
            layer.padding)[0]:
        return "padding needs count_include_pad=True"
    return None


def _window(layer: Windowed, axis: int) -> Window:
    """The layer's window along an image axis (0: height, 1: width)."""
    kernel, stride = _pair(layer.kernel_size), _pair(layer.stride or layer.kernel_size)
    padding, dilation = _padding(layer), _pair(getattr(layer, "dilation", 1))
    return Window(kernel[axis], stride[axis], padding[axis], dilation[axis])


def height_window(layer: Windowed) -> Window:
    return _window(layer, 0)


def width_window(layer: Windowed) -> Window:
    return _window(layer, 1)


def _without_height_padding(layer: Windowed) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's operation with the height padding left out (the window brings its own)."""
    kernel, stride = _pair(layer.kernel_size), _pair(layer.stride or layer.kernel_size)
    pad_w = _padding(layer)[1]
    if isinstance(layer, nn.Conv2d):
        # groups: a depthwise or grouped convolution keeps its channel groups on a slab
        return lambda x: F.conv2d(x, layer.weight, layer.bias, layer.stride, (0, pad_w),
                                  layer.dilation, layer.groups)
    if isinstance(layer, nn.MaxPool2d):
        return lambda x: F.max_pool2d(x, kernel, stride, (0, pad_w), layer.dilation)
    # divisor_override: a constant divisor, the same for a window wherever its rows come from.
    return lambda x: F.avg_pool2d(x, kernel, stride, (0, pad_w), count_include_pad=True,
                                  divisor_override=layer.divisor_override)


class SpatialWindowed(nn.Module):
    """A convolution or pooling layer on this rank's height slab (halo exchange included)."""

    def __init__(self, layer: Windowed, comm: CountedComm, height: int, overlap: bool) -> None:
        super().__init__()
        self.layer, self.comm, self.overlap = layer, comm, overlap
        self.window = height_window(layer)
        self.plan = HaloPlan(height, self.window, comm.size, comm.rank)
        self.apply_op = _without_height_padding(layer)
        self.pad_value = float("-inf") if isinstance(layer, nn.MaxPool2d) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan, window = self.plan, self.window
        pending = start_halo_exchange(x, self.comm, 2, plan)
        out_start = plan.out_part.offsets[plan.rank]
        out_stop = out_start + plan.out_part.sizes[plan.rank]
        a, b = plan.interior() if self.overlap else (out_start, out_start)
        if a == out_start and b == out_stop:
            # Every row is interior: still compute from the window, so that this exchange's
            # adjoint runs in backward and the halo gradients others send back are received.
            a = b = out_start
        interior = None
        if b > a:  # needs only this rank's rows: computed while the halos travel
            lo, hi = window.inputs(a, b)
            interior = self.apply_op(x.narrow(2, lo - plan.own_rows[0], hi - lo))
        padded = halo_window(x, pending, self.comm)
        if plan.pad_before or plan.pad_after:
            padded = F.pad(padded, (0, 0, plan.pad_before, plan.pad_after), value=self.pad_value)
        base = plan.window_rows[0] - plan.pad_before  # global row of padded[:, :, 0]

        def rows(start: int, stop: int) -> torch.Tensor:
            lo, hi = window.inputs(start, stop)
            return self.apply_op(padded.narrow(2, lo - base, hi - lo))

        if interior is None:
            return rows(out_start, out_stop)
        parts = [rows(out_start, a)] if a > out_start else []
        parts.append(interior)
        if out_stop > b:
            parts.append(rows(b, out_stop))
        return torch.cat(parts, dim=2) if len(parts) > 1 else interior


def _without_padding(layer: Windowed) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's operation with no padding at all (the windows bring their own)."""
    kernel, stride = _pair(layer.kernel_size), _pair(layer.stride or layer.kernel_size)
    if isinstance(layer, nn.Conv2d):
        return lambda x: F.conv2d(x, layer.weight, layer.bias, layer.stride, 0, layer.dilation,
                                  layer.groups)
    if isinstance(layer, nn.MaxPool2d):
        return lambda x: F.max_pool2d(x, kernel, stride, 0, layer.dilation)
    return lambda x: F.avg_pool2d(x, kernel, stride, 0, count_include_pad=True,
                                  divisor_override=layer.divisor_override)


class SpatialWindowed2D(nn.Module):
    """A convolution or pooling layer on this rank's tile of the image: height split over
    `rows` (the model group), width over `cols` (the batch group). The halo rows come first
    (over `rows`), then the halo columns of the row-extended tile (over `cols`), so the
    corners arrive with them; both exchanges' adjoints run in backward. No overlap: the
    exchanges complete before the tile's outputs are computed."""

    def __init__(self, layer: Windowed, rows: CountedComm, cols: CountedComm, height: int,
                 width: int) -> None:
        super().__init__()
        self.layer, self.rows, self.cols = layer, rows, cols
        self.windows = (height_window(layer), width_window(layer))
        self.plans = (HaloPlan(height, self.windows[0], rows.size, rows.rank),
                      HaloPlan(width, self.windows[1], cols.size, cols.rank))
        self.apply_op = _without_padding(layer)
        self.pad_value = float("-inf") if isinstance(layer, nn.MaxPool2d) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hp, wp = self.plans
        x = halo_exchange(x, self.rows, 2, hp)
        x = F.pad(x, (0, 0, hp.pad_before, hp.pad_after), value=self.pad_value)
        x = halo_exchange(x, self.cols, 3, wp)
        x = F.pad(x, (wp.pad_before, wp.pad_after, 0, 0), value=self.pad_value)
        for dim, plan, window in ((2, hp, self.windows[0]), (3, wp, self.windows[1])):
            start = plan.out_part.offsets[plan.rank]
            lo, hi = window.inputs(start, start + plan.out_part.sizes[plan.rank])
            base = plan.window_rows[0] - plan.pad_before  # global index of x's first
            x = x.narrow(dim, lo - base, hi - lo)
        return self.apply_op(x)


class DomainParallelModel(ParallelModel):
    def __init__(self, grid: ProcessGrid, spatial: nn.Sequential, input_height: int,
                 output_height: int, body: nn.Sequential, ends_on_own_rows: bool) -> None:
        super().__init__(grid)
        self.spatial, self.body = spatial, body
        self.input_rows_part = Partition(input_height, grid.pr)
        self.output_rows_part = Partition(output_height, grid.pr)
        self.ends_on_own_rows = ends_on_own_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.grid.model
        slab = x[:, :, self.input_rows_part.slice(model.rank)]
        h = self.spatial(slab)
        if model.size > 1:
            h = all_gather(h, model, 2, self.output_rows_part, label="boundary")
        y: torch.Tensor = self.body(h)
        return y if self.ends_on_own_rows else y[Partition(x.shape[0], model.size).slice(
            model.rank)]


def spatial_end(layers: Sequence[nn.Module]) -> int:
    """Index of the first layer that is neither windowed nor row-local."""
    return next((i for i, layer in enumerate(layers)
                 if not isinstance(layer, WINDOWED + ROW_LOCAL)), len(layers))


@register_strategy("domain")
class DomainParallel(Strategy):
    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 overlap: bool = True, kv_exchange: str = "auto", *,
                 costs: MachineCosts = DEFAULT_COSTS,
                 rows_touched: Callable[[int], float] | None = None,
                 compute_dtype: torch.dtype | None = None,
                 rates: ComputeRates = DEFAULT_RATES, global_batch: int | None = None,
                 slowdown: float = 1.0) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, costs=costs, rows_touched=rows_touched,
                         compute_dtype=compute_dtype, rates=rates, global_batch=global_batch,
                         slowdown=slowdown)
        self.overlap = overlap
        self.kv_exchange = kv_exchange
        self._exchanges: dict[tuple[object, ...], str] = {}  # auto's choices

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if self.kv_exchange not in KV_EXCHANGES:
            return [f"strategy.kv_exchange={self.kv_exchange}: must be one of "
                    f"{', '.join(KV_EXCHANGES)}"]
        return super().check(grid, global_batch)

    def sequence_exchange(self, model: GPT, sample_shape: tuple[int, ...],
                          grid: GridShape) -> str:
        """The key/value exchange a GPT's split sequence uses on `grid` (auto: chosen from the
        cost model, for the strategy's global batch, one row a group when unknown)."""
        if self.kv_exchange == "auto" and self.global_batch and grid.pr > 1:
            # the least predicted step time: the ring computes only the blocks a rank's
            # queries see, the all-gather has fewer latencies. Chosen once per model shape
            # and grid: predictions and parallelize ask again and again.
            key = (repr(model), next(model.parameters()).dtype, tuple(sample_shape), grid)
            if key not in self._exchanges:
                times = {}
                for choice in ("allgather", "ring"):
                    fixed = copy.copy(self)
                    fixed.kv_exchange = choice
                    times[choice] = predict_step(fixed, model, sample_shape, grid,
                                                 self.global_batch).total_s
                self._exchanges[key] = min(times, key=lambda choice: times[choice])
            return self._exchanges[key]
        rows = Partition(self.global_batch, grid.pc).sizes[0] if self.global_batch else 1
        return choose_kv_exchange(self.kv_exchange, model, int(sample_shape[0]), grid, rows,
                                  activation_itemsize([model], self.compute_dtype), self.costs)

    def splits_parameters(self, grid: GridShape) -> bool:
        return False  # the model group splits each sample's domain; weights stay whole

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        if is_gpt(model):
            assert isinstance(model, GPT)
            return sequence_problems(model, sample_shape, grid)
        if not isinstance(model, nn.Sequential):  # a module tree (strategies/tree.py)
            from strategies.tree import tree_problems

            if len(sample_shape) != 3:
                return [f"strategy=domain splits images in height: got inputs of shape "
                        f"{tuple(sample_shape)}"]
            return tree_problems(model, sample_shape, self.name, "domain", grid.pr)
        problems = sequential_problems(model, self.name)
        if problems:
            return problems
        assert isinstance(model, nn.Sequential)  # or there would be problems
        layers = list(model)
        end = spatial_end(layers)
        if end == 0 or len(sample_shape) != 3:
            return [f"strategy=domain splits images in height: the model must start with "
                    f"convolutions or pooling on (channels, height, width) inputs, got inputs "
                    f"of shape {tuple(sample_shape)}"]
        shapes = output_shapes(layers, sample_shape)
        for i, layer in enumerate(layers[:end]):
            problem = windowed_problem(layer) if isinstance(layer, WINDOWED) else None
            if problem is not None:
                problems.append(f"layer {i} ({layer}): {problem}")
            height = shapes[i][1]
            if height < grid.pr:
                problems.append(f"strategy=domain splits each sample's height over grid.pr="
                                f"{grid.pr} ranks, but layer {i} ({type(layer).__name__}) outputs "
                                f"height {height}: every rank needs a row (use a smaller grid.pr "
                                f"or taller inputs)")
        if sample_shape[1] < grid.pr:
            problems.append(f"input height {sample_shape[1]} is smaller than grid.pr={grid.pr}")
        if grid.pr > 1:
            problems += [f"strategy=domain cannot split {p}"
                         for p in whole_norm_problems(layers, end)]
        return problems

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        if is_gpt(model):
            assert isinstance(model, GPT)
            return build_sequence_parallel(model, sample_shape, grid,
                                           self.sequence_exchange(model, sample_shape,
                                                                  grid.shape),
                                           sync_replica_gradients, self.bucket_cap_bytes,
                                           self.first_bucket_bytes)
        if not isinstance(model, nn.Sequential):
            from strategies.tree import build_tree_model

            return build_tree_model(model, sample_shape, grid, "domain", sync_replica_gradients,
                                    self.bucket_cap_bytes, self.first_bucket_bytes, self.overlap)
        layers = list(model)
        end = spatial_end(layers)
        shapes = output_shapes(layers, sample_shape)
        heights = [sample_shape[1]] + [shape[1] for shape in shapes[:end]]
        spatial = nn.Sequential(*[
            SpatialWindowed(layer, grid.model, heights[i], self.overlap)
            if isinstance(layer, WINDOWED) and grid.pr > 1 else layer
            for i, layer in enumerate(layers[:end])])
        # A spatial BatchNorm's statistics: every rank's slabs of every row (an EASGD replica,
        # a model group: its own rows' slabs).
        distribute_batch_norms(spatial, grid.world if sync_replica_gradients else grid.model)
        steps = plan_layers(layers, end, grid.pr)
        body = build_sharded(layers, steps, grid.model, grid.model_index,
                             grid.batch if sync_replica_gradients else None)
        ends_on_own_rows = grid.pr == 1 or (bool(steps) and steps[-1].kind == "to_rows")
        pmodel = DomainParallelModel(grid, spatial, heights[0], heights[end], body,
                                     ends_on_own_rows)
        spatial_params = [p for layer in layers[:end] for p in layer.parameters()]
        pmodel.replicated_in_model_group = spatial_params
        pmodel.reducers = split_model_exchanges(grid, list(body.parameters()), spatial_params,
                                                sync_replica_gradients, self.bucket_cap_bytes,
                                                self.first_bucket_bytes)
        return pmodel

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        if is_gpt(model):
            assert isinstance(model, GPT)
            rows = Partition(global_batch, grid.pc).sizes[0]
            return sequence_ops(model, sample_shape, grid, rows,
                                self.sequence_exchange(model, sample_shape, grid),
                                activation_itemsize([model], self.compute_dtype),
                                self.bucket_caps)
        if not isinstance(model, nn.Sequential):
            from strategies.tree import predict_tree_ops

            return predict_tree_ops(model, sample_shape, grid, global_batch, "domain",
                                    self.bucket_caps,
                                    activation_itemsize([model], self.compute_dtype),
                                    activation_itemsize([model]))
        layers = list(model)
        end = spatial_end(layers)
        shapes = output_shapes(layers, sample_shape)
        rows = Partition(global_batch, grid.pc).sizes[0]
        itemsizes = output_itemsizes(layers, self.compute_dtype)
        ops: list[CommOp] = []
        if grid.pr > 1:
            inputs = [tuple(sample_shape), *shapes[:end]]
            for i, layer in enumerate(layers[:end]):
                if not isinstance(layer, WINDOWED):
                    continue
                channels, height, width = inputs[i]
                plan = HaloPlan(height, height_window(layer), grid.pr, 0)
                row_bytes = rows * channels * width * itemsizes[i]
                received = [piece for piece in plan.pieces if piece[0] != 0]
                label = layer_label(i, layer)
                if plan.sends or received:  # forward: rank 0's rows that others read
                    ops.append(CommOp("exchange", "model", grid.pr, plan.send_rows * row_bytes,
                                      label, max(len(plan.sends), len(received))))
                if (plan.sends or received) and whole_param_items(layers[:i]):
                    # backward (not for the data itself): the halos' gradients go back
                    ops.append(CommOp("exchange", "model", grid.pr, plan.recv_rows * row_bytes,
                                      label, max(len(plan.sends), len(received))))
            n = rows * math.prod(shapes[end - 1]) * itemsizes[end]
            ops += [CommOp("allgather", "model", grid.pr, n, "boundary"),
                    CommOp("reduce_scatter", "model", grid.pr, n, "boundary")]
        steps = plan_layers(layers, end, grid.pr)
        stats = activation_itemsize(layers)  # batch statistics: the parameters' dtype
        ops += batch_norm_ops(model[:end], "world", grid.size, stats)
        ops += body_norm_ops(layers, steps, grid.pr, grid.pc, stats)
        return (ops + activation_ops(layers, steps, sample_shape, rows, grid.pr,
                                     self.compute_dtype)
                + predict_gradient_ops(rank0_param_items(layers, steps, grid.pr), "batch",
                                       grid.pc, *self.bucket_caps)
                + predict_gradient_ops(whole_param_items(layers[:end]), "world", grid.size,
                                       *self.bucket_caps))

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        if is_gpt(model):
            return sequence_param_bytes(model)
        if not isinstance(model, nn.Sequential):
            from strategies.tree import tree_param_bytes

            return tree_param_bytes(model, sample_shape, "domain", grid.pr)
        return split_param_bytes(list(model), spatial_end(list(model)), grid.pr)

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if is_gpt(model):
            assert isinstance(model, GPT)
            rows = Partition(global_batch, grid.pc).sizes[0]
            return sequence_activation_elements(
                model, int(sample_shape[0]), grid, rows,
                self.sequence_exchange(model, sample_shape, grid)) * activation_itemsize(
                [model], self.compute_dtype)
        if not isinstance(model, nn.Sequential):
            from strategies.tree import tree_activation_bytes

            return tree_activation_bytes(model, sample_shape, grid, global_batch, "domain",
                                         activation_itemsize([model], self.compute_dtype))
        layers = list(model)
        end = spatial_end(layers)
        shapes = output_shapes(layers, sample_shape)
        rows = Partition(global_batch, grid.pc).sizes[0]
        elements = 0
        for shape in shapes[:end]:  # rank 0's slab of each spatial output
            channels, height, width = shape
            elements += rows * channels * Partition(height, grid.pr).sizes[0] * width
        if grid.pr > 1:  # the boundary gather holds whole images
            elements += rows * math.prod(shapes[end - 1])
        elements += body_activation_elements(layers, plan_layers(layers, end, grid.pr),
                                             sample_shape, rows, grid.pr)
        return elements * activation_itemsize(layers, self.compute_dtype)

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if is_gpt(model):
            assert isinstance(model, GPT)
            return sequence_compute_seconds(model, int(sample_shape[0]), grid,
                                            Partition(global_batch, grid.pc).sizes[0],
                                            self.sequence_exchange(model, sample_shape, grid),
                                            self.rates)
        return super().predict_compute_seconds(model, sample_shape, grid, global_batch)
