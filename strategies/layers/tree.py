"""`model`, `grid` and `domain` over module trees (ResNets, a user's own modules), not only
sequences.

The model is traced by torch.fx into a graph of its modules and functions in the order they
run (a residual block's shortcut reads the block's input; the addition is a node of its own),
and each node gets a rule by its module type or function. A rule says in which *layout* it
needs its inputs and which layout its output has; where a value's layout differs from what a
node needs, the conversion between them is the communication (`runner.core.primitives`, each
with its adjoint as its backward). Layouts of an activation within a model group (the batch
group always splits the rows of the global batch):

- `whole`: every rank of the model group holds all of the group's rows, all channels;
- `split`: all of the group's rows, this rank's slice of the channels (dim 1), as a split
  Linear or Conv2d outputs them (`Partition(C, Pr)`);
- `rows`: this rank's sub-shard of the group's rows, all channels (batch-parallel);
- `slab` (domain): all of the group's rows, this rank's rows of the image's height (dim 2).

Conversions: split → whole is an all-gather of dim 1 over the model group (adjoint:
reduce-scatter); rows → whole an all-gather of dim 0; whole → rows keeps this rank's rows (no
communication: the gather that made the value whole sums the gradients back); split → rows a
repartition (an all-to-all each way); whole → slab keeps this rank's height rows, slab → whole
all-gathers the height (domain's boundary). A value converted once is reused by every node that
needs it in that layout (a block's input feeds its first convolution and its projection).

Rules:
- Linear, Conv2d (ungrouped): under `model`, and under `grid` from the first Linear on, split
  by output features/channels (`strategies.layers.split`): input whole, output split, gradients
  summed over the batch group. Under `grid`, nodes before the first Linear run batch-parallel
  (`rows`), their weights whole and summed over every rank.
- BatchNorm: in `split`, its channels' slice with statistics over the batch group; in `rows`,
  whole with statistics over every rank (`strategies.layers.norm`). On whole features it is
  refused (each rank would hold a partial gradient of its weights). LayerNorm, GroupNorm and
  InstanceNorm normalize each sample by itself: batch-parallel (`rows`) they run as they are;
  anywhere else they are refused (on slabs they would need every slab's statistics).
- Channel-local modules (activations, pooling incl. adaptive, Dropout, Identity; a user adds
  types with `register_channel_local`) and elementwise functions: any layout, kept.
- Flatten, view/reshape/flatten: whole or rows (a split input is gathered first).
- Additions and other elementwise joins: inputs in one layout (split with split, else all made
  whole, or rows where one already is).
- Concatenation along dim 1: whole or rows inputs.
- A module without parameters that has no rule runs on whole (or rows) inputs, on every rank of
  the group: correct for anything that treats samples independently; one with parameters and
  no rule is refused with its name and type, before any rank starts, as is any function with
  no rule.
- Under `domain`, from the input on, as long as every node has a rule on height slabs: Conv2d
  and pooling exchange halos (`SpatialWindowed`, overlapped), BatchNorm2d takes every rank's
  slab statistics, row-local modules, elementwise functions and additions (a residual block's
  branches are on the same slabs: one partition per height) run on the slab; every slab
  output needs a row on each rank. The first node with no slab rule (a global pooling, a
  Flatten) gathers the height, and the rest follows `model`'s rules.
- The output: each rank's own rows (the row contract of `strategies.base`).

The plan is a list of steps (`strategies.layers.tree_steps`: each node's rule and layouts, and
what the rule builds and moves); `strategies.layers.tree_model` runs it and predicts from the
same plan, node by node, what moves, so measured bytes equal predicted bytes by construction of
one plan for both.
"""

from __future__ import annotations

import contextlib
import io
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from strategies.layers.norm import BATCH_NORMS, batch_norm_problem
from strategies.layers.spatial import ROW_LOCAL, WINDOWED, windowed_problem
from strategies.layers.split import CHANNEL_LOCAL, SHARDABLE
from strategies.layers.tree_steps import (
    FUNCTION,
    INPUT,
    LOCAL,
    NORM_ROWS,
    NORM_SLAB,
    NORM_SPLIT,
    OUTPUT,
    SPLIT,
    WINDOWED_RULE,
    Layout,
    Rule,
    Step,
    TreePlan,
    tensor_inputs,
)
from strategies.probe import sample_dtype

Mode = Literal["model", "grid", "domain"]  # the strategy whose rules apply

