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
  by output features/channels (`sharded.py`): input whole, output split, gradients summed over
  the batch group. Under `grid`, nodes before the first Linear run batch-parallel (`rows`),
  their weights whole and summed over every rank.
- BatchNorm: in `split`, its channels' slice with statistics over the batch group; in `rows`,
  whole with statistics over every rank (`strategies.layers.norm`). On whole features it is refused
  (each rank would hold a partial gradient of its weights). LayerNorm, GroupNorm and
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

What moves is predicted from the same plan (`TreePlan.ops`), node by node, so measured bytes
equal predicted bytes by construction of one plan for both.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.halo import HaloPlan
from runner.core.primitives import all_gather, repartition
from runner.cost.collectives import CommOp
from strategies.base import ParallelModel, split_model_exchanges
from strategies.exchange.buckets import predict_gradient_ops
from strategies.layers.norm import (
    BATCH_NORMS,
    DistributedBatchNorm,
    batch_norm_comm_ops,
    batch_norm_problem,
)
from strategies.layers.spatial import (
    ROW_LOCAL,
    WINDOWED,
    SpatialWindowed,
    height_window,
    windowed_problem,
)
from strategies.layers.split import CHANNEL_LOCAL, SHARDABLE, SplitConv2d, SplitLinear
from strategies.probe import logits_of, sample_dtype

Layout = Literal["whole", "split", "rows", "slab"]
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


@dataclass(frozen=True)
class BuildParts:
    """What a rule builds this rank's module with: the grid's groups for it."""

    grid: ProcessGrid
    stats_batch: CountedComm  # the ranks a split BatchNorm takes its statistics over
    stats_world: CountedComm  # the ranks a whole one does
    overlap: bool  # domain's halo exchanges overlap the rows that need none


class Rule:
    """What a node's rule means once the plan has chosen its layouts: this rank's module, the
    whole size of what it splits over the model group (if it splits its parameters), and the
    collectives the module issues itself (halos, batch statistics). A new rule is a subclass;
    its instance is what `Step.rule` holds."""

    name: ClassVar[str]
    splits: ClassVar[bool] = False  # its parameters are split over the model group

    def __repr__(self) -> str:
        return self.name

    def split_size(self, module: nn.Module, plan: TreePlan, step: Step) -> int:
        """The whole size of the dim its parameters are split along (`splits` rules)."""
        raise NotImplementedError

    def build(self, module: nn.Module, step: Step, plan: TreePlan,
              parts: BuildParts) -> nn.Module:
        """This rank's module for the node (the module itself: it runs as it is)."""
        return module

    def module_ops(self, module: nn.Module, step: Step, plan: TreePlan, grid: GridShape,
                   rows: int, itemsize: int, stats_itemsize: int, backward: bool,
                   label: str) -> list[CommOp]:
        """The collectives its module issues in a step (`rows`: the batch group's)."""
        return []


class InputRule(Rule):
    name = "input"


class OutputRule(Rule):
    name = "output"


class FunctionRule(Rule):
    """A function or method, on its inputs in the layouts it needs."""

    name = "function"


class LocalRule(Rule):
    """A module that runs as it is, on whole inputs, rows or split channels."""

    name = "local"


class SplitRule(Rule):
    """A Linear's rows or a Conv2d's filters over the model group."""

    name = "split"
    splits = True

    def split_size(self, module: nn.Module, plan: TreePlan, step: Step) -> int:
        return (module.out_features if isinstance(module, nn.Linear)
                else int(getattr(module, "out_channels", 1)))

    def build(self, module: nn.Module, step: Step, plan: TreePlan,
              parts: BuildParts) -> nn.Module:
        assert isinstance(module, SHARDABLE)
        grid = parts.grid
        part = Partition(self.split_size(module, plan, step), grid.pr)
        return (SplitLinear(module, part, grid.model_index) if isinstance(module, nn.Linear)
                else SplitConv2d(module, part, grid.model_index))


