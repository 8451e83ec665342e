"""`strategy=grid`: integrated model and batch parallelism on a `Pr × Pc` grid.

Fully-connected layers (and any layer after the first one) are split over the `Pr` ranks of a
model group — rows of W, see `layers/split.py` — while the batch is split over the `Pc` model
groups.
Layers before the first fully-connected one (the convolutions) are batch-parallel over all P
ranks: each rank runs them on its own sub-shard of its group's rows, and an all-gather over the
model group (adjoint: reduce-scatter) moves the result into the fully-connected layout.

Gradients: a sharded weight is held by the `Pc` ranks of one batch group, so its gradient is
all-reduced over that group (|W|/Pr per rank); the batch-parallel layers' weights are replicated
on all P ranks and all-reduced over all of them. Both are bucketed and overlapped with backward.

A GPT (`strategies.transformer.gpt.GPT`) is split Megatron-style instead (`tensor_parallel.py`):
vocabulary, heads and MLP features over the model group, in the layout `strategy.tp_layout`.

A model with a parallel plan by module name (`strategy.plan`, or the model's own declared plan:
`plans/module_plan.py`) is split by it instead of all of the above.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from runner.core import GridShape, Partition, ProcessGrid
from runner.core.primitives import all_gather
from runner.cost.collectives import CommOp
from strategies.base import (
    DEFAULT_PRICING,
    ParallelModel,
    PricingContext,
    Strategy,
    split_model_exchanges,
)
from strategies.exchange.buckets import predict_gradient_ops
from strategies.layers.norm import batch_norm_ops, distribute_batch_norms
from strategies.layers.split import (
    activation_itemsize,
    activation_ops,
    body_activation_elements,
    body_norm_ops,
    build_split,
    feature_sizes,
    output_itemsizes,
    plan_layers,
    rank0_param_items,
    sequential_problems,
    split_param_bytes,
    whole_norm_problems,
    whole_param_items,
)
from strategies.layers.tree import Mode, tree_problems
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
    module_plan,
    plan_activation_bytes,
    plan_param_bytes,
    plan_problems,
    predict_plan_ops,
)
from strategies.probe import DrawPlan, draw_plan
from strategies.registry import register_strategy
from strategies.transformer.gpt import GPT, is_gpt
from strategies.transformer.tensor_parallel import (
    TP_LAYOUTS,
    Layout,
    build_tensor_parallel,
    choose_layout,
    gpt_problems,
    predict_tp_ops,
    tp_activation_bytes,
    tp_compute_seconds,
    tp_param_bytes,
)


class GridParallelModel(ParallelModel):
    """`prefix` runs batch-parallel on this rank's sub-shard (or, without parameters, on the
    whole group's rows); `body` is split over the model group and ends on this rank's rows."""

    def __init__(self, grid: ProcessGrid, prefix: nn.Sequential, prefix_batch_parallel: bool,
                 body: nn.Sequential, ends_on_own_rows: bool) -> None:
        super().__init__(grid)
        self.prefix, self.body = prefix, body
        self.prefix_batch_parallel = prefix_batch_parallel
        self.ends_on_own_rows = ends_on_own_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.grid.model
        rows = Partition(x.shape[0], model.size)
        if self.prefix_batch_parallel:
            x = self.prefix(x[rows.slice(model.rank)])
            if model.size > 1:
                x = all_gather(x, model, 0, rows, label="boundary")
        else:
            x = self.prefix(x)
        y: torch.Tensor = self.body(x)
        return y if self.ends_on_own_rows else y[rows.slice(model.rank)]


def split_at_first_linear(model: nn.Module) -> int:
    layers = list(model.children())
    return next((i for i, layer in enumerate(layers) if isinstance(layer, nn.Linear)),
                len(layers))


def build_grid_model(model: nn.Sequential, grid: ProcessGrid, split: int,
                     sync_replica_gradients: bool, bucket_cap_bytes: int,
                     first_bucket_bytes: int) -> GridParallelModel:
    """Layers before `split` batch-parallel, the rest split over the model group."""
    layers = list(model)
    steps = plan_layers(layers, split, grid.pr)
    prefix = nn.Sequential(*layers[:split])
    prefix_params = list(prefix.parameters())
    # BatchNorm statistics: over every rank's rows in the batch-parallel prefix, over the batch
    # group in the split body (a model group's ranks hold the same rows); an EASGD replica (a
    # model group) normalizes by its own rows.
    distribute_batch_norms(prefix, grid.world if sync_replica_gradients else grid.model)
    body = build_split(layers, steps, grid.model, grid.model_index,
                         grid.batch if sync_replica_gradients else None)
    ends_on_own_rows = grid.pr == 1 or (bool(steps) and steps[-1].kind == "to_rows")
    pmodel = GridParallelModel(grid, prefix, bool(prefix_params), body, ends_on_own_rows)
    pmodel.replicated_in_model_group = prefix_params
    pmodel.reducers = split_model_exchanges(grid, list(body.parameters()), prefix_params,
                                            sync_replica_gradients, bucket_cap_bytes,
                                            first_bucket_bytes)
    return pmodel


def predict_grid_ops(model: nn.Sequential, split: int, sample_shape: tuple[int, ...],
                     grid: GridShape, global_batch: int, caps: tuple[int, int],
                     compute_dtype: torch.dtype | None = None) -> list[CommOp]:
    """Rank 0's collectives per step: activations over the model group, the split layers'
    gradients over the batch group, the batch-parallel layers' over the world."""
    layers = list(model)
    rows = Partition(global_batch, grid.pc).sizes[0]
    steps = plan_layers(layers, split, grid.pr)
    prefix = whole_param_items(layers[:split])
    ops: list[CommOp] = []
    if prefix and grid.pr > 1:  # the boundary gather and its reduce-scatter
        n = (rows * feature_sizes(layers[:split], sample_shape)[-1]
             * output_itemsizes(layers, compute_dtype)[split])
        ops += [CommOp("allgather", "model", grid.pr, n, "boundary"),
                CommOp("reduce_scatter", "model", grid.pr, n, "boundary")]
    stats = activation_itemsize(layers)  # batch statistics: the parameters' dtype
    ops += batch_norm_ops(model[:split], "world", grid.size, stats)
    ops += body_norm_ops(layers, steps, grid.pr, grid.pc, stats)
    return (ops + activation_ops(layers, steps, sample_shape, rows, grid.pr, compute_dtype)
            + predict_gradient_ops(rank0_param_items(layers, steps, grid.pr), "batch", grid.pc,
                                   *caps)
            + predict_gradient_ops(prefix, "world", grid.size, *caps))