_channel_local: list[type[nn.Module]] = [
    *CHANNEL_LOCAL, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Dropout, nn.Dropout2d,
    nn.Hardtanh, nn.Softplus, nn.Mish, nn.Hardswish, nn.PReLU]


def register_channel_local(module_type: type[nn.Module]) -> type[nn.Module]:
    """Declare a user's module type as acting on each channel (and sample) alone: it then runs
    on split channels, whole or rows as they come. Usable as a class decorator."""
    _channel_local.append(module_type)
    return module_type


_ELEMENTWISE_FUNCTIONS: set[Any] = {
    F.relu, torch.relu, F.gelu, torch.sigmoid, torch.tanh, F.silu, F.leaky_relu, F.dropout,
    F.relu6, F.elu, F.hardtanh}
_JOIN_FUNCTIONS: set[Any] = {operator.add, operator.iadd, torch.add, operator.mul, torch.mul,
                             operator.sub, torch.sub}
_ELEMENTWISE_METHODS = {"relu", "relu_", "sigmoid", "tanh", "add", "add_", "mul", "mul_",
                        "contiguous"}
_RESHAPING_METHODS = {"view", "reshape", "flatten"}
_PASS_METHODS = {"size", "dim"}


# Normalizations over each sample's own features: batch-parallel they are local and exact.
PER_SAMPLE_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d)


class TreeRefused(ValueError):
    """A node no rule can split correctly (the message names it)."""


def trace(model: nn.Module, sample_shape: Sequence[int]) -> tuple[torch.fx.GraphModule,
                                                                  dict[str, tuple[int, ...]]]:
    """The model's graph, and every node's per-sample output shape (two samples pushed through
    in evaluation mode, on the model's device: no memory or compute on the meta device)."""
    # tracing runs the forward's own code on the model's buffers (timm's num_batches_tracked)
    buffers = {name: b.clone() for name, b in model.named_buffers() if b.device.type != "meta"}
    try:
        graph = torch.fx.GraphModule(model, _Tracer().trace(model))
    except Exception as exc:  # data-dependent control flow, unsupported Python
        _put_back(model, buffers)
        raise TreeRefused(f"torch.fx cannot trace {type(model).__name__}: "
                          f"{type(exc).__name__}: {exc}") from None
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    training = model.training
    model.eval()
    graph.eval()
    # Two samples, never one: a module whose forward reads `self.training` is traced as it was
    # (timm's BatchNormAct2d: batch statistics), and one value per channel cannot give them.
    # Whatever tracing or such a graph updates (running statistics) is put back.
    try:
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints
            ShapeProp(graph).propagate(torch.zeros(2, *sample_shape, device=device,
                                                   dtype=sample_dtype(model)))
    except Exception as exc:  # the traced graph does not run as the model does
        cause = exc.__cause__ or exc  # ShapeProp's error holds the node's own
        first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        raise TreeRefused(f"{type(model).__name__}: its traced graph does not run ({first})"
                          ) from None
    finally:
        model.train(training)
        graph.train(training)
        _put_back(model, buffers)
    shapes = {}
    for node in graph.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            shapes[node.name] = tuple(meta.shape[1:])
    return graph, shapes


def _put_back(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with a user's registered module types kept whole (a leaf: their rule
    applies to the module, not to what is inside)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, tuple(_channel_local)) or super().is_leaf_module(
            m, module_qualified_name)


def _function_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


def plan_tree(model: nn.Module, sample_shape: Sequence[int], mode: Mode,
              pr: int) -> TreePlan:
    """The rule of every node under `mode`'s rules (see the module docstring); under grid the
    nodes before the first Linear run batch-parallel, under domain the nodes before the first
    one with no rule on height slabs (`_slab_step`). Raises `TreeRefused`."""
    graph, shapes = trace(model, sample_shape)
    planning = _Planning(model, dict(graph.named_modules()), shapes, pr)
    first_linear = _first_linear(graph, planning.modules)
    plan = TreePlan(graph, [], shapes)
    spatial = mode == "domain"
    for index, node in enumerate(graph.graph.nodes):
        in_prefix = (mode == "grid" and pr > 1
                     and (first_linear is None or index < first_linear))
        step = _slab_step(node, planning) if spatial else None
        if step is None:
            spatial = False
            step = _step(node, planning, in_prefix)
        layout = planning.layout
        layout[node.name] = step.out
        if step.out == "split":
            plan.channels[node.name] = shapes[node.name][0]
        if step.rule is NORM_SPLIT:
            source = tensor_inputs(node)[0].name
            plan.channels.setdefault(source, shapes[source][0])
        for name, needed in step.needs.items():
            if layout[name] == "split" and needed != "split":
                plan.channels.setdefault(name, shapes[name][0])
        plan.steps.append(step)
    return plan