class NormSplitRule(Rule):
    """A BatchNorm on channels split over the model group: its channels' statistics over the
    batch group."""

    name = "norm_split"
    splits = True

    def split_size(self, module: nn.Module, plan: TreePlan, step: Step) -> int:
        return plan.channels[_input_name(step)]

    def build(self, module: nn.Module, step: Step, plan: TreePlan,
              parts: BuildParts) -> nn.Module:
        assert isinstance(module, BATCH_NORMS)
        channels = Partition(self.split_size(module, plan, step), parts.grid.pr)
        return DistributedBatchNorm(module, parts.stats_batch, f"bn:{step.node.target}",
                                    channels.slice(parts.grid.model_index))

    def module_ops(self, module: nn.Module, step: Step, plan: TreePlan, grid: GridShape,
                   rows: int, itemsize: int, stats_itemsize: int, backward: bool,
                   label: str) -> list[CommOp]:
        mine = Partition(self.split_size(module, plan, step), grid.pr).sizes[0]
        return batch_norm_comm_ops("batch", grid.pc, mine, stats_itemsize, f"bn:{label}")


class NormWholeRule(Rule):
    """A BatchNorm on whole channels (on rows, or on height slabs): its statistics over every
    rank."""

    name = "norm_rows"

    def build(self, module: nn.Module, step: Step, plan: TreePlan,
              parts: BuildParts) -> nn.Module:
        assert isinstance(module, BATCH_NORMS)
        return DistributedBatchNorm(module, parts.stats_world, f"bn:{step.node.target}")

    def module_ops(self, module: nn.Module, step: Step, plan: TreePlan, grid: GridShape,
                   rows: int, itemsize: int, stats_itemsize: int, backward: bool,
                   label: str) -> list[CommOp]:
        assert isinstance(module, BATCH_NORMS)
        return batch_norm_comm_ops("world", grid.size, module.num_features, stats_itemsize,
                                   f"bn:{label}")


class NormSlabRule(NormWholeRule):
    name = "norm_slab"


class WindowedRule(Rule):
    """A convolution or pooling on height slabs: the halo rows exchanged around it."""

    name = "windowed"

    def build(self, module: nn.Module, step: Step, plan: TreePlan,
              parts: BuildParts) -> nn.Module:
        if parts.grid.pr == 1:
            return module
        assert isinstance(module, WINDOWED)
        height = plan.shapes[_input_name(step)][1]
        return SpatialWindowed(module, parts.grid.model, height, parts.overlap)

    def module_ops(self, module: nn.Module, step: Step, plan: TreePlan, grid: GridShape,
                   rows: int, itemsize: int, stats_itemsize: int, backward: bool,
                   label: str) -> list[CommOp]:
        if grid.pr == 1:
            return []
        return _halo_ops(module, plan.shapes[_input_name(step)], rows, grid.pr, itemsize,
                         label, backward)


INPUT, OUTPUT, FUNCTION, LOCAL = InputRule(), OutputRule(), FunctionRule(), LocalRule()
SPLIT, NORM_SPLIT, NORM_ROWS, NORM_SLAB = SplitRule(), NormSplitRule(), NormWholeRule(), \
    NormSlabRule()
WINDOWED_RULE = WindowedRule()


@dataclass
class Step:
    """One node of the traced graph, with what its rule decided."""

    node: torch.fx.Node
    rule: Rule
    needs: dict[str, Layout]  # per tensor input node name: the layout it is used in
    out: Layout | None  # None: not a tensor in a layout (a size)


@dataclass
class TreePlan:
    """The rules and layouts of every node, and the conversions between them."""

    graph: torch.fx.GraphModule
    steps: list[Step]
    shapes: dict[str, tuple[int, ...]]  # per node: its output's per-sample shape
    channels: dict[str, int] = field(default_factory=dict)  # per split node: its whole dim 1

    def modules(self) -> dict[str, nn.Module]:
        return dict(self.graph.named_modules())


def trace(model: nn.Module, sample_shape: Sequence[int]) -> tuple[torch.fx.GraphModule,
                                                                  dict[str, tuple[int, ...]]]:
    """The model's graph, and every node's per-sample output shape (one sample pushed through
    in evaluation mode, on the model's device: no memory or compute on the meta device)."""
    try:
        graph = torch.fx.GraphModule(model, _Tracer().trace(model))
    except Exception as exc:  # data-dependent control flow, unsupported Python
        raise TreeRefused(f"torch.fx cannot trace {type(model).__name__}: "
                          f"{type(exc).__name__}: {exc}") from None
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    training = model.training
    model.eval()
    graph.eval()
    try:
        with torch.no_grad():
            ShapeProp(graph).propagate(torch.zeros(1, *sample_shape, device=device,
                                                   dtype=sample_dtype(model)))
    except Exception as exc:  # the traced graph does not run as the model does
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TreeRefused(f"{type(model).__name__}: its traced graph does not run ({first})"
                          ) from None
    finally:
        model.train(training)
        graph.train(training)
    shapes = {}
    for node in graph.graph.nodes:
        meta = node.meta.get("tensor_meta")
        if meta is not None and hasattr(meta, "shape"):
            shapes[node.name] = tuple(meta.shape[1:])
    return graph, shapes


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with a user's registered module types kept whole (a leaf: their rule
    applies to the module, not to what is inside)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, tuple(_channel_local)) or super().is_leaf_module(
            m, module_qualified_name)


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return [n for n in dict.fromkeys(found)]


