"""A module tree's parallel model under its plan (`strategies.layers.tree`), and what the plan
predicts it moves and holds in a training step. The model runs the plan's steps in order, each
node's inputs converted to the layouts its step needs (the conversions of the plan's module
docstring, each a collective with its adjoint as its backward); the predictions walk the same
steps, so measured bytes equal predicted bytes by construction of one plan for both."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.primitives import all_gather, repartition
from runner.cost.collectives import CommOp
from strategies.base import ParallelModel, split_model_exchanges
from strategies.exchange.buckets import predict_gradient_ops
from strategies.layers.split import activation_itemsize
from strategies.layers.tree import Mode, plan_tree
from strategies.layers.tree_steps import (
    INPUT,
    OUTPUT,
    BuildParts,
    Layout,
    PredictParts,
    Step,
    TreePlan,
    tensor_inputs,
)
from strategies.probe import logits_of


class TreeParallelModel(ParallelModel):
    """Runs the plan: each node's module (split where the plan splits it) or function on its
    inputs converted to the layouts it needs."""

    def __init__(self, grid: ProcessGrid, plan: TreePlan,
                 split_modules: dict[str, nn.Module]) -> None:
        super().__init__(grid)
        self.plan = plan
        self.graph_modules = nn.ModuleDict({_key(name): module
                                            for name, module in split_modules.items()})

    def _module(self, target: str) -> nn.Module:
        return self.graph_modules[_key(target)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.grid.model
        values = _Values(self.plan, comm, Partition(x.shape[0], comm.size))
        result: Any = None
        for step in self.plan.steps:
            node = step.node
            if step.rule is INPUT:
                values.put(node, x, "whole")
                continue
            args, kwargs = values.arguments(step)
            if step.rule is OUTPUT:
                result = args[0]
                break
            if node.op == "call_module":
                out = self._module(str(node.target))(*args, **kwargs)
            elif node.op == "call_function":
                out = node.target(*args, **kwargs)  # type: ignore[operator]
            else:
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            values.put(node, out, step.out)
        return logits_of(result)


class _Values:
    """One forward's value of each node in its layout, and the conversions made of them: a
    value converted once is reused by every node that needs it in that layout."""

    def __init__(self, plan: TreePlan, comm: CountedComm, rows: Partition) -> None:
        self.plan, self.comm, self.rows = plan, comm, rows
        self.values: dict[str, torch.Tensor | Any] = {}
        self.layouts: dict[str, Layout | None] = {}
        self.converted: dict[tuple[str, Layout], torch.Tensor] = {}

    def put(self, node: torch.fx.Node, value: Any, layout: Layout | None) -> None:
        self.values[node.name], self.layouts[node.name] = value, layout

    def arguments(self, step: Step) -> Any:
        """The node's args and kwargs, each tensor input in the layout the step needs."""
        def argument(n: torch.fx.Node) -> Any:
            if n.name not in step.needs:
                return self.values[n.name]
            return self.in_layout(n.name, step.needs[n.name])

        return torch.fx.node.map_arg((step.node.args, step.node.kwargs), argument)

    def in_layout(self, name: str, needed: Layout) -> Any:
        value, have = self.values[name], self.layouts[name]
        if have is None or have == needed or not isinstance(value, torch.Tensor):
            return value
        key = (name, needed)
        if key not in self.converted:
            self.converted[key] = self._convert(value, have, needed, name)
        return self.converted[key]

    def _convert(self, value: torch.Tensor, have: Layout, needed: Layout,
                 name: str) -> torch.Tensor:
        """`value` from layout `have` to `needed` (module docstring)."""
        comm, rows = self.comm, self.rows
        channels = self.plan.channels.get(name, 0)
        if have == "whole" and needed == "slab":  # every rank has the image: its rows, no message
            return value.narrow(2, *_slab(value.shape[2], comm))
        if have == "slab":  # the boundary: the slabs all-gathered in height (adjoint: scatter)
            height = self.plan.shapes[name][1]  # the whole height, from its per-sample shape
            value = all_gather(value, comm, 2, Partition(height, comm.size), label=name)
            have = "whole"
            if needed == "whole":
                return value
        if have == "split" and needed == "whole":
            return all_gather(value, comm, 1, Partition(channels, comm.size), label=name)
        if have == "rows" and needed == "whole":
            return all_gather(value, comm, 0, rows, label=name)
        if have == "whole" and needed == "rows":
            return value[rows.slice(comm.rank)]
        if have == "split" and needed == "rows":
            return repartition(value, comm, 1, Partition(channels, comm.size), 0, rows,
                               label=name)
        raise AssertionError(f"no conversion from {have} to {needed}")


