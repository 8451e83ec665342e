"""The styles of a parallel plan by module name (`strategies.plans.module_plan`): one class per
style, holding what follows from it for one module of the user's model.

    colwise    output features split over the model group (a Linear's rows, a Conv1D's
               columns: the transformers library's Conv1D keeps its weight as (in, out)); the
               output stays split along its last dim, and is gathered where it is the model's
               output
    rowwise    input features split, the partial outputs summed over the model group
               (`all_sum_reduce`, adjoint: itself), the bias added once after the sum
    colwise_gather_output
               colwise, its output gathered whole right after it (`all_gather`, adjoint:
               reduce-scatter): what follows runs whole on every rank of the group (Phi-3's
               fused q/k/v and gate/up projections, OLMo-2's attention)
    rowwise_split_input
               rowwise fed its whole input: it takes its own input features first (no
               communication: its input's gradient is a partial sum, zero outside them)
    fused_qkv  a fused q/k/v projection: each of its 3 chunks split as `colwise`, so each rank
               holds its heads of q, of k and of v
    vocab      an Embedding's rows (the vocabulary) split: a masked lookup, then the sum over
               the group (`vocab_embedding_sum`); or the model's output projection's rows (its
               vocabulary or classes), its logits left split and scored split
               (`strategies.layers.vocab_head`)
    sequence   a module acting token by token (a norm, dropout with p=0) run on this rank's
               piece of the sequence inside the blocks of the plan, whose colwise projections
               then gather their input along the sequence and rowwise ones reduce-scatter their
               partial sums along it (Megatron-LM's sequence parallelism:
               `strategies.plans.sequence_parallel`); its weights whole, their gradients
               summed over every rank
    replicate  left whole: its gradient summed over every rank, as a batch-parallel layer's

Under gridrun's convention (`runner.core.primitives`) a replicated tensor's gradient on each
rank is partial, the true one the sum over the group: a colwise projection fed a replicated
input needs no communication, its input's gradient being such a partial sum.

A style says whether it fits a module and divides over `pr` ranks (`problems`), rank 0's
parameters and whether each is split (`local_params`: the predicted bytes and gradient
groups), the collectives its forward and backward issue (`ops`), and this rank's module
(`build`). A new style is a new subclass, registered in `STYLES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, Partition
from runner.core.placement import place_block, place_rows
from runner.core.primitives import all_gather, all_sum_reduce
from runner.cost.collectives import CommOp
from strategies.layers.vocab_head import split_loss_ops
from strategies.layers.vocab_ops import vocab_embedding_sum


class SequenceScatter(Protocol):
    """What a rowwise projection in a sequence region scatters its sums with
    (`strategies.plans.sequence_parallel.SequenceShards`)."""

    def reduce_scatter(self, x: torch.Tensor, label: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class Projection:
    """A Linear or the transformers library's Conv1D, seen the same way."""

    in_features: int
    out_features: int
    transposed: bool  # Conv1D: the weight is (in, out)

    @staticmethod
    def of(module: nn.Module) -> Projection | None:
        if isinstance(module, nn.Linear):
            return Projection(module.in_features, module.out_features, False)
        weight = getattr(module, "weight", None)
        # by name and shape: the transformers library is optional
        if (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor)
                and weight.dim() == 2):
            return Projection(weight.shape[0], weight.shape[1], True)
        return None


def weight_of(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def bias_of(module: nn.Module) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            transposed: bool) -> torch.Tensor:
    """x times a weight held as a Linear's (out, in) or a Conv1D's (in, out)."""
    return F.linear(x, weight.t() if transposed else weight, bias)


def _output_columns(weight: torch.Tensor, features: slice, transposed: bool
                    ) -> nn.Parameter:
    """Output `features` of a projection's weight, placed in the global tensor."""
    if transposed:
        shard = nn.Parameter(weight.detach()[:, features].clone())
        place_block(shard, weight, slice(None), features)
    else:
        shard = nn.Parameter(weight.detach()[features].clone())
        place_rows(shard, weight, features)
    return shard


