"""Layers split over the model group (`Pr` ranks), and the plan that places their communication.

A `Linear` keeps only its rows of W (output features) and of the bias; a `Conv2d` only its output
channels. Layers that act on each feature/channel alone (activations, pooling) run on the shard
as it is; a BatchNorm keeps its channels' slice of weight, bias and running statistics and takes
its batch statistics over the batch group (`strategies.layers.norm`: every rank of a model group
holds all of its group's rows). Before any layer that needs every feature (the next Linear or
Conv2d, a Flatten), the shards are all-gathered along dim 1. The last sharded output is not
gathered but repartitioned: features-split becomes rows-split, so each rank of the model group
ends with the logits of its own rows of the batch (and its loss counts each sample once). The
communication itself is in `runner.core.primitives`; these modules only say where it happens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, Partition
from runner.core.placement import place_rows
from runner.core.primitives import all_gather, repartition
from runner.cost.collectives import CommOp
from strategies.layers.norm import (
    BATCH_NORMS,
    DistributedBatchNorm,
    batch_norm_comm_ops,
    batch_norm_problem,
)

# Layers that act on each feature or channel separately: they run on a shard unchanged.
CHANNEL_LOCAL: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity,
    nn.MaxPool2d, nn.AvgPool2d,
)
SHARDABLE = (nn.Linear, nn.Conv2d)  # left to inference: isinstance then narrows to these


# The steps of a sharded stack. `layer` indexes the sequential model; `total` is the whole size of
# the sharded dim 1; `after` is the index of the layer whose output is moved. Each kind has just
# the fields it uses, and `step.kind == ...` tells the type checker which step it has.


@dataclass(frozen=True)
class ShardStep:
    """Layer `layer` split along dim 1 (its outputs) over the group."""

    kind: ClassVar[Literal["shard"]] = "shard"
    layer: int
    total: int


@dataclass(frozen=True)
class LocalStep:
    """Layer `layer` run on the shard (or on whole rows) as it is."""

    kind: ClassVar[Literal["local"]] = "local"
    layer: int


@dataclass(frozen=True)
class GatherStep:
    """Layer `after`'s sharded output all-gathered along dim 1."""

    kind: ClassVar[Literal["gather"]] = "gather"
    total: int
    after: int


@dataclass(frozen=True)
class ToRowsStep:
    """Layer `after`'s sharded output repartitioned to rows: the stack's end."""

    kind: ClassVar[Literal["to_rows"]] = "to_rows"
    total: int
    after: int


PlanStep = ShardStep | LocalStep | GatherStep | ToRowsStep


def unsupported_layers(layers: Sequence[nn.Module]) -> list[str]:
    """Why these layers cannot be split over a model group (empty: they can)."""
    problems: list[str] = []
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Conv2d) and layer.groups != 1:
            problems.append(f"layer {i} ({layer}) is a grouped convolution")
        elif isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
            problems.append(f"layer {i} ({type(layer).__name__}): an embedding table, which "
                            f"strategy=data replicates and exchanges sparsely (strategy.sparse)")
        elif isinstance(layer, BATCH_NORMS):
            problem = batch_norm_problem(layer)
            if problem is not None:
                problems.append(f"layer {i}: {problem}")
        elif not isinstance(layer, SHARDABLE) and any(True for _ in layer.parameters()):
            problems.append(f"layer {i} ({type(layer).__name__}) has parameters and is neither "
                            f"Linear nor Conv2d")
    return problems


def sequential_problems(model: nn.Module, strategy: str) -> list[str]:
    """Why `strategy` (model, grid, domain) cannot split `model` as a sequence of layers
    (empty: it can)."""
    if not isinstance(model, nn.Sequential):
        return [f"strategy={strategy} splits nn.Sequential models of Linear, Conv2d, pooling "
                f"and activation layers, got {type(model).__name__}: strategy=data trains any "
                f"module"]
    return [f"strategy={strategy} cannot split {p}" for p in unsupported_layers(list(model))]


def whole_norm_problems(layers: Sequence[nn.Module], start: int) -> list[str]:
    """BatchNorms of the split part that would normalize whole features (after a gather, or
    before the first split layer): every rank of the model group would hold a partial
    gradient of their weights (its share of the next split layer's input gradient), which no
    exchange here sums. Refused by name rather than trained wrongly."""
    problems = []
    sharded = False
    for step in plan_layers(layers, start, 2):
        if step.kind == "shard":
            sharded = True
        elif step.kind == "gather" or step.kind == "to_rows":
            sharded = False
        elif isinstance(layers[step.layer], BATCH_NORMS) and not sharded:
            problems.append(f"layer {step.layer} ({type(layers[step.layer]).__name__}): a "
                            f"BatchNorm on features no Linear or Conv2d before it has split "
                            f"(put it right after one)")
    return problems