def _slab(height: int, comm: CountedComm) -> tuple[int, int]:
    """This rank's rows of an image `height` rows high: (start, length)."""
    rows = Partition(height, comm.size).slice(comm.rank)
    return rows.start, rows.stop - rows.start


def _key(name: str) -> str:
    return name.replace(".", "__") or "root"


def build_tree_model(model: nn.Module, sample_shape: Sequence[int], grid: ProcessGrid,
                     mode: Mode, sync_replica_gradients: bool, caps: tuple[int, int],
                     overlap: bool = True) -> TreeParallelModel:
    """This rank's part of `model` under the plan (see the module docstring); `caps`: the
    gradient buckets' (`bucket_cap_bytes`, `first_bucket_bytes`); `overlap`: domain's halo
    exchanges overlap the rows that need none."""
    plan = plan_tree(model, sample_shape, mode, grid.pr)
    modules = plan.modules()
    local = CountedComm(None, grid.counter, "self")
    parts = BuildParts(plan, grid, grid.batch if sync_replica_gradients else local,
                       grid.world if sync_replica_gradients else grid.model, overlap)
    built: dict[str, nn.Module] = {}
    split_params: list[nn.Parameter] = []
    whole_params: list[nn.Parameter] = []
    for step in plan.steps:
        if step.node.op != "call_module":
            continue
        target = str(step.node.target)
        if target in built:  # a module called at several nodes: one part, one set of weights
            continue
        built[target] = step.rule.build(modules[target], step, parts)
        # its own pieces, or the module's parameters (a halo wrapper holds the very module)
        (split_params if step.rule.splits else whole_params).extend(built[target].parameters())
    pmodel = TreeParallelModel(grid, plan, built)
    pmodel.replicated_in_model_group = whole_params
    pmodel.reducers = split_model_exchanges(grid, split_params, whole_params,
                                            sync_replica_gradients, *caps)
    return pmodel


# -- predictions ------------------------------------------------------------------------------


def predict_tree_ops(model: nn.Module, sample_shape: Sequence[int], grid: GridShape,
                     global_batch: int, mode: Mode, caps: tuple[int, int],
                     compute_dtype: torch.dtype | None) -> list[CommOp]:
    """What model-group rank 0 of batch group 0 moves in one training step under the plan
    (`compute_dtype`: the activations' under mixed precision, else the parameters')."""
    plan = plan_tree(model, sample_shape, mode, grid.pr)
    modules = plan.modules()
    pr, pc = grid.pr, grid.pc
    rows = Partition(global_batch, pc).sizes[0]
    parts = PredictParts(plan, grid, rows, activation_itemsize([model], compute_dtype),
                         activation_itemsize([model]))  # batch statistics: the parameters'
    ops: list[CommOp] = []
    layouts: dict[str, Layout | None] = {}
    done: set[tuple[str, Layout]] = set()
    split_items: list[tuple[str, list[tuple[int, torch.dtype]]]] = []
    whole_items: list[tuple[str, list[tuple[int, torch.dtype]]]] = []
    seen: set[str] = set()
    needs_grad: dict[str, bool] = {}  # whether a value's gradient is computed (halos go back)
    for step in plan.steps:
        node = step.node
        inputs = tensor_inputs(node)
        needs_grad[node.name] = any(needs_grad.get(n.name, False) for n in inputs)
        for name, needed in step.needs.items():
            have = layouts.get(name)
            if have is None or have == needed or (name, needed) in done:
                continue
            done.add((name, needed))
            ops += _conversion_ops(parts, name, have, needed, needs_grad.get(name, False))
        layouts[node.name] = step.out
        if node.op != "call_module":
            continue
        module = modules[str(node.target)]
        label = str(node.target)
        needs_grad[node.name] |= any(p.requires_grad for p in module.parameters())
        source = inputs[0].name if inputs else ""
        ops += step.rule.module_ops(module, step, parts, needs_grad.get(source, False))
        if label in seen:
            continue
        seen.add(label)
        items = _param_items(module, step, plan, pr)
        if items:
            (split_items if step.rule.splits else whole_items).append((label, items))
    return (ops + predict_gradient_ops(split_items, "batch", pc, *caps)
            + predict_gradient_ops(whole_items, "world", grid.size, *caps))