def as_gpt(model: nn.Module) -> GPT | None:
    """The model, if it is a GPT (`is_gpt`): split by `tensor_parallel.py`, not by layers."""
    return model if is_gpt(model) else None


@register_strategy("grid")
class GridParallel(Strategy):
    """A Sequential by the layer plan of `layers/split.py`; any other module tree by the rules of
    `strategies.layers.tree` (torch.fx), which keep grid's layout: batch-parallel before the first
    Linear, split from it on; a model with a parallel plan by module name by that plan."""

    tree_mode: Mode = "grid"  # model: every Linear and Conv2d split
    # whether a plan by module name applies (auto prices a model's torch.fx layouts beside
    # its plan by turning this off)
    use_plans: bool = True

    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 tp_layout: str = "auto", plan: Mapping[str, str] | None = None, *,
                 pricing: PricingContext = DEFAULT_PRICING) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, pricing=pricing)
        # module-path glob pattern → style (`strategies.plans.styles`); config keys may come
        # as other scalars
        self.plan = {str(k): str(v) for k, v in (plan or {}).items()}
        # A GPT's tensor-parallel layout: pairing (Megatron), gather, or auto (the cheaper
        # predicted step, chosen once per model shape, grid and batch).
        self.tp_layout = tp_layout
        self._layouts: dict[tuple[object, ...], Layout] = {}

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if self.tp_layout not in TP_LAYOUTS:
            return [f"strategy.tp_layout={self.tp_layout}: must be one of "
                    f"{', '.join(TP_LAYOUTS)}"]
        return super().check(grid, global_batch)

    def layout(self, model: GPT, sample_shape: tuple[int, ...], grid: GridShape,
               global_batch: int | None) -> Layout:
        """The GPT's tensor-parallel layout on `grid` (`auto`: priced for the strategy's
        global batch where it knows one)."""
        batch = self.pricing.global_batch if self.pricing.global_batch is not None else global_batch
        key = (repr(model), next(model.parameters()).dtype, tuple(sample_shape), grid, batch,
               self.tp_layout)
        if key not in self._layouts:
            self._layouts[key] = choose_layout(self, self.tp_layout, model, sample_shape, grid,
                                               batch)
        return self._layouts[key]

    def module_plan(self, model: nn.Module, sample_shape: tuple[int, ...],
                    pr: int) -> ModulePlan | None:
        """The model's parallel plan by module name: the user's, else its own, else (for a
        model the torch.fx rules would split) one derived from its structure, else None."""
        if not self.use_plans:
            return None
        if isinstance(model, nn.Sequential) or as_gpt(model) is not None:
            return module_plan(model, self.plan)
        return module_plan(model, self.plan, sample_shape, pr)

    def plan_modules(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                     global_batch: int) -> tuple[str, list[PlannedModule]] | None:
        """Where the model's plan by module name comes from, and each of its modules with its
        style and predicted bytes per step (None: it has no plan)."""
        plan = self.module_plan(model, sample_shape, grid.pr)
        if plan is None:
            return None
        return plan.source, plan_module_bytes(model, plan, sample_shape, grid, global_batch,
                                              self.bucket_caps, self.pricing.compute_dtype)

    def split(self, model: nn.Sequential) -> int:
        """Layers before this index run batch-parallel; the rest are split over the model group."""
        return split_at_first_linear(model)

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        if (plan := self.module_plan(model, sample_shape, grid.pr)) is not None:
            return [f"strategy={self.name}: {p}"
                    for p in plan_problems(plan, model, sample_shape, grid.pr, grid.pc)]
        if (gpt := as_gpt(model)) is not None:
            return gpt_problems(gpt, grid.pr, self.name)
        if not isinstance(model, nn.Sequential):
            return tree_problems(model, sample_shape, self.name, self.tree_mode,
                                 grid.pr)
        problems = sequential_problems(model, self.name)
        if problems or grid.pr == 1:
            return problems
        assert isinstance(model, nn.Sequential)
        return [f"strategy={self.name} cannot split {p}"
                for p in whole_norm_problems(list(model), self.split(model))]

    def _draws_by_plan(self, model: nn.Module, sample_shape: tuple[int, ...],
                       grid: GridShape) -> DrawPlan | None:
        """The draws a planned model makes by rows as one process does (`PlannedModel`), None
        where it has no plan of split weights, or a plan whose sequence region or whole weights
        run on pieces of the positions, which draw otherwise."""
        plan = self.module_plan(model, sample_shape, grid.pr)
        if plan is None or plan.whole_weights or any(
                style.name == "sequence" for style in plan.styles.values()):
            return None
        return draw_plan(model, sample_shape)

    def reproduces_random_draws(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape) -> bool:
        draws = self._draws_by_plan(model, sample_shape, grid)
        if draws is not None:
            return not draws.problems
        return super().reproduces_random_draws(model, sample_shape, grid)

    def draws_rows_alike(self, model: nn.Module, sample_shape: tuple[int, ...],
                         grid: GridShape) -> bool:
        draws = self._draws_by_plan(model, sample_shape, grid)
        if draws is not None:
            return not draws.problems and None not in draws.cuts
        return super().draws_rows_alike(model, sample_shape, grid)

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        if (plan := self.module_plan(model, sample_shape, grid.pr)) is not None:
            return build_planned_model(model, plan, sample_shape, grid, sync_replica_gradients,
                                       self.bucket_cap_bytes, self.first_bucket_bytes)
        if (gpt := as_gpt(model)) is not None:
            return build_tensor_parallel(
                gpt, grid, self.layout(gpt, sample_shape, grid.shape, None),
                sync_replica_gradients, self.bucket_cap_bytes, self.first_bucket_bytes)
        if not isinstance(model, nn.Sequential):
            return build_tree_model(model, sample_shape, grid, self.tree_mode,
                                    sync_replica_gradients, self.bucket_caps)
        return build_grid_model(model, grid, self.split(model), sync_replica_gradients,
                                self.bucket_cap_bytes, self.first_bucket_bytes)

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        if (plan := self.module_plan(model, sample_shape, grid.pr)) is not None:
            return predict_plan_ops(model, plan, sample_shape, grid, global_batch,
                                    self.bucket_caps, self.pricing.compute_dtype)
        if (gpt := as_gpt(model)) is not None:
            return predict_tp_ops(gpt, sample_shape, grid, global_batch,
                                  self.layout(gpt, sample_shape, grid, global_batch),
                                  self.bucket_caps, self.pricing.compute_dtype)
        if not isinstance(model, nn.Sequential):
            return predict_tree_ops(model, sample_shape, grid, global_batch,
                                    self.tree_mode, self.bucket_caps, self.pricing.compute_dtype)
        return predict_grid_ops(model, self.split(model), sample_shape, grid, global_batch,
                                self.bucket_caps, self.pricing.compute_dtype)

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        if (plan := self.module_plan(model, sample_shape, grid.pr)) is not None:
            return plan_param_bytes(model, plan, grid.pr)
        if (gpt := as_gpt(model)) is not None:
            return tp_param_bytes(gpt, grid.pr,
                                  self.layout(gpt, sample_shape, grid, self.pricing.global_batch))
        if not isinstance(model, nn.Sequential):
            return tree_param_bytes(model, sample_shape, self.tree_mode, grid.pr)
        return split_param_bytes(list(model), self.split(model), grid.pr)

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if (plan := self.module_plan(model, sample_shape, grid.pr)) is not None:
            return plan_activation_bytes(model, plan, sample_shape, grid, global_batch,
                                         self.pricing.compute_dtype)
        if (gpt := as_gpt(model)) is not None:
            return tp_activation_bytes(gpt, sample_shape, grid, global_batch,
                                       self.layout(gpt, sample_shape, grid, global_batch),
                                       activation_itemsize([gpt], self.pricing.compute_dtype))
        if not isinstance(model, nn.Sequential):
            return tree_activation_bytes(model, sample_shape, grid, global_batch,
                                         self.tree_mode, self.pricing.compute_dtype)
        layers, split = list(model), self.split(model)
        rows = Partition(global_batch, grid.pc).sizes[0]
        prefix_sizes = feature_sizes(layers[:split], sample_shape) if split else []
        elements = 0
        if whole_param_items(layers[:split]) and grid.pr > 1:  # batch-parallel, then gathered
            elements += Partition(rows, grid.pr).sizes[0] * sum(prefix_sizes)
            elements += rows * prefix_sizes[-1]
        else:
            elements += rows * sum(prefix_sizes)
        elements += body_activation_elements(layers, plan_layers(layers, split, grid.pr),
                                             sample_shape, rows, grid.pr)
        return elements * activation_itemsize(layers, self.pricing.compute_dtype)

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if (plan := self.module_plan(model, sample_shape, grid.pr)) is not None:
            return plan_compute_seconds(model, plan, sample_shape, grid, global_batch,
                                        self.pricing.rates)
        if (gpt := as_gpt(model)) is not None:
            return tp_compute_seconds(gpt, sample_shape, grid, global_batch,
                                      self.layout(gpt, sample_shape, grid, global_batch),
                                      self.pricing.rates)
        return super().predict_compute_seconds(model, sample_shape, grid, global_batch)
