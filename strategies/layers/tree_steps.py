"""A module tree's plan as steps (`strategies.layers.tree` makes it): each node of the traced
graph with the rule it got, the layout each input is taken in and the layout of its output; and
what a rule means once chosen: this rank's module for the node (`Rule.build`), the collectives
that module issues itself (`Rule.module_ops`: halos, batch statistics), and the whole size of
what it splits over the model group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.fx
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.halo import HaloPlan
from runner.cost.collectives import CommOp
from strategies.layers.norm import BATCH_NORMS, DistributedBatchNorm, batch_norm_comm_ops
from strategies.layers.spatial import WINDOWED, SpatialWindowed, height_window
from strategies.layers.split import SHARDABLE, SplitConv2d, SplitLinear

Layout = Literal["whole", "split", "rows", "slab"]


@dataclass(frozen=True)
class BuildParts:
    """What a rule builds this rank's module with: the plan, and the grid's groups for it."""

    plan: TreePlan
    grid: ProcessGrid
    stats_batch: CountedComm  # the ranks a split BatchNorm takes its statistics over
    stats_world: CountedComm  # the ranks a whole one does
    overlap: bool  # domain's halo exchanges overlap the rows that need none


@dataclass(frozen=True)
class PredictParts:
    """What a rule predicts its module's collectives with: the plan, the grid, the batch
    group's rows, and the bytes of an activation's element and of a batch statistic's."""

    plan: TreePlan
    grid: GridShape
    rows: int
    itemsize: int
    stats_itemsize: int


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

    def build(self, module: nn.Module, step: Step, parts: BuildParts) -> nn.Module:
        """This rank's module for the node (the module itself: it runs as it is)."""
        return module

    def module_ops(self, module: nn.Module, step: Step, parts: PredictParts,
                   backward: bool) -> list[CommOp]:
        """The collectives its module issues in a step (`backward`: its input has a gradient,
        so what goes forward also comes back)."""
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

    def build(self, module: nn.Module, step: Step, parts: BuildParts) -> nn.Module:
        assert isinstance(module, SHARDABLE)
        grid = parts.grid
        part = Partition(self.split_size(module, parts.plan, step), grid.pr)
        return (SplitLinear(module, part, grid.model_index) if isinstance(module, nn.Linear)
                else SplitConv2d(module, part, grid.model_index))


class NormSplitRule(Rule):
    """A BatchNorm on channels split over the model group: its channels' statistics over the
    batch group."""

    name = "norm_split"
    splits = True

    def split_size(self, module: nn.Module, plan: TreePlan, step: Step) -> int:
        return plan.channels[_input_name(step)]

    def build(self, module: nn.Module, step: Step, parts: BuildParts) -> nn.Module:
        assert isinstance(module, BATCH_NORMS)
        channels = Partition(self.split_size(module, parts.plan, step), parts.grid.pr)
        return DistributedBatchNorm(module, parts.stats_batch, f"bn:{step.node.target}",
                                    channels.slice(parts.grid.model_index))

    def module_ops(self, module: nn.Module, step: Step, parts: PredictParts,
                   backward: bool) -> list[CommOp]:
        grid = parts.grid
        mine = Partition(self.split_size(module, parts.plan, step), grid.pr).sizes[0]
        return batch_norm_comm_ops("batch", grid.pc, mine, parts.stats_itemsize,
                                   f"bn:{step.node.target}")


class NormWholeRule(Rule):
    """A BatchNorm on whole channels (on rows, or on height slabs): its statistics over every
    rank."""

    name = "norm_rows"

    def build(self, module: nn.Module, step: Step, parts: BuildParts) -> nn.Module:
        assert isinstance(module, BATCH_NORMS)
        return DistributedBatchNorm(module, parts.stats_world, f"bn:{step.node.target}")

    def module_ops(self, module: nn.Module, step: Step, parts: PredictParts,
                   backward: bool) -> list[CommOp]:
        assert isinstance(module, BATCH_NORMS)
        return batch_norm_comm_ops("world", parts.grid.size, module.num_features,
                                   parts.stats_itemsize, f"bn:{step.node.target}")


class NormSlabRule(NormWholeRule):
    name = "norm_slab"


class WindowedRule(Rule):
    """A convolution or pooling on height slabs: the halo rows exchanged around it."""

    name = "windowed"

    def build(self, module: nn.Module, step: Step, parts: BuildParts) -> nn.Module:
        if parts.grid.pr == 1:
            return module
        assert isinstance(module, WINDOWED)
        height = parts.plan.shapes[_input_name(step)][1]
        return SpatialWindowed(module, parts.grid.model, height, parts.overlap)

    def module_ops(self, module: nn.Module, step: Step, parts: PredictParts,
                   backward: bool) -> list[CommOp]:
        if parts.grid.pr == 1:
            return []
        return _halo_ops(module, parts.plan.shapes[_input_name(step)], parts.rows,
                         parts.grid.pr, parts.itemsize, str(step.node.target), backward)


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


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose values the node reads, each once, in order."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return [n for n in dict.fromkeys(found)]


def _input_name(step: Step) -> str:
    inputs = tensor_inputs(step.node)
    return inputs[0].name if inputs else ""


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
