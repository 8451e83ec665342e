"""Tensor parallelism of a GPT (`strategies.transformer.gpt.GPT`) over the model group, under
`strategy=model` and `strategy=grid`.

The model group (`Pr` ranks) shares its batch group's rows (b_g, T); the batch groups (`Pc`) are
replicas. On every rank of a model group:

- the token table is split by vocabulary rows: a rank looks up the ids it holds, an all-sum over
  the group gives every row (`vocab_ops.vocab_embedding_sum`); the position table and
  the LayerNorms are replicated;
- attention: the heads are split (`Partition(heads, Pr)`; qkv's rows are head-major, so a rank's
  heads are a contiguous range of rows), the plain `CausalSelfAttention.forward` runs on them;
- layout `pairing` (Megatron-LM): qkv and fc keep their rows (column-parallel), attn.proj and
  mlp.proj keep the matching columns (row-parallel): each outputs a partial sum, summed over the
  group (`all_sum_reduce`; its adjoint, in backward, is itself), the bias added once after the
  sum. One all-reduce per attention and per MLP forward, one each backward. The entry of a
  column-parallel region needs nothing: a replicated tensor's gradient is partial on each rank
  (each rank's loss covers other targets, the total is their sum), and partial gradients is what
  its local backward gives;
- layout `gather` (gridrun's older one): every Linear of a block split by output rows; a proj
  gathers its input's features first and its output after (adjoint: reduce-scatter);
- the head is split by vocabulary rows (tied: the embedding's very shard) and its logits
  (b_g, T, V/Pr) are never gathered: the cross-entropy is computed from the shards
  (`vocab_ops.vocab_cross_entropy`), and each rank scores its own sub-shard of the
  group's rows (`Partition(b_g, Pr)`), so every target is scored on exactly one rank.

Split parameters record their rows (`place_rows`) or block (`place_block`: a row-parallel
weight's columns) of the global parameter, so checkpoints load on any grid.
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.placement import place_block, place_rows
from runner.core.primitives import all_gather, all_sum_reduce
from runner.cost.collectives import CommOp
from runner.cost.compute import ComputeRates
from runner.cost.layers import layer_seconds
from strategies.base import (
    Strategy,
    predict_step,
    split_model_exchanges,
)
from strategies.exchange.buckets import predict_gradient_ops
from strategies.layers.split import activation_itemsize
from strategies.layers.vocab_head import SplitLogitsScoring, split_loss_ops
from strategies.layers.vocab_ops import vocab_embedding_sum
from strategies.transformer.gpt import (
    GPT,
    MLP,
    CausalSelfAttention,
    GPTShapes,
    TransformerBlock,
    activation_elements,
)

Layout = Literal["pairing", "gather"]
LAYOUTS: tuple[Layout, ...] = ("pairing", "gather")
TP_LAYOUTS = ("auto", *LAYOUTS)  # strategy.tp_layout

# -- the modules ---------------------------------------------------------------------------------


class RowsLinear(nn.Module):
    """Rows `rows` of a Linear's weight and bias (output features): a column-parallel Linear."""

    def __init__(self, linear: nn.Linear, rows: slice) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        place_rows(self.weight, linear.weight, rows)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
            place_rows(self.bias, linear.bias, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Columns `cols` of a Linear's weight: a partial output, summed over the group, then the
    (replicated: the layer's own) bias."""

    def __init__(self, linear: nn.Linear, cols: slice, comm: CountedComm, label: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        place_block(self.weight, linear.weight, slice(None), cols)
        self.bias = linear.bias  # the very parameter, placement and all
        self.comm, self.label = comm, label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_sum_reduce(F.linear(x, self.weight), self.comm, self.label)
        return y if self.bias is None else y + self.bias


class GatheredLinear(RowsLinear):
    """The gather layout's projection: the input's features (pieces of `in_part` units of
    `unit` features each) gathered, rows `out_part.slice(index)` of the Linear applied, its
    output's features gathered."""

    def __init__(self, linear: nn.Linear, in_part: Partition, unit: int, out_part: Partition,
                 index: int, comm: CountedComm, label: str) -> None:
        super().__init__(linear, out_part.slice(index))
        self.in_part, self.unit, self.out_part = in_part, unit, out_part
        self.comm, self.label = comm, label

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        pieces = x.reshape(*lead, -1, self.unit)
        whole = all_gather(pieces, self.comm, pieces.dim() - 2, self.in_part,
                           label=self.label + " in")
        y = F.linear(whole.reshape(*lead, -1), self.weight, self.bias)
        return all_gather(y, self.comm, y.dim() - 1, self.out_part, label=self.label + " out")


class VocabParallelEmbedding(nn.Module):
    """Rows `rows` of the token table; the sum over the group completes every lookup."""

    def __init__(self, table: nn.Embedding, rows: slice, comm: CountedComm) -> None:
        super().__init__()
        self.weight = nn.Parameter(table.weight.detach()[rows].clone())
        place_rows(self.weight, table.weight, rows)
        self.start, self.comm = rows.start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_embedding_sum(ids, self.weight, self.start, self.comm)


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows (`weight`: the embedding's shard when tied)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TensorParallelGPT(SplitLogitsScoring):
    """The GPT with its layers swapped for their split forms (its own forward runs them);
    every rank outputs its vocabulary piece of its whole batch group's logits and scores its
    sub-shard of the group's rows."""

    def __init__(self, grid: ProcessGrid, gpt: GPT, layout: Layout, vocab_start: int) -> None:
        super().__init__(grid)
        self.gpt, self.layout, self.vocab_start = gpt, layout, vocab_start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.gpt(x)
        return y



# -- the plan: what each parameter becomes ------------------------------------------------------


def _kind(name: str, layout: Layout) -> str:
    """What the parameter `name` (of a GPT's named_parameters) becomes: `vocab` rows,
    `heads` rows (qkv), `hidden` rows (fc), `width` rows (a proj under gather), `head_cols`
    or `hidden_cols` columns (a proj's weight under pairing), or `whole` (replicated);
    `unknown` for a parameter the split does not know."""
    if name in ("tok_emb.weight", "head.weight"):
        return "vocab"
    if name in ("pos_emb.weight", "ln_f.weight", "ln_f.bias"):
        return "whole"
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "blocks" or not parts[1].isdigit() \
            or parts[-1] not in ("weight", "bias"):
        return "unknown"
    if len(parts) == 4:
        return "whole" if parts[2] in ("ln1", "ln2") else "unknown"
    layer, param = ".".join(parts[2:4]), parts[4]
    if len(parts) != 5:
        return "unknown"
    if layer == "attn.qkv":
        return "heads"
    if layer == "mlp.fc":
        return "hidden"
    if layer in ("attn.proj", "mlp.proj"):
        if layout == "gather":
            return "width"
        if param == "bias":
            return "whole"
        return "head_cols" if layer == "attn.proj" else "hidden_cols"
    return "unknown"


def gpt_problems(model: GPT, pr: int, strategy: str) -> list[str]:
    """Why the GPT cannot be split over `pr` ranks (empty: it can)."""
    problems: list[str] = []
    blocks = [b for b in model.blocks if isinstance(b, TransformerBlock)
              and isinstance(b.attn, CausalSelfAttention) and isinstance(b.mlp, MLP)]
    if len(blocks) != len(model.blocks):
        return [f"strategy={strategy} splits a GPT of strategies.transformer.gpt's "
                f"TransformerBlocks only"]
    shapes = GPTShapes.of(model)
    if any(b.attn.heads != shapes.heads or b.mlp.fc.out_features != shapes.hidden
           for b in blocks):
        problems.append(f"strategy={strategy} needs every block of the GPT alike (heads, MLP "
                        f"width)")
    problems += [f"strategy={strategy} cannot split the GPT's parameter {name} (not one of "
                 f"strategies.transformer.gpt's layers)"
                 for name, _ in model.named_parameters() if _kind(name, "pairing") == "unknown"]
    if shapes.layers and pr > shapes.heads:
        problems.append(f"strategy={strategy} splits the GPT's {shapes.heads} attention heads "
                        f"over grid.pr={pr} ranks: grid.pr must be at most {shapes.heads}")
    if pr > shapes.vocab:
        problems.append(f"strategy={strategy} splits the GPT's vocabulary of {shapes.vocab} "
                        f"tokens over grid.pr={pr} ranks: grid.pr must be at most "
                        f"{shapes.vocab}")
    return problems


def local_shape(name: str, shape: tuple[int, ...], shapes: GPTShapes, pr: int, index: int,
                layout: Layout) -> tuple[tuple[int, ...], bool]:
    """Rank `index`'s shape of the parameter `name` and whether it is split (else
    replicated)."""
    kind = _kind(name, layout)
    heads = Partition(shapes.heads, pr).sizes[index]
    rows = {"vocab": Partition(shapes.vocab, pr).sizes[index],
            "heads": 3 * shapes.head_dim * heads,
            "hidden": Partition(shapes.hidden, pr).sizes[index],
            "width": Partition(shapes.width, pr).sizes[index]}
    if kind in rows:
        return (rows[kind], *shape[1:]), True
    if kind == "head_cols":
        return (shape[0], shapes.head_dim * heads), True
    if kind == "hidden_cols":
        return (shape[0], Partition(shapes.hidden, pr).sizes[index]), True
    return shape, False


# -- building -----------------------------------------------------------------------------------


def build_tensor_parallel(model: GPT, grid: ProcessGrid, layout: Layout,
                          sync_replica_gradients: bool, bucket_cap_bytes: int,
                          first_bucket_bytes: int) -> TensorParallelGPT:
    """This rank's part of `model`, whose layers it takes over (replicated parameters are the
    model's own objects)."""
    comm, index, pr = grid.model, grid.model_index, grid.pr
    shapes = GPTShapes.of(model)
    vocab_rows = Partition(shapes.vocab, pr).slice(index)
    heads = Partition(shapes.heads, pr)
    head_rows = heads.slice(index)
    dh = shapes.head_dim
    hidden = Partition(shapes.hidden, pr)
    width = Partition(shapes.width, pr)
    embedding = VocabParallelEmbedding(model.tok_emb, vocab_rows, comm)
    if shapes.tied:
        head = VocabParallelHead(embedding.weight)
    else:
        shard = nn.Parameter(model.head.weight.detach()[vocab_rows].clone())
        place_rows(shard, model.head.weight, vocab_rows)
        head = VocabParallelHead(shard)
    model.tok_emb, model.head = embedding, head  # type: ignore[assignment]
    for i, block in enumerate(model.blocks):
        assert isinstance(block, TransformerBlock)
        attn, mlp = block.attn, block.mlp
        qkv_rows = slice(3 * dh * head_rows.start, 3 * dh * head_rows.stop)
        proj, fc_proj = attn.proj, mlp.proj
        attn.qkv = RowsLinear(attn.qkv, qkv_rows)  # type: ignore[assignment]
        mlp.fc = RowsLinear(mlp.fc, hidden.slice(index))  # type: ignore[assignment]
        if layout == "pairing":
            attn.proj = RowParallelLinear(  # type: ignore[assignment]
                proj, slice(dh * head_rows.start, dh * head_rows.stop), comm,
                f"blocks.{i}.attn.proj")
            mlp.proj = RowParallelLinear(  # type: ignore[assignment]
                fc_proj, hidden.slice(index), comm, f"blocks.{i}.mlp.proj")
        else:
            attn.proj = GatheredLinear(  # type: ignore[assignment]
                proj, heads, dh, width, index, comm, f"blocks.{i}.attn.proj")
            mlp.proj = GatheredLinear(  # type: ignore[assignment]
                fc_proj, hidden, 1, width, index, comm, f"blocks.{i}.mlp.proj")
    pmodel = TensorParallelGPT(grid, model, layout, vocab_rows.start)
    split_ids = {id(p) for m in model.modules()
                 if isinstance(m, (RowsLinear, VocabParallelEmbedding, VocabParallelHead))
                 for p in m.parameters()}
    split_ids |= {id(m.weight) for m in model.modules() if isinstance(m, RowParallelLinear)}
    params = list(model.parameters())
    split = [p for p in params if id(p) in split_ids]
    replicated = [p for p in params if id(p) not in split_ids]
    pmodel.replicated_in_model_group = replicated
    pmodel.reducers = split_model_exchanges(grid, split, replicated, sync_replica_gradients,
                                            bucket_cap_bytes, first_bucket_bytes)
    return pmodel


# -- predictions --------------------------------------------------------------------------------


Items = list[tuple[str, list[tuple[int, torch.dtype]]]]  # (label, [(bytes, dtype)])


def _param_items(model: GPT, pr: int, layout: Layout,
                 trainable_only: bool = True) -> tuple[Items, Items]:
    """Rank 0's (label, [(bytes, dtype)]) of its split and its replicated parameters, in the
    parallel model's registration order (one parameter an item, as the buckets see them)."""
    shapes = GPTShapes.of(model)
    split: Items = []
    whole: Items = []
    for name, param in model.named_parameters():
        shape, is_split = local_shape(name, tuple(param.shape), shapes, pr, 0, layout)
        item = (name, [(math.prod(shape) * param.element_size(), param.dtype)])
        if param.requires_grad or not trainable_only:
            (split if is_split else whole).append(item)
    return split, whole


def tp_param_bytes(model: GPT, pr: int, layout: Layout) -> int:
    """Parameter bytes rank 0 holds."""
    split, whole = _param_items(model, pr, layout, trainable_only=False)
    return sum(nbytes for _, items in split + whole for nbytes, _ in items)


def activation_ops(model: GPT, tokens: int, pr: int, layout: Layout,
                   compute_dtype: torch.dtype | None) -> list[CommOp]:
    """What model-group rank 0 moves for a forward, loss and backward over `tokens` tokens
    (its batch group's rows × positions)."""
    if pr == 1:
        return []
    shapes = GPTShapes.of(model)
    whole = activation_itemsize([model])  # the embedding's output: the table's dtype
    act = activation_itemsize([model], compute_dtype)  # a Linear's output
    logits = compute_dtype or next(model.parameters()).dtype  # autocast: the half type
    emb = tokens * shapes.width * whole
    ops = [CommOp("allreduce", "model", pr, emb, "tok_emb")] * 2
    for i in range(shapes.layers):
        for name, features in (("attn.proj", shapes.width), ("mlp.proj", shapes.hidden)):
            label = f"blocks.{i}.{name}"
            if layout == "pairing":
                ops += [CommOp("allreduce", "model", pr, tokens * shapes.width * act, label)] * 2
            else:
                for n in (tokens * features * act, tokens * shapes.width * act):
                    ops += [CommOp("allgather", "model", pr, n, label),
                            CommOp("reduce_scatter", "model", pr, n, label)]
    return ops + split_loss_ops(tokens, pr, logits.itemsize)


def predict_tp_ops(model: GPT, sample_shape: tuple[int, ...], grid: GridShape,
                   global_batch: int, layout: Layout, caps: tuple[int, int],
                   compute_dtype: torch.dtype | None = None) -> list[CommOp]:
    """Rank 0's collectives per training step: the activations' over the model group, the
    split parameters' gradients over the batch group, the replicated ones' over the world."""
    rows = Partition(global_batch, grid.pc).sizes[0]
    split, whole = _param_items(model, grid.pr, layout)
    return (activation_ops(model, rows * sample_shape[0], grid.pr, layout, compute_dtype)
            + predict_gradient_ops(split, "batch", grid.pc, *caps)
            + predict_gradient_ops(whole, "world", grid.size, *caps))


def tp_activation_bytes(model: GPT, sample_shape: tuple[int, ...], grid: GridShape,
                        global_batch: int, layout: Layout, itemsize: int) -> int:
    """An estimate of what rank 0 keeps for backward: `activation_elements` split `Pr` ways;
    the gather layout also keeps each projection's gathered input."""
    rows = Partition(global_batch, grid.pc).sizes[0]
    positions = sample_shape[0]
    elements = activation_elements(model, rows, positions, model_split=grid.pr)
    if layout == "gather" and grid.pr > 1:
        shapes = GPTShapes.of(model)
        elements += rows * positions * shapes.layers * (shapes.width + shapes.hidden)
    return elements * itemsize


def tp_compute_seconds(model: GPT, sample_shape: tuple[int, ...], grid: GridShape,
                       global_batch: int, layout: Layout, rates: ComputeRates) -> float:
    """Rank 0's forward and backward compute: its local Linear shapes by `layer_seconds`
    (meta-device stand-ins), the attention's products on its heads, norms and activations on
    the tensors it holds, residual sums as passes. Approximate: the softmax and masking of the
    attention are priced as a few passes over its scores."""
    shapes = GPTShapes.of(model)
    pr = grid.pr
    rows = Partition(global_batch, grid.pc).sizes[0]
    t = sample_shape[0]
    n = rows * t
    heads = Partition(shapes.heads, pr).sizes[0]
    hidden = Partition(shapes.hidden, pr).sizes[0]
    width = Partition(shapes.width, pr).sizes[0]
    vocab = Partition(shapes.vocab, pr).sizes[0]
    dh, w = shapes.head_dim, shapes.width
    first = model.blocks[0] if len(model.blocks) else None
    bias = isinstance(first, TransformerBlock) and first.attn.qkv.bias is not None

    def linear(k: int, m: int, has_bias: bool = bias) -> nn.Linear:
        return nn.Linear(k, m, bias=has_bias, device="meta")

    norm = nn.LayerNorm(w, device="meta")
    seconds = layer_seconds(nn.Embedding(vocab, w, device="meta"), (rows, t), rates,
                            input_grad=False)
    seconds += layer_seconds(nn.Embedding(t, w, device="meta"), (t,), rates, input_grad=False)
    if shapes.layers:
        if layout == "pairing":
            projs = [linear(dh * heads, w), linear(hidden, w)]
        else:
            projs = [linear(w, width), linear(shapes.hidden, width)]
        block = (2 * layer_seconds(norm, (n, w), rates)
                 + layer_seconds(linear(w, 3 * dh * heads), (n, w), rates)
                 + sum(layer_seconds(p, (n, p.in_features), rates) for p in projs)
                 + layer_seconds(linear(w, hidden), (n, w), rates)
                 + layer_seconds(nn.GELU(approximate="tanh"), (n, hidden), rates))
        # q·kᵀ and p·v per head: forward one product each, backward two
        pairs = rows * heads
        block += 3 * pairs * (rates.gemm_seconds(t, dh, t) + rates.gemm_seconds(t, t, dh))
        block += rates.elementwise_seconds(6 * pairs * t * t * 4)  # softmax, mask, and back
        block += rates.elementwise_seconds(2 * 2.5 * n * w * 4)  # the two residual sums
        seconds += shapes.layers * block
    seconds += layer_seconds(norm, (n, w), rates)
    seconds += layer_seconds(linear(w, vocab, False), (n, w), rates)
    return seconds


# -- the layout choice --------------------------------------------------------------------------


def choose_layout(strategy: Strategy, layout: str, model: GPT, sample_shape: tuple[int, ...],
                  grid: GridShape, global_batch: int | None) -> Layout:
    """`layout` itself unless `auto`; then the layout of the least predicted step time
    (`predict_step`: compute, collectives, waits) for `global_batch` (none known: pairing,
    which moves fewer bytes in fewer collectives). Ties go to pairing. `strategy` has a
    `tp_layout` attribute: a copy with each layout fixed is priced."""
    if layout != "auto":
        assert layout in LAYOUTS, layout
        return "gather" if layout == "gather" else "pairing"
    if global_batch is None or grid.pr == 1:
        return "pairing"
    times = {}
    for choice in LAYOUTS:
        fixed = copy.copy(strategy)
        fixed.tp_layout = choice  # type: ignore[attr-defined]
        times[choice] = predict_step(fixed, model, sample_shape, grid, global_batch).total_s
    return min(LAYOUTS, key=lambda choice: times[choice])