def _first_linear(graph: torch.fx.GraphModule, modules: dict[str, nn.Module]) -> int | None:
    """The index of the graph's first Linear node (grid's batch-parallel part ends there): 0
    when nothing before it has parameters, None when there is none."""
    first = next((i for i, node in enumerate(graph.graph.nodes)
                  if node.op == "call_module"
                  and isinstance(modules[str(node.target)], nn.Linear)), None)
    if first is not None and not any(
            node.op == "call_module" and any(True for _ in modules[str(node.target)].parameters())
            for node in list(graph.graph.nodes)[:first]):
        return 0  # nothing to train before it: no batch-parallel part (as a Sequential)
    return first


@dataclass
class _Planning:
    """What the rules read while `plan_tree` walks the graph: the traced model and its modules,
    every node's per-sample output shape, the model group's size, the layouts chosen so far."""

    model: nn.Module
    modules: dict[str, nn.Module]
    shapes: dict[str, tuple[int, ...]]
    pr: int
    layout: dict[str, Layout | None] = field(default_factory=dict)


def _slab_step(node: torch.fx.Node, planning: _Planning) -> Step | None:
    """Under domain: the node's rule on height slabs, or None when it has none (the spatial
    part ends there; a refused layer raises). Convolutions and pooling exchange halos,
    BatchNorm takes every rank's statistics, row-local modules, elementwise functions and
    additions run on the slab as it is. Every slab output needs a row on every rank."""
    if node.op == "placeholder":
        return Step(node, INPUT, {}, "whole")
    inputs = {n.name: planning.layout.get(n.name) for n in tensor_inputs(node)}
    if any(value not in ("slab", "whole") for value in inputs.values()) or not inputs:
        return None
    needs: dict[str, Layout] = {name: "slab" for name in inputs}
    if node.op == "call_module":
        module = planning.modules[str(node.target)]
        if isinstance(module, WINDOWED):
            problem = windowed_problem(module)
            if problem is not None:
                raise TreeRefused(f"{node.target} ({module}): {problem}")
            rule: Rule = WINDOWED_RULE
        elif isinstance(module, nn.BatchNorm2d):
            problem = batch_norm_problem(module)
            if problem is not None:
                raise TreeRefused(f"{node.target}: {problem}")
            rule = NORM_SLAB
        elif isinstance(module, ROW_LOCAL):
            rule = LOCAL
        else:
            return None
    elif _elementwise(node):
        rule = FUNCTION
    else:
        return None
    shape = planning.shapes.get(node.name, ())
    if len(shape) != 3:
        return None
    if shape[1] < planning.pr:
        raise TreeRefused(f"{node.name}: strategy=domain splits each sample's height over "
                          f"grid.pr={planning.pr} ranks, but it outputs height {shape[1]}: "
                          f"every rank needs a row (use a smaller grid.pr or taller inputs)")
    return Step(node, rule, needs, "slab")


def _elementwise(node: torch.fx.Node) -> bool:
    """A function or method acting element by element (or joining same-shaped inputs)."""
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS or node.target in _JOIN_FUNCTIONS
    return node.op == "call_method" and str(node.target) in _ELEMENTWISE_METHODS


def _same_or_whole(layouts: list[Layout]) -> Layout:
    if len(set(layouts)) == 1:
        return layouts[0]
    return "rows" if "rows" in layouts and "split" not in layouts else "whole"


def _unsplit(layout: Layout | None) -> Layout:
    return "whole" if layout in (None, "split") else layout