def _function_name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


def plan_tree(model: nn.Module, sample_shape: Sequence[int], mode: Mode,
              pr: int) -> TreePlan:
    """The rule of every node under `mode`'s rules (see the module docstring); under grid the
    nodes before the first Linear run batch-parallel, under domain the nodes before the first
    one with no rule on height slabs (`_slab_rule`). Raises `TreeRefused`."""
    graph, shapes = trace(model, sample_shape)
    modules = dict(graph.named_modules())
    first_linear = next((i for i, node in enumerate(graph.graph.nodes)
                         if node.op == "call_module"
                         and isinstance(modules[str(node.target)], nn.Linear)), None)
    if first_linear is not None and not any(
            node.op == "call_module" and any(True for _ in modules[str(node.target)].parameters())
            for node in list(graph.graph.nodes)[:first_linear]):
        first_linear = 0  # nothing to train before it: no batch-parallel part (as a Sequential)
    layout: dict[str, Layout | None] = {}
    plan = TreePlan(graph, [], shapes)
    spatial = mode == "domain"
    for index, node in enumerate(graph.graph.nodes):
        in_prefix = (mode == "grid" and pr > 1
                     and (first_linear is None or index < first_linear))
        slab = _slab_rule(node, modules, layout, shapes, pr) if spatial else None
        if slab is None:
            spatial = False
            # past the spatial part a slab is used whole: gathered where it is needed
            seen_whole: dict[str, Layout | None] = {
                name: "whole" if value == "slab" else value for name, value in layout.items()}
            step = _rule(node, modules, seen_whole, in_prefix, pr, model)
        else:
            step = slab
        layout[node.name] = step.out
        if step.out == "split":
            plan.channels[node.name] = shapes[node.name][0]
        if step.rule is NORM_SPLIT:
            source = _tensor_inputs(node)[0].name
            plan.channels.setdefault(source, shapes[source][0])
        for name, needed in step.needs.items():
            if layout[name] == "split" and needed != "split":
                plan.channels.setdefault(name, shapes[name][0])
        plan.steps.append(step)
    return plan


def _slab_rule(node: torch.fx.Node, modules: dict[str, nn.Module],
               layout: dict[str, Layout | None], shapes: dict[str, tuple[int, ...]],
               pr: int) -> Step | None:
    """Under domain: the node's rule on height slabs, or None when it has none (the spatial
    part ends there; a refused layer raises). Convolutions and pooling exchange halos,
    BatchNorm takes every rank's statistics, row-local modules, elementwise functions and
    additions run on the slab as it is. Every slab output needs a row on every rank."""
    if node.op == "placeholder":
        return Step(node, INPUT, {}, "whole")
    inputs = {n.name: layout.get(n.name) for n in _tensor_inputs(node)}
    if any(value not in ("slab", "whole") for value in inputs.values()) or not inputs:
        return None
    needs: dict[str, Layout] = {name: "slab" for name in inputs}
    if node.op == "call_module":
        module = modules[str(node.target)]
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
    shape = shapes.get(node.name, ())
    if len(shape) != 3:
        return None
    if shape[1] < pr:
        raise TreeRefused(f"{node.name}: strategy=domain splits each sample's height over "
                          f"grid.pr={pr} ranks, but it outputs height {shape[1]}: every rank "
                          f"needs a row (use a smaller grid.pr or taller inputs)")
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