def _rows(tensor: torch.Tensor, rows: slice) -> nn.Parameter:
    shard = nn.Parameter(tensor.detach()[rows].clone())
    place_rows(shard, tensor, rows)
    return shard


# -- the modules the styles build --------------------------------------------------------------


class ColwiseProjection(nn.Module):
    """Output features `chunks` (one range each) of a Linear or Conv1D; with `gather`, its
    output's features are gathered over the group (adjoint: reduce-scatter) into the whole."""

    def __init__(self, layer: nn.Module, chunks: list[slice], transposed: bool,
                 gather: CountedComm | None, label: str) -> None:
        super().__init__()
        self.transposed, self.gather, self.label = transposed, gather, label
        self.weights = nn.ParameterList(
            [_output_columns(weight_of(layer), c, transposed) for c in chunks])
        bias = bias_of(layer)
        self.biases = (nn.ParameterList([_rows(bias, c) for c in chunks])
                       if bias is not None else None)
        out_features = sum(c.stop - c.start for c in chunks)
        self.out_part = (Partition(out_features * gather.size, gather.size)
                         if gather is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (self.weights[0] if len(self.weights) == 1
                  else torch.cat(list(self.weights), dim=1 if self.transposed else 0))
        bias = None
        if self.biases is not None:
            bias = self.biases[0] if len(self.biases) == 1 else torch.cat(list(self.biases))
        y = project(x, weight, bias, self.transposed)
        if self.gather is None or self.gather.size == 1:
            return y
        assert self.out_part is not None
        return all_gather(y, self.gather, y.dim() - 1, self.out_part,
                          label=self.label + " out")


class RowwiseProjection(nn.Module):
    """Input features `cols` of a Linear or Conv1D: a partial output, summed over the group,
    then the layer's own (whole) bias. In a sequence region (`sequence` set) the sum is
    scattered along the sequence: each rank keeps its piece of the positions."""

    def __init__(self, layer: nn.Module, cols: slice, transposed: bool, comm: CountedComm,
                 label: str, split_input: bool = False) -> None:
        super().__init__()
        self.transposed, self.comm, self.label = transposed, comm, label
        # fed the whole input (rowwise_split_input): its own features taken first
        self.input_features = cols if split_input else None
        weight = weight_of(layer)
        self.weight: nn.Parameter
        if transposed:
            self.weight = _rows(weight, cols)
        else:
            self.weight = nn.Parameter(weight.detach()[:, cols].clone())
            place_block(self.weight, weight, slice(None), cols)
        self.bias: nn.Parameter | None
        bias = bias_of(layer)
        assert bias is None or isinstance(bias, nn.Parameter)
        self.register_parameter("bias", bias)  # the very parameter, placement and all
        self.sequence: SequenceScatter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_features is not None:
            x = x[..., self.input_features]
        partial = project(x, self.weight, None, self.transposed)
        y = (all_sum_reduce(partial, self.comm, self.label) if self.sequence is None
             else self.sequence.reduce_scatter(partial, self.label))
        return y if self.bias is None else y + self.bias


def scaled_table(module: nn.Module) -> torch.Tensor | None:
    """The scale of the transformers library's scaled token tables (Gemma's, BART's: an
    nn.Embedding whose forward is the lookup times `embed_scale`), None for any other module."""
    if not (isinstance(module, nn.Embedding)
            and type(module).__name__.endswith("ScaledWordEmbedding")):
        return None
    scale: object = getattr(module, "embed_scale", None)
    if not isinstance(scale, torch.Tensor | float):
        return None
    return torch.as_tensor(scale, device=module.weight.device)


class VocabEmbedding(nn.Module):
    """Rows `rows` of an Embedding's table; the sum over the group completes every lookup
    (times a scaled table's scale). The padding row, where this rank holds it, gets no
    gradient (as the whole table's)."""

    def __init__(self, table: nn.Embedding, rows: slice, comm: CountedComm,
                 label: str) -> None:
        super().__init__()
        self.weight = _rows(table.weight, rows)
        self.start, self.comm, self.label = rows.start, comm, label
        padding = table.padding_idx
        self.padding_idx = (padding - rows.start
                            if padding is not None and rows.start <= padding < rows.stop
                            else None)
        self.embed_scale: torch.Tensor | None
        self.register_buffer("embed_scale", scaled_table(table), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        looked_up = vocab_embedding_sum(ids, self.weight, self.start, self.comm, self.label,
                                        padding_idx=self.padding_idx)
        if self.embed_scale is None:
            return looked_up
        return looked_up * self.embed_scale.to(looked_up.dtype)


# -- the styles ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalParam:
    """One of rank 0's parameters of a styled module, in registration order."""

    elements: int
    dtype: torch.dtype
    split: bool  # held in part (gradient over the batch group) or whole (over the world)
    trainable: bool


class PlanStyle:
    """How a plan lays out one module: its checks, its parameters, its communication and this
    rank's module."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # whether its output's last dim stays split over the model group
    splits_output: ClassVar[bool] = False
    # whether its module takes and gives whole features, however it splits its work (what a
    # forward run on one rank's shapes sees of it is the module itself)
    whole_features: ClassVar[bool] = False

    def __repr__(self) -> str:
        return self.name

    def fits(self, module: nn.Module) -> str | None:
        """Why the style cannot take `module`'s type (None: it can)."""
        return None

    def problems(self, path: str, module: nn.Module, pr: int) -> list[str]:
        """Why `module` (at `path`) cannot take this style over `pr` ranks."""
        why = self.fits(module)
        return [f"{path} ({type(module).__name__}): {why}"] if why else []

    def local_params(self, module: nn.Module, pr: int) -> list[LocalParam]:
        """Rank 0's parameters of `module` under this style, in the built module's order."""
        return [LocalParam(p.numel(), p.dtype, False, p.requires_grad)
                for p in module.parameters()]

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        """The collectives of one forward and backward of `module` whose whole output has
        `out_elements` elements of `itemsize` bytes (`gather`: it is the model's output)."""
        return []

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        """This rank's module (rank `index` of the model group `comm`) and its split
        parameters (the others are replicated)."""
        return module, []

    def stand_in(self, module: nn.Module, pr: int, device: torch.device | str = "meta",
                 dtype: torch.dtype | None = None) -> nn.Module:
        """A module of the shapes rank 0 computes with (for pricing, and for running the
        model's forward on one rank's shapes; `dtype` None: torch's default); the module
        itself where the style keeps them."""
        return module


def _linear_like(module: nn.Module, in_features: int, out_features: int,
                 device: torch.device | str, dtype: torch.dtype | None) -> nn.Linear:
    """A Linear of the given features with `module`'s bias, on `device`."""
    return nn.Linear(in_features, out_features, bias=bias_of(module) is not None,
                     device=device, dtype=dtype)


def _divides(path: str, module: nn.Module, features: int, what: str, pr: int) -> list[str]:
    if features % pr:
        return [f"{path} ({type(module).__name__}): its {features} {what} do not divide over "
                f"grid.pr={pr} ranks"]
    return []


class ProjectionStyle(PlanStyle):
    """A style of a Linear or the transformers library's Conv1D."""

    def fits(self, module: nn.Module) -> str | None:
        if Projection.of(module) is None:
            return f"{self.name} splits a Linear or a Conv1D"
        return None


class Colwise(ProjectionStyle):
    """Output features over the model group."""

    name = "colwise"
    summary = "output features over Pr"
    splits_output = True
    chunks: ClassVar[int] = 1  # the fused projection's pieces, each split

    def problems(self, path: str, module: nn.Module, pr: int) -> list[str]:
        found = super().problems(path, module, pr)
        if found:
            return found
        projection = Projection.of(module)
        assert projection is not None
        if projection.out_features % self.chunks:
            return [f"{path} ({type(module).__name__}): its {projection.out_features} output "
                    f"features are not {self.chunks} equal chunks"]
        return _divides(path, module, projection.out_features // self.chunks,
                        "output features" + (" per chunk" if self.chunks > 1 else ""), pr)

    def chunk_slices(self, out_features: int, pr: int, index: int) -> list[slice]:
        size = out_features // self.chunks
        piece = Partition(size, pr).slice(index)
        return [slice(k * size + piece.start, k * size + piece.stop)
                for k in range(self.chunks)]

    def local_params(self, module: nn.Module, pr: int) -> list[LocalParam]:
        projection = Projection.of(module)
        assert projection is not None
        weight, bias = weight_of(module), bias_of(module)
        size = projection.out_features // self.chunks
        rows = Partition(size, pr).sizes[0]
        params = [LocalParam(rows * projection.in_features, weight.dtype, True,
                             weight.requires_grad)] * self.chunks
        if bias is not None:
            params += [LocalParam(rows, bias.dtype, True, bias.requires_grad)] * self.chunks
        return params

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        if not gather or pr == 1:
            return []
        n = out_elements * itemsize
        return [CommOp("allgather", "model", pr, n, path + " out"),
                CommOp("reduce_scatter", "model", pr, n, path + " out")]

    def stand_in(self, module: nn.Module, pr: int, device: torch.device | str = "meta",
                 dtype: torch.dtype | None = None) -> nn.Module:
        projection = Projection.of(module)
        assert projection is not None
        local = Partition(projection.out_features // self.chunks, pr).sizes[0] * self.chunks
        return _linear_like(module, projection.in_features, local, device, dtype)

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        projection = Projection.of(module)
        assert projection is not None
        chunks = self.chunk_slices(projection.out_features, comm.size, index)
        built = ColwiseProjection(module, chunks, projection.transposed,
                                  comm if gather else None, path)
        return built, list(built.parameters())


class FusedQKV(Colwise):
    """A fused q/k/v projection: each of its three chunks over the model group."""

    name = "fused_qkv"
    summary = "q, k and v chunks each over Pr"
    chunks = 3

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        return []  # q, k and v feed the attention: never the model's output

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        return super().build(module, path, comm, index, False)


class Rowwise(ProjectionStyle):
    """Input features over the model group, the partial outputs summed."""

    name = "rowwise"
    summary = "input features over Pr, partial sums all-reduced"

    def problems(self, path: str, module: nn.Module, pr: int) -> list[str]:
        found = super().problems(path, module, pr)
        if found:
            return found
        projection = Projection.of(module)
        assert projection is not None
        return _divides(path, module, projection.in_features, "input features", pr)

    def local_params(self, module: nn.Module, pr: int) -> list[LocalParam]:
        projection = Projection.of(module)
        assert projection is not None
        weight, bias = weight_of(module), bias_of(module)
        cols = Partition(projection.in_features, pr).sizes[0]
        params = [LocalParam(cols * projection.out_features, weight.dtype, True,
                             weight.requires_grad)]
        if bias is not None:
            params.append(LocalParam(bias.numel(), bias.dtype, False, bias.requires_grad))
        return params

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        if pr == 1:
            return []
        return [CommOp("allreduce", "model", pr, out_elements * itemsize, path)] * 2

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        projection = Projection.of(module)
        assert projection is not None
        cols = Partition(projection.in_features, comm.size).slice(index)
        built = RowwiseProjection(module, cols, projection.transposed, comm, path)
        return built, [built.weight]

    def stand_in(self, module: nn.Module, pr: int, device: torch.device | str = "meta",
                 dtype: torch.dtype | None = None) -> nn.Module:
        projection = Projection.of(module)
        assert projection is not None
        return _linear_like(module, Partition(projection.in_features, pr).sizes[0],
                            projection.out_features, device, dtype)


class ColwiseGatherOutput(Colwise):
    """Output features over the model group, the output gathered whole right after: what
    reads it runs whole on every rank of the group."""

    name = "colwise_gather_output"
    summary = "output features over Pr, gathered whole after it"
    splits_output = False
    whole_features = True

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        return super().ops(module, path, out_elements, pr, itemsize, True)

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        return super().build(module, path, comm, index, True)


class RowwiseSplitInput(Rowwise):
    """Input features over the model group, taken from the whole input it is fed; the partial
    outputs summed."""

    name = "rowwise_split_input"
    summary = "input features over Pr, taken from its whole input; partial sums all-reduced"
    whole_features = True

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        projection = Projection.of(module)
        assert projection is not None
        cols = Partition(projection.in_features, comm.size).slice(index)
        built = RowwiseProjection(module, cols, projection.transposed, comm, path,
                                  split_input=True)
        return built, [built.weight]


class VocabHead(Colwise):
    """The model's output projection by its rows (vocabulary or classes) over the model
    group: its output features as `colwise`, its logits never gathered but scored split."""

    name = "vocab"
    summary = "the output's vocabulary (classes) over Pr, logits scored split"

    def problems(self, path: str, module: nn.Module, pr: int) -> list[str]:
        projection = Projection.of(module)
        assert projection is not None
        return _divides(path, module, projection.out_features,
                        "vocabulary rows (output features)", pr)

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        projection = Projection.of(module)
        assert projection is not None
        return split_loss_ops(out_elements // projection.out_features, pr, itemsize,
                              path + " loss")

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        return super().build(module, path, comm, index, False)


VOCAB_HEAD = VocabHead()


class Vocab(PlanStyle):
    """An Embedding's vocabulary rows over the model group; a Linear or Conv1D (the model's
    output projection) as `VocabHead`."""

    name = "vocab"
    summary = "vocabulary rows over Pr, lookups summed (a head: logits scored split)"

    def fits(self, module: nn.Module) -> str | None:
        if Projection.of(module) is not None:
            return None
        if not isinstance(module, nn.Embedding) or (type(module) is not nn.Embedding
                                                    and scaled_table(module) is None):
            return f"{self.name} splits an nn.Embedding, or the model's output Linear or Conv1D"
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return (f"{self.name} splits a plain table (no max_norm, scale_grad_by_freq or "
                    f"sparse gradients)")
        return None

    def problems(self, path: str, module: nn.Module, pr: int) -> list[str]:
        if Projection.of(module) is not None:
            return VOCAB_HEAD.problems(path, module, pr)
        found = super().problems(path, module, pr)
        if found:
            return found
        assert isinstance(module, nn.Embedding)
        return _divides(path, module, module.num_embeddings, "vocabulary rows", pr)

    def local_params(self, module: nn.Module, pr: int) -> list[LocalParam]:
        if Projection.of(module) is not None:
            return VOCAB_HEAD.local_params(module, pr)
        assert isinstance(module, nn.Embedding)
        weight = module.weight
        rows = Partition(module.num_embeddings, pr).sizes[0]
        return [LocalParam(rows * module.embedding_dim, weight.dtype, True,
                           weight.requires_grad)]

    def ops(self, module: nn.Module, path: str, out_elements: int, pr: int, itemsize: int,
            gather: bool) -> list[CommOp]:
        if Projection.of(module) is not None:
            return VOCAB_HEAD.ops(module, path, out_elements, pr, itemsize, gather)
        if pr == 1:
            return []
        return [CommOp("allreduce", "model", pr, out_elements * itemsize, path)] * 2

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        if Projection.of(module) is not None:
            return VOCAB_HEAD.build(module, path, comm, index, gather)
        assert isinstance(module, nn.Embedding)
        rows = Partition(module.num_embeddings, comm.size).slice(index)
        built = VocabEmbedding(module, rows, comm, path)
        return built, [built.weight]

    def stand_in(self, module: nn.Module, pr: int, device: torch.device | str = "meta",
                 dtype: torch.dtype | None = None) -> nn.Module:
        if Projection.of(module) is not None:
            return VOCAB_HEAD.stand_in(module, pr, device, dtype)
        assert isinstance(module, nn.Embedding)
        return nn.Embedding(Partition(module.num_embeddings, pr).sizes[0], module.embedding_dim,
                            device=device, dtype=dtype)


class HeadRowsProjection(nn.Module):
    """A Linear or Conv1D held whole (its very parameters), computing only the output features
    `rows`: the key/value heads this rank's query heads read."""

    def __init__(self, layer: nn.Module, rows: slice, transposed: bool) -> None:
        super().__init__()
        self.rows, self.transposed = rows, transposed
        weight, bias = weight_of(layer), bias_of(layer)
        assert isinstance(weight, nn.Parameter) and (bias is None
                                                     or isinstance(bias, nn.Parameter))
        self.weight: nn.Parameter = weight  # the very parameters, placements and all
        self.bias: nn.Parameter | None
        self.register_parameter("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight[:, self.rows] if self.transposed else self.weight[self.rows]
        bias = None if self.bias is None else self.bias[self.rows]
        return project(x, weight, bias, self.transposed)


@dataclass(frozen=True)
class ReplicatedKeyValue(PlanStyle):
    """A key or value projection of grouped-query attention whose `heads` do not divide over
    the model group (more ranks than heads), as Megatron does: held whole on every rank, each
    computing the one head its rank's query heads read (rank r: head r // (Pr / heads)); the
    weights' gradients, partial on each rank, are summed over every rank like a replicated
    layer's. Chosen by the plan for a `colwise` key/value projection (never given by name)."""

    heads: int
    head_width: int
    name: ClassVar[str] = "kv_replicated"
    summary: ClassVar[str] = "whole, each rank its query heads' key/value head"

    def head_rows(self, pr: int, index: int) -> slice:
        head = index // (pr // self.heads)
        return slice(head * self.head_width, (head + 1) * self.head_width)

    def build(self, module: nn.Module, path: str, comm: CountedComm, index: int,
              gather: bool) -> tuple[nn.Module, list[nn.Parameter]]:
        projection = Projection.of(module)
        assert projection is not None
        return (HeadRowsProjection(module, self.head_rows(comm.size, index),
                                   projection.transposed), [])

    def stand_in(self, module: nn.Module, pr: int, device: torch.device | str = "meta",
                 dtype: torch.dtype | None = None) -> nn.Module:
        projection = Projection.of(module)
        assert projection is not None
        return _linear_like(module, projection.in_features, self.head_width, device, dtype)


MIXING = (nn.MultiheadAttention, nn.modules.conv._ConvNd, nn.RNNBase,
          nn.modules.batchnorm._BatchNorm, nn.modules.pooling._AvgPoolNd,
          nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
          nn.modules.pooling._AdaptiveMaxPoolNd, nn.TransformerEncoderLayer,
          nn.TransformerDecoderLayer)


def mixing_problem(module: nn.Module) -> str | None:
    """Why `module` cannot run on a rank's piece of the sequence (None: nothing gridrun
    knows of): it, or a module inside it, mixes positions or draws random masks."""
    for inner in module.modules():
        name = type(inner).__name__
        if isinstance(inner, MIXING) or "attention" in name.lower() or "attn" in name.lower():
            return (f"{name} mixes positions (attention, a convolution or pooling over the "
                    f"sequence, a recurrence, batch statistics): it cannot run on a rank's "
                    f"piece of the sequence")
        if isinstance(inner, nn.modules.dropout._DropoutNd) and inner.p > 0:
            return (f"{name} with p={inner.p} on a piece of the sequence: each rank would draw "
                    f"its own masks, and gridrun runs one process's draws; use p=0")
    return None


class Sequence(PlanStyle):
    """A module acting token by token, run on this rank's piece of the sequence in the blocks
    of the plan (`strategies.plans.sequence_parallel` places the region's exchanges); left
    whole, its gradient summed over every rank."""

    name = "sequence"
    summary = "token by token on this rank's positions, in the blocks (Megatron-LM's)"

    def fits(self, module: nn.Module) -> str | None:
        return mixing_problem(module)


class Replicate(PlanStyle):
    """Left whole on every rank."""

    name = "replicate"
    summary = "whole, gradient summed over all P"


STYLES: dict[str, PlanStyle] = {style.name: style for style in (
    Colwise(), Rowwise(), FusedQKV(), ColwiseGatherOutput(), RowwiseSplitInput(), Vocab(),
    Sequence(), Replicate())}