@dataclass(frozen=True)
class _Node:
    """A node as its rule sees it past the spatial part: its tensor inputs that have a layout
    (a slab counts as whole there: it is gathered where it is needed), and whether it is in
    grid's batch-parallel part (before the first Linear)."""

    node: torch.fx.Node
    planning: _Planning
    inputs: dict[str, Layout]
    in_prefix: bool

    @property
    def first(self) -> Layout | None:
        """Its first tensor input's layout."""
        return next(iter(self.inputs.values()), None)

    def named(self, module: nn.Module) -> str:
        return f"{self.node.target} ({type(module).__name__})"

    def all_in(self, rule: Rule, layout: Layout | None) -> Step:
        """Every input taken in `layout`, the output in it."""
        return Step(self.node, rule, dict.fromkeys(self.inputs, layout),  # type: ignore[arg-type]
                    layout)

    def as_they_come(self, rule: Rule, out: Layout | None) -> Step:
        """Every input taken in the layout it has."""
        return Step(self.node, rule, dict(self.inputs), out)


def _step(node: torch.fx.Node, planning: _Planning, in_prefix: bool) -> Step:
    """The node's rule past the spatial part: by its kind (`_NODE_RULES`), then by its module
    type (`_MODULE_RULES`), function (`_FUNCTION_RULES`) or method (`_METHOD_RULES`)."""
    layouts = {n.name: planning.layout.get(n.name) for n in tensor_inputs(node)}
    inputs: dict[str, Layout] = {name: "whole" if value == "slab" else value
                                 for name, value in layouts.items() if value is not None}
    rule = _NODE_RULES.get(node.op)
    if rule is None:
        raise TreeRefused(f"{node.name}: {node.op} has no rule")
    return rule(_Node(node, planning, inputs, in_prefix))


# -- the rules by kind of node


def _input(at: _Node) -> Step:
    return Step(at.node, INPUT, {}, "whole")


def _output(at: _Node) -> Step:
    return Step(at.node, OUTPUT, dict.fromkeys(at.inputs, "rows"), None)  # each rank's own rows


def _attribute(at: _Node) -> NoReturn:
    owner = str(at.node.target).rpartition(".")[0]
    what = (f"{owner} ({type(at.planning.model.get_submodule(owner)).__name__})" if owner
            else "the model")
    raise TreeRefused(f"{what} uses its tensor {at.node.target} directly in forward, which "
                      f"has no rule: strategy=data trains it, or register its type with "
                      f"strategies.layers.tree.register_channel_local if it acts per channel")


def _module(at: _Node) -> Step:
    module = at.planning.modules[str(at.node.target)]
    if at.in_prefix and not isinstance(module, BATCH_NORMS):
        return _batch_parallel(at, module)
    rule = next((rule for types, rule in _MODULE_RULES if isinstance(module, tuple(types))),
                _module_without_rule)
    return rule(at, module)


def _function(at: _Node) -> Step:
    rule = _FUNCTION_RULES.get(at.node.target)
    if rule is None:
        raise TreeRefused(f"{at.node.name}: the function {_function_name(at.node.target)} "
                          f"has no rule")
    return rule(at)


def _method(at: _Node) -> Step:
    rule = _METHOD_RULES.get(str(at.node.target))
    if rule is None:
        raise TreeRefused(f"{at.node.name}: the method .{at.node.target}() has no rule")
    return rule(at)


# -- the rules of modules


def _split(at: _Node, module: nn.Module) -> Step:
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        raise TreeRefused(f"{at.named(module)}: a grouped convolution cannot be split by "
                          f"channel")
    return Step(at.node, SPLIT, dict.fromkeys(at.inputs, "whole"), "split")


def _batch_norm(at: _Node, module: nn.Module) -> Step:
    problem = batch_norm_problem(module)
    if problem is not None:
        raise TreeRefused(f"{at.named(module)}: {problem}")
    if at.in_prefix or at.first == "rows":
        return at.all_in(NORM_ROWS, "rows")
    if at.first == "split" or at.planning.pr == 1:  # one rank: its split is everything
        return at.as_they_come(NORM_SPLIT, "split")
    raise TreeRefused(f"{at.named(module)}: a BatchNorm on features no Linear or Conv2d "
                      f"before it has split (put it right after one)")


def _batch_parallel(at: _Node, module: nn.Module) -> Step:
    """Under grid before the first Linear: any module but a BatchNorm on this rank's rows."""
    if any(True for _ in module.parameters()) and not isinstance(
            module, (*SHARDABLE, *_channel_local, *PER_SAMPLE_NORMS)):
        raise TreeRefused(f"{at.named(module)} has parameters and no rule")
    return at.all_in(LOCAL, "rows")