def _conversion_ops(parts: PredictParts, name: str, have: Layout, needed: Layout,
                    backward: bool) -> list[CommOp]:
    """What converting the value of node `name` from `have` to `needed` moves (and its adjoint
    moves back, when the value has a gradient)."""
    pr, rows, itemsize = parts.grid.pr, parts.rows, parts.itemsize
    per_sample = math.prod(parts.plan.shapes[name])
    # a gather (of channels, rows or height: a slab made rows is gathered first), and its adjoint
    if pr > 1 and (needed == "whole" or (have == "slab" and needed == "rows")):
        n = rows * per_sample * itemsize
        return ([CommOp("allgather", "model", pr, n, name)]
                + ([CommOp("reduce_scatter", "model", pr, n, name)] if backward else []))
    if pr > 1 and have == "split" and needed == "rows":
        channels = parts.plan.channels[name]
        shard = per_sample // channels * Partition(channels, pr).sizes[0]
        own_rows = Partition(rows, pr).sizes[0]
        return [CommOp("alltoall", "model", pr, rows * shard * itemsize, name),
                CommOp("alltoall", "model", pr, own_rows * per_sample * itemsize, name)]
    return []


def tree_param_bytes(model: nn.Module, sample_shape: Sequence[int],
                     mode: Mode, pr: int) -> int:
    """Rank 0's parameter bytes under the plan."""
    plan = plan_tree(model, sample_shape, mode, pr)
    modules = plan.modules()
    return sum(nbytes for step in plan.steps if step.node.op == "call_module"
               for nbytes, _ in _param_items(modules[str(step.node.target)], step, plan, pr))


def _param_items(module: nn.Module, step: Step, plan: TreePlan, pr: int
                 ) -> list[tuple[int, torch.dtype]]:
    """(bytes, dtype) of each of rank 0's parameters of the node's module: its piece where
    the rule splits them, else all of them."""
    if not step.rule.splits:
        return [(p.numel() * p.element_size(), p.dtype) for p in module.parameters()]
    total = step.rule.split_size(module, plan, step)
    mine = Partition(total, pr).sizes[0]
    return [(p.numel() // total * mine * p.element_size(), p.dtype) for p in module.parameters()]


def tree_activation_bytes(model: nn.Module, sample_shape: Sequence[int], grid: GridShape,
                          global_batch: int, mode: Mode, compute_dtype: torch.dtype | None
                          ) -> int:
    """Bytes of node outputs rank 0 keeps for backward in one step (an estimate: split and
    batch-parallel values are 1/Pr of the group's, whole ones all of it)."""
    plan = plan_tree(model, sample_shape, mode, grid.pr)
    rows = Partition(global_batch, grid.pc).sizes[0]
    total = 0
    for step in plan.steps:
        shape = plan.shapes.get(step.node.name)
        if shape is None or step.out is None:
            continue
        share = rows if step.out == "whole" else -(-rows // grid.pr)
        total += share * math.prod(shape)
    return total * activation_itemsize([model], compute_dtype)