def _rule(node: torch.fx.Node, modules: dict[str, nn.Module],
          layout: dict[str, Layout | None], in_prefix: bool, pr: int, model: nn.Module) -> Step:
    inputs = [n for n in _tensor_inputs(node) if layout.get(n.name) is not None]
    current = {n.name: layout[n.name] for n in inputs}
    first: Layout | None = current[inputs[0].name] if inputs else None
    keep = {name: value for name, value in current.items() if value is not None}

    def unsplit(value: Layout | None) -> Layout:
        return "whole" if value in (None, "split") else value

    if node.op == "placeholder":
        return Step(node, INPUT, {}, "whole")
    if node.op == "output":
        return Step(node, OUTPUT, {n: "rows" for n in keep}, None)
    if node.op == "get_attr":
        owner = str(node.target).rpartition(".")[0]
        what = (f"{owner} ({type(model.get_submodule(owner)).__name__})" if owner
                else "the model")
        raise TreeRefused(f"{what} uses its tensor {node.target} directly in forward, which "
                          f"has no rule: strategy=data trains it, or register its type with "
                          f"strategies.layers.tree.register_channel_local if it acts per channel")
    if node.op == "call_module":
        module = modules[str(node.target)]
        name = f"{node.target} ({type(module).__name__})"
        if isinstance(module, SHARDABLE) and not in_prefix:
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                raise TreeRefused(f"{name}: a grouped convolution cannot be split by channel")
            return Step(node, SPLIT, {n: "whole" for n in keep}, "split")
        if isinstance(module, BATCH_NORMS):
            problem = batch_norm_problem(module)
            if problem is not None:
                raise TreeRefused(f"{name}: {problem}")
            if in_prefix or first == "rows":
                return Step(node, NORM_ROWS, {n: "rows" for n in keep}, "rows")
            if first == "split" or pr == 1:  # one rank: its split is everything
                return Step(node, NORM_SPLIT, dict(keep), "split")
            raise TreeRefused(f"{name}: a BatchNorm on features no Linear or Conv2d before it "
                              f"has split (put it right after one)")
        if in_prefix:
            if any(True for _ in module.parameters()) and not isinstance(
                    module, (*SHARDABLE, *_channel_local, *PER_SAMPLE_NORMS)):
                raise TreeRefused(f"{name} has parameters and no rule")
            return Step(node, LOCAL, {n: "rows" for n in keep}, "rows")
        if isinstance(module, PER_SAMPLE_NORMS):
            raise TreeRefused(f"{name}: a per-sample normalization needs every channel of its "
                              f"sample and would leave each rank a partial gradient of its "
                              f"weights; it runs batch-parallel only (strategy=grid before the "
                              f"first Linear, or strategy=data)")
        if isinstance(module, tuple(_channel_local)):
            if any(True for _ in module.parameters()) and first == "split":
                raise TreeRefused(f"{name}: channel-local with parameters on split channels "
                                  f"has no rule")
            return Step(node, LOCAL, dict(keep), first)
        if any(True for _ in module.parameters()):
            raise TreeRefused(f"{name} has parameters and no rule: strategy=data trains it, "
                              f"or register a rule")
        wanted = unsplit(first)  # Flatten, and any parameter-free module without a rule
        return Step(node, LOCAL, {n: wanted for n in keep}, wanted)
    if node.op == "call_function":
        function = node.target
        values = [value for value in keep.values()]
        if function in _ELEMENTWISE_FUNCTIONS:
            return Step(node, FUNCTION, dict(keep), first)
        if function in _JOIN_FUNCTIONS:
            joined = _same_or_whole(values) if values else None
            if in_prefix and joined is not None:
                joined = "rows"
            return Step(node, FUNCTION, {n: joined for n in keep}, joined)  # type: ignore[misc]
        if function is torch.flatten:
            out = "rows" if in_prefix else unsplit(first)
            return Step(node, FUNCTION, {n: out for n in keep}, out)
        if function is torch.cat:
            out = "rows" if in_prefix else unsplit(_same_or_whole(values))
            return Step(node, FUNCTION, {n: out for n in keep}, out)
        raise TreeRefused(f"{node.name}: the function {_function_name(function)} has no rule")
    if node.op == "call_method":
        method = str(node.target)
        if method in _PASS_METHODS:
            return Step(node, FUNCTION, dict(keep), None)
        if method in _ELEMENTWISE_METHODS:
            values = list(keep.values())
            joined = _same_or_whole(values)
            if in_prefix:
                joined = "rows"
            return Step(node, FUNCTION, {n: joined for n in keep}, joined)
        if method in _RESHAPING_METHODS:
            out = "rows" if in_prefix else unsplit(first)
            return Step(node, FUNCTION, {n: out for n in keep}, out)
        raise TreeRefused(f"{node.name}: the method .{method}() has no rule")
    raise TreeRefused(f"{node.name}: {node.op} has no rule")