def plan_layers(layers: Sequence[nn.Module], start: int, group_size: int) -> list[PlanStep]:
    """Where shards, gathers and the final repartition go for `layers[start:]`."""
    steps: list[PlanStep] = []
    sharded: int | None = None  # the whole size of dim 1 while it is split
    last = start
    for i in range(start, len(layers)):
        layer = layers[i]
        if isinstance(layer, SHARDABLE):
            if sharded is not None:
                steps.append(GatherStep(total=sharded, after=last))
            sharded = layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels
            steps.append(ShardStep(layer=i, total=sharded))
        elif isinstance(layer, CHANNEL_LOCAL + BATCH_NORMS):
            steps.append(LocalStep(layer=i))
        else:
            if sharded is not None:
                steps.append(GatherStep(total=sharded, after=last))
                sharded = None
            steps.append(LocalStep(layer=i))
        last = i
    if sharded is not None:
        steps.append(ToRowsStep(total=sharded, after=last))
    if group_size == 1:  # nothing to move on a group of one
        steps = [s for s in steps if s.kind in ("shard", "local")]
    return steps


def _place(shard: SplitLinear | SplitConv2d, layer: nn.Linear | nn.Conv2d,
           rows: slice) -> None:
    """Record which rows of the layer's weight and bias the shard holds (for checkpoints)."""
    place_rows(shard.weight, layer.weight, rows)
    # The shard has a bias exactly when the layer has one: it is cut from it.
    if shard.bias is not None and layer.bias is not None:
        place_rows(shard.bias, layer.bias, rows)


