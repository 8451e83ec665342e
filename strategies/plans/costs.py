"""What a model split by a parallel plan by module name (`strategies.plans.module_plan`) costs,
for the predicted step time and the planner.

`plan_module_bytes`: each planned module's bytes per step, its own collectives and its
parameters' gradient exchange. `plan_compute_seconds`: the compute from the local shapes each
style computes with, as `strategies.layouts.layer`' stand-ins do for layer layouts: every rank
of a model group runs all of its group's rows; a colwise projection makes its rank's output
features, a rowwise one reads its rank's input features, a vocab table holds its rank's rows;
what runs between a split output and the next rowwise projection (an MLP's activation) runs on
the rank's features; a `sequence` module in the region runs on the rank's positions
(`strategies.plans.sequence_parallel`); the operators a module holding colwise projections runs
itself (attention's products and softmax) on its rank's heads; everything else runs whole. Under
`strategy=domain` (every weight whole) the modules in the region that run on a rank's positions
(the `sequence` ones, activations, the blocks' own operators) are priced on T/Pr positions,
everything else (the attention, gathered) on the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runner.core import GridShape, Partition
from runner.cost.compute import ComputeRates
from runner.cost.layers import layer_seconds
from strategies.base import operators_seconds
from strategies.plans.module_plan import (
    ModulePlan,
    gathered_path,
    plan_param_items,
    plan_region,
    predict_plan_ops,
)
from strategies.plans.styles import Colwise, PlanStyle, Projection, VocabHead
from strategies.probe import probe


def local_module(module: nn.Module, style: PlanStyle | None, pr: int) -> nn.Module:
    """A stand-in on the meta device with the shapes rank 0 computes with under `style`
    (None: the module is not planned, and runs whole)."""
    if style is not None:
        return style.stand_in(module, pr)
    projection = Projection.of(module)
    if projection is not None and projection.transposed:
        # a Conv1D kept whole: priced as the Linear it computes
        return nn.Linear(projection.in_features, projection.out_features,
                         bias=getattr(module, "bias", None) is not None, device="meta")
    return module


def plan_compute_seconds(model: nn.Module, plan: ModulePlan, sample_shape: tuple[int, ...],
                         grid: GridShape, global_batch: int, rates: ComputeRates) -> float:
    """Rank 0's forward and backward compute per step under `plan`, at `rates`, unslowed."""
    rows = Partition(global_batch, grid.pc).sizes[0]
    if plan.whole_weights:
        return _domain_compute_seconds(model, plan, sample_shape, grid, rows, rates)
    with torch.random.fork_rng(devices=[]):
        calls = probe(model, sample_shape).calls
    gathered = gathered_path(plan, model, sample_shape)
    styled = {id(model.get_submodule(p)): (p, s) for p, s in plan.splits().items()}
    split_widths: set[int] = set()  # features a split output left split, until a rowwise
    sequence, _ = plan_region(plan, model, sample_shape, grid.pr)
    total = 0.0
    for call in calls:
        shape = (rows, *call.input_shape)
        path_style = styled.get(id(call.module))
        if path_style is not None:
            path, style = path_style
            if sequence is not None and path in sequence.sharded:
                shape = (*shape[:-2], shape[-2] // grid.pr, shape[-1])
            module = local_module(call.module, style, grid.pr)
            name = style.name
            projection = Projection.of(call.module)
            if name in ("rowwise", "rowwise_split_input") and projection is not None:
                shape = (*shape[:-1], Partition(projection.in_features, grid.pr).sizes[0])
                split_widths.clear()
            elif (isinstance(style, Colwise) and style.splits_output and projection is not None
                    and path != gathered):
                chunks = getattr(plan.styles[path], "chunks", 1)
                split_widths.add(projection.out_features // chunks)
        else:
            module = local_module(call.module, None, grid.pr)
            if (shape[-1] in split_widths
                    and not any(True for _ in call.module.parameters(recurse=False))):
                shape = (*shape[:-1], Partition(shape[-1], grid.pr).sizes[0])
        total += layer_seconds(module, shape, rates, input_grad=call.input_grad)
    # A module that holds split projections runs its own operators (attention's products and
    # softmax, rotary embeddings, a gated MLP's product) on its rank's heads or features.
    split_owners = {id(_parent(model, path)) for path, style in plan.splits().items()
                    if isinstance(style, Colwise) and style.splits_output
                    and not isinstance(style, VocabHead) and path != gathered}
    return total + operators_seconds(
        model, sample_shape, rows, rates,
        share=lambda owner: 1 / grid.pr if id(owner) in split_owners else 1.0)


def _domain_compute_seconds(model: nn.Module, plan: ModulePlan, sample_shape: tuple[int, ...],
                            grid: GridShape, rows: int, rates: ComputeRates) -> float:
    """Rank 0's compute under a plan of whole weights: the region's modules on pieces of the
    sequence on T/Pr positions, every other module whole."""
    region, _ = plan_region(plan, model, sample_shape, grid.pr)
    on_pieces = region.on_pieces if region is not None else set()
    paths = {id(module): path for path, module in model.named_modules()}
    with torch.random.fork_rng(devices=[]):
        calls = probe(model, sample_shape).calls
    total = 0.0
    for call in calls:
        shape = (rows, *call.input_shape)
        if paths.get(id(call.module)) in on_pieces and len(shape) >= 3:
            shape = (*shape[:-2], Partition(shape[-2], grid.pr).sizes[0], shape[-1])
        total += layer_seconds(local_module(call.module, None, grid.pr), shape, rates,
                               input_grad=call.input_grad)
    return total + operators_seconds(
        model, sample_shape, rows, rates,
        share=lambda owner: 1 / grid.pr if paths.get(id(owner)) in on_pieces else 1.0)


def _parent(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path.rpartition(".")[0])


@dataclass(frozen=True)
class PlannedModule:
    """A module of a plan, its style and the bytes rank 0 moves for it per step."""

    path: str
    style: str
    comm_bytes: int


def plan_module_bytes(model: nn.Module, plan: ModulePlan, sample_shape: tuple[int, ...],
                      grid: GridShape, global_batch: int, caps: tuple[int, int],
                      compute_dtype: torch.dtype | None = None) -> list[PlannedModule]:
    """Each module of `plan` in `named_modules` order: the collectives its forward and backward
    issue, and its parameters' share of the gradient buckets (split ones over the batch group,
    whole ones over the world)."""
    ops = predict_plan_ops(model, plan, sample_shape, grid, global_batch, caps, compute_dtype)
    split, whole = plan_param_items(model, plan, grid.pr)
    found = []
    for path, style in plan.styles.items():
        own = sum(op.nbytes for op in ops if op.layer in (path, path + " out"))
        if grid.pc > 1:
            own += sum(n for label, items in split if label == path for n, _ in items)
        if grid.size > 1:
            own += sum(n for label, items in whole if label == path for n, _ in items)
        found.append(PlannedModule(path, style.name, own))
    return found