# -- the parallel model -----------------------------------------------------------------------


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
        rows = Partition(x.shape[0], comm.size)
        values: dict[str, torch.Tensor | Any] = {}
        converted: dict[tuple[str, Layout], torch.Tensor] = {}
        layouts: dict[str, Layout | None] = {}

        def as_layout(node: torch.fx.Node, needed: Layout) -> Any:
            value, have = values[node.name], layouts[node.name]
            if have is None or have == needed or not isinstance(value, torch.Tensor):
                return value
            key = (node.name, needed)
            if key not in converted:
                converted[key] = convert(value, have, needed, comm, rows,
                                         self.plan.channels.get(node.name, 0),
                                         self.plan.shapes.get(node.name, ()), node.name)
            return converted[key]

        result: Any = None
        for step in self.plan.steps:
            node = step.node
            if step.rule is INPUT:
                values[node.name], layouts[node.name] = x, "whole"
                continue

            def argument(n: torch.fx.Node, needs: dict[str, Layout] = step.needs) -> Any:
                return as_layout(n, needs[n.name]) if n.name in needs else values[n.name]

            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), argument)
            if step.rule is OUTPUT:
                result = args[0]
                break
            if node.op == "call_module":
                out = self._module(str(node.target))(*args, **kwargs)
            elif node.op == "call_function":
                out = node.target(*args, **kwargs)  # type: ignore[operator]
            else:
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            values[node.name], layouts[node.name] = out, step.out
        return logits_of(result)


def _slab(height: int, comm: CountedComm) -> tuple[int, int]:
    """This rank's rows of an image `height` rows high: (start, length)."""
    rows = Partition(height, comm.size).slice(comm.rank)
    return rows.start, rows.stop - rows.start


def _key(name: str) -> str:
    return name.replace(".", "__") or "root"


def convert(value: torch.Tensor, have: Layout, needed: Layout, comm: CountedComm,
            rows: Partition, channels: int, shape: tuple[int, ...],
            label: str) -> torch.Tensor:
    """`value` from layout `have` to `needed` (module docstring); `shape`: its per-sample
    shape whole (a slab's whole height)."""
    if have == "whole" and needed == "slab":  # every rank has the image: its rows, no message
        return value.narrow(2, *_slab(value.shape[2], comm))
    if have == "slab":  # the boundary: the slabs all-gathered in height (adjoint: scatter)
        value = all_gather(value, comm, 2, Partition(shape[1], comm.size), label=label)
        have = "whole"
        if needed == "whole":
            return value
    if have == "split" and needed == "whole":
        return all_gather(value, comm, 1, Partition(channels, comm.size), label=label)
    if have == "rows" and needed == "whole":
        return all_gather(value, comm, 0, rows, label=label)
    if have == "whole" and needed == "rows":
        return value[rows.slice(comm.rank)]
    if have == "split" and needed == "rows":
        return repartition(value, comm, 1, Partition(channels, comm.size), 0, rows, label=label)
    raise AssertionError(f"no conversion from {have} to {needed}")