class SplitLinear(nn.Module):
    """Rows `part.slice(index)` of a Linear's weight and bias (output features)."""

    def __init__(self, linear: nn.Linear, part: Partition, index: int) -> None:
        super().__init__()
        rows = part.slice(index)
        self.in_features, self.out_features = linear.in_features, part.sizes[index]
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach()[rows].clone()))
        _place(self, linear, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SplitConv2d(nn.Module):
    """Output channels `part.slice(index)` of a Conv2d (every input channel is needed)."""

    def __init__(self, conv: nn.Conv2d, part: Partition, index: int) -> None:
        super().__init__()
        channels = part.slice(index)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        # A padding mode other than zeros pads the input first, as nn.Conv2d does (a channel
        # split leaves every image whole, so any mode is the layer's own).
        self.padding_mode = conv.padding_mode
        self.explicit_padding = conv._reversed_padding_repeated_twice
        self.weight = nn.Parameter(conv.weight.detach()[channels].clone())
        self.bias = (None if conv.bias is None
                     else nn.Parameter(conv.bias.detach()[channels].clone()))
        _place(self, conv, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode != "zeros":
            return F.conv2d(F.pad(x, self.explicit_padding, mode=self.padding_mode), self.weight,
                            self.bias, self.stride, 0, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation)


class GatherSplits(nn.Module):
    """All-gather dim 1 over the model group (adjoint: reduce-scatter)."""

    def __init__(self, comm: CountedComm, total: int) -> None:
        super().__init__()
        self.comm, self.part = comm, Partition(total, comm.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(x, self.comm, 1, self.part, label="activations")


class SplitsToRows(nn.Module):
    """Repartition from dim 1 split (features) to dim 0 split (rows) over the model group."""

    def __init__(self, comm: CountedComm, total: int) -> None:
        super().__init__()
        self.comm, self.part = comm, Partition(total, comm.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = Partition(x.shape[0], self.comm.size)
        return repartition(x, self.comm, 1, self.part, 0, rows, label="output")


def build_split(layers: Sequence[nn.Module], steps: list[PlanStep], comm: CountedComm,
                  index: int, stats_comm: CountedComm | None = None) -> nn.Sequential:
    """The modules of `steps` for model-group rank `index`, weights sliced from `layers`; a
    BatchNorm's statistics over `stats_comm` (the batch group; None: this rank's rows)."""
    modules: list[nn.Module] = []
    sharded: Partition | None = None  # dim 1's split while it is split
    for step in steps:
        if step.kind == "shard":
            layer = layers[step.layer]
            assert isinstance(layer, SHARDABLE), "plan_layers shards only these"
            sharded = part = Partition(step.total, comm.size)
            modules.append(SplitLinear(layer, part, index) if isinstance(layer, nn.Linear)
                           else SplitConv2d(layer, part, index))
        elif step.kind == "local" and isinstance(layers[step.layer], BATCH_NORMS):
            layer = layers[step.layer]
            assert isinstance(layer, BATCH_NORMS)
            modules.append(DistributedBatchNorm(
                layer, stats_comm or CountedComm(None, comm.counter, "self"),
                f"bn:{step.layer}", None if sharded is None else sharded.slice(index)))
        elif step.kind == "local":
            modules.append(layers[step.layer])
        elif step.kind == "gather":
            sharded = None
            modules.append(GatherSplits(comm, step.total))
        else:
            modules.append(SplitsToRows(comm, step.total))
    return nn.Sequential(*modules)


def output_shapes(layers: Sequence[nn.Module],
                  sample_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Per-sample shape of each layer's output, from one sample pushed through on the layers'
    own device (no memory or compute on the meta device, one sample's worth on the CPU)."""
    params = [p for layer in layers for p in layer.parameters()]
    device = params[0].device if params else torch.device("cpu")
    dtype = params[0].dtype if params else torch.float32
    shapes = []
    if layers and isinstance(layers[0], (nn.Embedding, nn.EmbeddingBag)):
        dtype = torch.long  # the samples are token ids
    # In evaluation mode: a BatchNorm then neither needs two samples nor moves its running
    # statistics (nor a Dropout its random state).
    modes = [layer.training for layer in layers]
    with torch.no_grad():
        h = torch.zeros(1, *sample_shape, device=device, dtype=dtype)
        for layer in layers:
            layer.eval()
            h = layer(h)
            shapes.append(tuple(h.shape[1:]))
    for layer, mode in zip(layers, modes, strict=True):
        layer.train(mode)
    return shapes


def feature_sizes(layers: Sequence[nn.Module], sample_shape: Sequence[int]) -> list[int]:
    """Elements per sample of each layer's output."""
    return [math.prod(shape) for shape in output_shapes(layers, sample_shape)]


def activation_itemsize(layers: Sequence[nn.Module],
                        compute_dtype: torch.dtype | None = None) -> int:
    """Bytes per activation element: the autocast type's under mixed precision, else the
    parameters' dtype (float32 unless trainer.dtype says)."""
    if compute_dtype is not None:
        return compute_dtype.itemsize
    param = next((p for layer in layers for p in layer.parameters()), None)
    return 4 if param is None else param.element_size()


# Layers whose output autocast makes the half type, whatever their input's type.
AUTOCAST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def output_itemsizes(layers: Sequence[nn.Module],
                     compute_dtype: torch.dtype | None = None) -> list[int]:
    """Bytes per element of what moves between ranks: index 0 the model's input, index i + 1
    layer i's output. Under mixed precision (`compute_dtype`) floating inputs are stored in the
    half type (`runner.training.precision`), matrix products and convolutions output it, an
    embedding outputs its table's dtype, and every other layer keeps its input's."""
    whole = activation_itemsize(layers)
    if compute_dtype is None:
        return [whole] * (len(layers) + 1)
    half = activation_itemsize(layers, compute_dtype)
    sizes = [half]
    for layer in layers:
        if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
            sizes.append(whole)
        elif isinstance(layer, AUTOCAST_LAYERS):
            sizes.append(half)
        else:
            sizes.append(sizes[-1])
    return sizes


def layer_label(index: int, layer: nn.Module) -> str:
    return f"{index}:{type(layer).__name__}"


def activation_ops(layers: Sequence[nn.Module], steps: list[PlanStep],
                   sample_shape: Sequence[int], rows: int, group_size: int,
                   compute_dtype: torch.dtype | None = None) -> list[CommOp]:
    """What model-group rank 0 moves for a forward+backward of `rows` samples: a gather and its
    adjoint reduce-scatter each move the whole gathered activation; the final repartition moves
    rank 0's feature shard forward and its row shard of the gradient back."""
    if group_size == 1:
        return []
    itemsizes = output_itemsizes(layers, compute_dtype)
    per_sample = feature_sizes(layers, sample_shape)
    ops: list[CommOp] = []
    for step in steps:
        if step.kind == "gather":
            label = layer_label(step.after, layers[step.after])
            n = rows * per_sample[step.after] * itemsizes[step.after + 1]
            ops += [CommOp("allgather", "model", group_size, n, label),
                    CommOp("reduce_scatter", "model", group_size, n, label)]
        elif step.kind == "to_rows":
            label = layer_label(step.after, layers[step.after])
            whole = per_sample[step.after]
            shard = whole // step.total * Partition(step.total, group_size).sizes[0]
            own_rows = Partition(rows, group_size).sizes[0]
            itemsize = itemsizes[step.after + 1]
            ops += [CommOp("alltoall", "model", group_size, rows * shard * itemsize, label),
                    CommOp("alltoall", "model", group_size, own_rows * whole * itemsize, label)]
    return ops


def rank0_param_items(layers: Sequence[nn.Module], steps: list[PlanStep],
                      group_size: int) -> list[tuple[str, list[tuple[int, torch.dtype]]]]:
    """(layer label, [(bytes, dtype)]) of model-group rank 0's shard of each split layer."""
    out = []
    sharded: int | None = None  # dim 1's whole size while it is split
    for step in steps:
        if step.kind == "gather" or step.kind == "to_rows":
            sharded = None
            continue
        if step.kind == "shard":
            sharded = step.total
        layer = layers[step.layer]
        if not any(True for _ in layer.parameters()):
            continue
        total = sharded or 1
        rows = Partition(sharded, group_size).sizes[0] if sharded else 1
        out.append((layer_label(step.layer, layer),
                    [(p.numel() // total * rows * p.element_size(), p.dtype)
                     for p in layer.parameters()]))
    return out


def body_norm_ops(layers: Sequence[nn.Module], steps: list[PlanStep], group_size: int,
                  batch_groups: int, itemsize: int) -> list[CommOp]:
    """What the split part's BatchNorms move per step over the batch group of `batch_groups`
    ranks, C rank 0's channels (`strategies.layers.norm.batch_norm_comm_ops`)."""
    if batch_groups == 1:
        return []
    ops: list[CommOp] = []
    sharded: int | None = None
    for step in steps:
        if step.kind == "gather" or step.kind == "to_rows":
            sharded = None
        elif step.kind == "shard":
            sharded = step.total
        elif isinstance(layers[step.layer], BATCH_NORMS):
            layer = layers[step.layer]
            assert isinstance(layer, BATCH_NORMS)
            channels = (Partition(sharded, group_size).sizes[0] if sharded
                        else layer.num_features)
            ops += batch_norm_comm_ops("batch", batch_groups, channels, itemsize,
                                       f"bn:{step.layer}")
    return ops


def whole_param_items(layers: Sequence[nn.Module],
                      start: int = 0) -> list[tuple[str, list[tuple[int, torch.dtype]]]]:
    """(layer label, [(bytes, dtype)]) of layers held whole (replicated)."""
    return [(layer_label(start + i, layer), [(p.numel() * p.element_size(), p.dtype)
                                             for p in layer.parameters() if p.requires_grad])
            for i, layer in enumerate(layers) if any(True for _ in layer.parameters())]


def split_param_bytes(layers: Sequence[nn.Module], start: int, group_size: int) -> int:
    """Rank 0's parameter bytes: layers before `start` whole, the rest split over the group."""
    steps = plan_layers(layers, start, group_size)
    items = whole_param_items(layers[:start]) + rank0_param_items(layers, steps, group_size)
    return sum(nbytes for _, params in items for nbytes, _ in params)


def body_activation_elements(layers: Sequence[nn.Module], steps: list[PlanStep],
                             sample_shape: Sequence[int], rows: int, group_size: int) -> int:
    """Elements of the layer outputs model-group rank 0 keeps for backward in the split part:
    shards of `rows` rows while dim 1 is split, whole rows after a gather, its own rows after
    the final repartition."""
    per_sample = feature_sizes(layers, sample_shape)
    total, fraction = 0, 1.0
    for step in steps:
        if step.kind == "shard":
            fraction = Partition(step.total, group_size).sizes[0] / step.total
            total += round(rows * per_sample[step.layer] * fraction)
        elif step.kind == "local":
            total += round(rows * per_sample[step.layer] * fraction)
        elif step.kind == "gather":
            fraction = 1.0
            total += rows * per_sample[step.after]
        else:  # to_rows
            total += Partition(rows, group_size).sizes[0] * per_sample[step.after]
    return total
