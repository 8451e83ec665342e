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

A GPT's domain is its sequence: for a `strategies.transformer.gpt.GPT` each sequence is split
over the model group instead (sequence parallelism, `strategies.transformer.context_parallel`;
`kv_exchange` chooses how attention's keys and values travel).

Any other model's sequence, by a parallel plan by module name (`strategy.plan`, styles
`sequence` and `replicate` only: `strategies.plans.module_plan.domain_plan`): each sample's
sequence split over the model group in the blocks holding `sequence` modules, which run on this
rank's positions; the blocks' other modules (the attention) run on the gathered sequence, whole
on every rank (`strategies.plans.sequence_parallel.domain_layout`). Every weight whole, its
gradient summed over every rank.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from runner.core import GridShape, Partition, ProcessGrid
from runner.core.halo import HaloPlan
from runner.core.primitives import all_gather
from runner.cost.collectives import CommOp
from strategies.base import (
    DEFAULT_PRICING,
    ParallelModel,
    PricingContext,
    Strategy,
    predict_step,
    split_model_exchanges,
)
from strategies.exchange.buckets import predict_gradient_ops
from strategies.layers.norm import batch_norm_ops, distribute_batch_norms
from strategies.layers.spatial import (
    ROW_LOCAL,
    WINDOWED,
    SpatialWindowed,
    height_window,
    windowed_problem,
)
from strategies.layers.split import (
    activation_itemsize,
    activation_ops,
    body_activation_elements,
    body_norm_ops,
    build_split,
    layer_label,
    output_itemsizes,
    output_shapes,
    plan_layers,
    rank0_param_items,
    sequential_problems,
    split_param_bytes,
    whole_norm_problems,
    whole_param_items,
)
from strategies.layers.tree import tree_problems
from strategies.layers.tree_model import (
    build_tree_model,
    predict_tree_ops,
    tree_activation_bytes,
    tree_param_bytes,
)
from strategies.plans.costs import PlannedModule, plan_compute_seconds, plan_module_bytes
from strategies.plans.module_plan import (
    ModulePlan,
    build_planned_model,
    domain_plan,
    plan_activation_bytes,
    plan_param_bytes,
    plan_problems,
    predict_plan_ops,
)
from strategies.registry import register_strategy
from strategies.transformer.context_parallel import (
    KV_EXCHANGES,
    build_sequence_parallel,
    choose_kv_exchange,
    sequence_activation_elements,
    sequence_compute_seconds,
    sequence_ops,
    sequence_param_bytes,
    sequence_problems,
)
from strategies.transformer.gpt import GPT, is_gpt


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
                 overlap: bool = True, kv_exchange: str = "auto",
                 plan: Mapping[str, str] | None = None, *,
                 pricing: PricingContext = DEFAULT_PRICING) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, pricing=pricing)
        self.overlap = overlap
        self.kv_exchange = kv_exchange
        self._exchanges: dict[tuple[object, ...], str] = {}  # auto's choices
        # module-path glob pattern → sequence | replicate; config keys may come as other
        # scalars
        self.plan = {str(k): str(v) for k, v in (plan or {}).items()}

    def plan_of(self, model: nn.Module) -> ModulePlan | None:
        """The user's plan for `model`, its weights whole (None: none given)."""
        return domain_plan(model, self.plan)

    def plan_modules(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                     global_batch: int) -> tuple[str, list[PlannedModule]] | None:
        """Where the plan comes from, and each of its modules with its style and predicted
        bytes per step (None: no plan)."""
        plan = self.plan_of(model)
        if plan is None:
            return None
        return plan.source, plan_module_bytes(model, plan, sample_shape, grid, global_batch,
                                              self.bucket_caps, self.pricing.compute_dtype)

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if self.kv_exchange not in KV_EXCHANGES:
            return [f"strategy.kv_exchange={self.kv_exchange}: must be one of "
                    f"{', '.join(KV_EXCHANGES)}"]
        return super().check(grid, global_batch)

    def sequence_exchange(self, model: GPT, sample_shape: tuple[int, ...],
                          grid: GridShape) -> str:
        """The key/value exchange a GPT's split sequence uses on `grid` (auto: chosen from the
        cost model, for the strategy's global batch, one row a group when unknown)."""
        if self.kv_exchange == "auto" and self.pricing.global_batch and grid.pr > 1:
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
                                                 self.pricing.global_batch).total_s
                self._exchanges[key] = min(times, key=lambda choice: times[choice])
            return self._exchanges[key]
        batch = self.pricing.global_batch
        rows = Partition(batch, grid.pc).sizes[0] if batch else 1
        return choose_kv_exchange(self.kv_exchange, model, int(sample_shape[0]), grid, rows,
                                  activation_itemsize([model], self.pricing.compute_dtype),
                                  self.pricing.costs)

    def splits_parameters(self, grid: GridShape) -> bool:
        return False  # the model group splits each sample's domain; weights stay whole

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        if (by_name := self.plan_of(model)) is not None:
            return [f"strategy=domain: {p}"
                    for p in plan_problems(by_name, model, sample_shape, grid.pr, grid.pc)]
        if is_gpt(model):
            assert isinstance(model, GPT)
            return sequence_problems(model, sample_shape, grid)
        if not isinstance(model, nn.Sequential):  # a module tree (strategies/layers/tree.py)
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
        if (by_name := self.plan_of(model)) is not None:
            return build_planned_model(model, by_name, sample_shape, grid, sync_replica_gradients,
                                       self.bucket_cap_bytes, self.first_bucket_bytes)
        if is_gpt(model):
            assert isinstance(model, GPT)
            return build_sequence_parallel(model, sample_shape, grid,
                                           self.sequence_exchange(model, sample_shape,
                                                                  grid.shape),
                                           sync_replica_gradients, self.bucket_cap_bytes,
                                           self.first_bucket_bytes)
        if not isinstance(model, nn.Sequential):
            return build_tree_model(model, sample_shape, grid, "domain", sync_replica_gradients,
                                    self.bucket_caps, self.overlap)
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
        body = build_split(layers, steps, grid.model, grid.model_index,
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
        if (by_name := self.plan_of(model)) is not None:
            return predict_plan_ops(model, by_name, sample_shape, grid, global_batch,
                                    self.bucket_caps, self.pricing.compute_dtype)
        if is_gpt(model):
            assert isinstance(model, GPT)
            rows = Partition(global_batch, grid.pc).sizes[0]
            return sequence_ops(model, sample_shape, grid, rows,
                                self.sequence_exchange(model, sample_shape, grid),
                                activation_itemsize([model], self.pricing.compute_dtype),
                                self.bucket_caps)
        if not isinstance(model, nn.Sequential):
            return predict_tree_ops(model, sample_shape, grid, global_batch, "domain",
                                    self.bucket_caps, self.pricing.compute_dtype)
        layers = list(model)
        end = spatial_end(layers)
        shapes = output_shapes(layers, sample_shape)
        rows = Partition(global_batch, grid.pc).sizes[0]
        itemsizes = output_itemsizes(layers, self.pricing.compute_dtype)
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
                                     self.pricing.compute_dtype)
                + predict_gradient_ops(rank0_param_items(layers, steps, grid.pr), "batch",
                                       grid.pc, *self.bucket_caps)
                + predict_gradient_ops(whole_param_items(layers[:end]), "world", grid.size,
                                       *self.bucket_caps))

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        if (by_name := self.plan_of(model)) is not None:
            return plan_param_bytes(model, by_name, grid.pr)
        if is_gpt(model):
            return sequence_param_bytes(model)
        if not isinstance(model, nn.Sequential):
            return tree_param_bytes(model, sample_shape, "domain", grid.pr)
        return split_param_bytes(list(model), spatial_end(list(model)), grid.pr)

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if (by_name := self.plan_of(model)) is not None:
            return plan_activation_bytes(model, by_name, sample_shape, grid, global_batch,
                                         self.pricing.compute_dtype)
        if is_gpt(model):
            assert isinstance(model, GPT)
            rows = Partition(global_batch, grid.pc).sizes[0]
            return sequence_activation_elements(
                model, int(sample_shape[0]), grid, rows,
                self.sequence_exchange(model, sample_shape, grid)) * activation_itemsize(
                [model], self.pricing.compute_dtype)
        if not isinstance(model, nn.Sequential):
            return tree_activation_bytes(model, sample_shape, grid, global_batch, "domain",
                                         self.pricing.compute_dtype)
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
        return elements * activation_itemsize(layers, self.pricing.compute_dtype)

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if (by_name := self.plan_of(model)) is not None:
            return plan_compute_seconds(model, by_name, sample_shape, grid, global_batch,
                                        self.pricing.rates)
        if is_gpt(model):
            assert isinstance(model, GPT)
            return sequence_compute_seconds(model, int(sample_shape[0]), grid,
                                            Partition(global_batch, grid.pc).sizes[0],
                                            self.sequence_exchange(model, sample_shape, grid),
                                            self.pricing.rates)
        return super().predict_compute_seconds(model, sample_shape, grid, global_batch)