def build_tree_model(model: nn.Module, sample_shape: Sequence[int], grid: ProcessGrid,
                     mode: Mode, sync_replica_gradients: bool,
                     bucket_cap_bytes: int, first_bucket_bytes: int,
                     overlap: bool = True) -> TreeParallelModel:
    """This rank's part of `model` under the plan (see the module docstring); `overlap`:
    domain's halo exchanges overlap the rows that need none."""
    plan = plan_tree(model, sample_shape, mode, grid.pr)
    modules = plan.modules()
    local = CountedComm(None, grid.counter, "self")
    parts = BuildParts(grid, grid.batch if sync_replica_gradients else local,
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
        module = modules[target]
        built[target] = step.rule.build(module, step, plan, parts)
        # its own pieces, or the module's parameters (a halo wrapper holds the very module)
        (split_params if step.rule.splits else whole_params).extend(built[target].parameters())
    pmodel = TreeParallelModel(grid, plan, built)
    pmodel.replicated_in_model_group = whole_params
    pmodel.reducers = split_model_exchanges(grid, split_params, whole_params,
                                            sync_replica_gradients, bucket_cap_bytes,
                                            first_bucket_bytes)
    return pmodel


def _input_name(step: Step) -> str:
    inputs = _tensor_inputs(step.node)
    return inputs[0].name if inputs else ""


# -- predictions ------------------------------------------------------------------------------


def predict_tree_ops(model: nn.Module, sample_shape: Sequence[int], grid: GridShape,
                     global_batch: int, mode: Mode, caps: tuple[int, int],
                     itemsize: int, stats_itemsize: int) -> list[CommOp]:
    """What model-group rank 0 of batch group 0 moves in one training step under the plan."""
    plan = plan_tree(model, sample_shape, mode, grid.pr)
    modules = plan.modules()
    pr, pc = grid.pr, grid.pc
    rows = Partition(global_batch, pc).sizes[0]
    own_rows = Partition(rows, pr).sizes[0]
    ops: list[CommOp] = []
    layouts: dict[str, Layout | None] = {}
    done: set[tuple[str, Layout]] = set()
    split_items: list[tuple[str, list[tuple[int, torch.dtype]]]] = []
    whole_items: list[tuple[str, list[tuple[int, torch.dtype]]]] = []
    seen: set[str] = set()
    needs_grad: dict[str, bool] = {}  # whether a value's gradient is computed (halos go back)
    for step in plan.steps:
        node = step.node
        inputs = _tensor_inputs(node)
        needs_grad[node.name] = any(needs_grad.get(n.name, False) for n in inputs)
        for name, needed in step.needs.items():
            have = layouts.get(name)
            if have is None or have == needed or (name, needed) in done:
                continue
            done.add((name, needed))
            per_sample = math.prod(plan.shapes[name])
            # a gather (of channels, rows or height: a slab made rows is gathered first), and its
            # adjoint
            if pr > 1 and (needed == "whole" or (have == "slab" and needed == "rows")):
                n = rows * per_sample * itemsize
                ops.append(CommOp("allgather", "model", pr, n, name))
                if needs_grad.get(name, False):  # the adjoint runs only for a gradient
                    ops.append(CommOp("reduce_scatter", "model", pr, n, name))
            elif pr > 1 and have == "split" and needed == "rows":
                channels = plan.channels[name]
                shard = per_sample // channels * Partition(channels, pr).sizes[0]
                ops += [CommOp("alltoall", "model", pr, rows * shard * itemsize, name),
                        CommOp("alltoall", "model", pr, own_rows * per_sample * itemsize, name)]
        layouts[node.name] = step.out
        if node.op != "call_module":
            continue
        module = modules[str(node.target)]
        label = str(node.target)
        needs_grad[node.name] |= any(p.requires_grad for p in module.parameters())
        source = inputs[0].name if inputs else ""
        ops += step.rule.module_ops(module, step, plan, grid, rows, itemsize, stats_itemsize,
                                    needs_grad.get(source, False), label)
        if label in seen:
            continue
        seen.add(label)
        items = _param_items(module, step, plan, pr)
        if items:
            (split_items if step.rule.splits else whole_items).append((label, items))
    return (ops + predict_gradient_ops(split_items, "batch", pc, *caps)
            + predict_gradient_ops(whole_items, "world", grid.size, *caps))


def _halo_ops(module: nn.Module, shape: tuple[int, ...], rows: int, pr: int, itemsize: int,
              label: str, backward: bool) -> list[CommOp]:
    """A windowed layer's halo exchanges on height slabs (as `strategies.domain` prices them):
    rank 0's rows the others read, and in the backward (when its input has a gradient) the
    halos' gradients sent back."""
    assert isinstance(module, WINDOWED)
    channels, height, width = shape
    plan = HaloPlan(height, height_window(module), pr, 0)
    row_bytes = rows * channels * width * itemsize
    received = [piece for piece in plan.pieces if piece[0] != 0]
    if not (plan.sends or received):
        return []
    messages = max(len(plan.sends), len(received))
    ops = [CommOp("exchange", "model", pr, plan.send_rows * row_bytes, label, messages)]
    if backward:
        ops.append(CommOp("exchange", "model", pr, plan.recv_rows * row_bytes, label, messages))
    return ops


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
                          global_batch: int, mode: Mode, itemsize: int) -> int:
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
    return total * itemsize