def _per_sample_norm(at: _Node, module: nn.Module) -> NoReturn:
    raise TreeRefused(f"{at.named(module)}: a per-sample normalization needs every channel of "
                      f"its sample and would leave each rank a partial gradient of its "
                      f"weights; it runs batch-parallel only (strategy=grid before the first "
                      f"Linear, or strategy=data)")


def _channel_local_module(at: _Node, module: nn.Module) -> Step:
    if any(True for _ in module.parameters()) and at.first == "split":
        raise TreeRefused(f"{at.named(module)}: channel-local with parameters on split "
                          f"channels has no rule")
    return at.as_they_come(LOCAL, at.first)


def _module_without_rule(at: _Node, module: nn.Module) -> Step:
    """Flatten, and any module without parameters: on whole inputs (or rows)."""
    if any(True for _ in module.parameters()):
        raise TreeRefused(f"{at.named(module)} has parameters and no rule: strategy=data "
                          f"trains it, or register a rule")
    return at.all_in(LOCAL, _unsplit(at.first))


# -- the rules of functions and methods


def _kept(at: _Node) -> Step:
    """Elementwise: any layout, kept."""
    return at.as_they_come(FUNCTION, at.first)


def _joined(at: _Node) -> Step:
    """Additions and other joins: inputs in one layout (split with split, else all made whole,
    or rows where one already is; rows in grid's batch-parallel part)."""
    values = list(at.inputs.values())
    joined = _same_or_whole(values) if values else None
    if at.in_prefix and joined is not None:
        joined = "rows"
    return at.all_in(FUNCTION, joined)


def _joined_by_method(at: _Node) -> Step:
    """`x.add(y)`, `x.relu()`: as a join, on whole inputs where none has a layout."""
    joined = "rows" if at.in_prefix else _same_or_whole(list(at.inputs.values()))
    return at.all_in(FUNCTION, joined)


def _reshaped(at: _Node) -> Step:
    return at.all_in(FUNCTION, "rows" if at.in_prefix else _unsplit(at.first))


def _concatenated(at: _Node) -> Step:
    """Along dim 1: whole or rows inputs."""
    values = list(at.inputs.values())
    return at.all_in(FUNCTION, "rows" if at.in_prefix else _unsplit(_same_or_whole(values)))


def _passed(at: _Node) -> Step:
    """`x.size()`, `x.dim()`: not a tensor in a layout."""
    return at.as_they_come(FUNCTION, None)


# -- the rules' tables: the first module rule whose types match applies (a user's registered
# channel-local types included, as they are when the plan is made)

ModuleRule = Callable[[_Node, nn.Module], Step]
NodeRule = Callable[[_Node], Step]

_NODE_RULES: dict[str, NodeRule] = {
    "placeholder": _input, "output": _output, "get_attr": _attribute,
    "call_module": _module, "call_function": _function, "call_method": _method}
_MODULE_RULES: list[tuple[Sequence[type[nn.Module]], ModuleRule]] = [
    (SHARDABLE, _split),
    (BATCH_NORMS, _batch_norm),
    (PER_SAMPLE_NORMS, _per_sample_norm),
    (_channel_local, _channel_local_module)]
_FUNCTION_RULES: dict[Any, NodeRule] = {
    **dict.fromkeys(_ELEMENTWISE_FUNCTIONS, _kept),
    **dict.fromkeys(_JOIN_FUNCTIONS, _joined),
    torch.flatten: _reshaped,
    torch.cat: _concatenated}
_METHOD_RULES: dict[str, NodeRule] = {
    **dict.fromkeys(_PASS_METHODS, _passed),
    **dict.fromkeys(_ELEMENTWISE_METHODS, _joined_by_method),
    **dict.fromkeys(_RESHAPING_METHODS, _reshaped)}


def tree_problems(model: nn.Module, sample_shape: Sequence[int], strategy: str,
                  mode: Mode, pr: int) -> list[str]:
    """Why the strategy cannot split `model` (empty: it can)."""
    try:
        plan = plan_tree(model, sample_shape, mode, pr)
    except TreeRefused as exc:
        alternative = "" if "strategy=data" in str(exc) else " (strategy=data trains it whole)"
        return [f"strategy={strategy} cannot split {exc}{alternative}"]
    if mode == "domain" and pr > 1 and not any(step.out == "slab" for step in plan.steps):
        return [f"strategy=domain splits images in height: {type(model).__name__} must start "
                f"with convolutions or pooling on (channels, height, width) inputs"]
    return []
