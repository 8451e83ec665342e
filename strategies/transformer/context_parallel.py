"""`strategy=domain` on a GPT: sequence (context) parallelism.

The domain of a GPT's sample is its sequence. On a `Pr × Pc` grid the batch is split over the
`Pc` batch groups and each row's T positions over the `Pr` ranks of a model group (`grid.model`):
a rank holds positions `Partition(T, Pr).slice(model_index)` of every row of its group (uneven
pieces allowed, none empty). Every weight is replicated and its gradient summed over the world.

Everything but attention acts position by position and runs on the rank's positions alone:
the embeddings (the position embedding from `GPT.sequence_offset`, the rank's first position),
LayerNorm, the MLP, the head. Attention needs the keys and values of every earlier position,
brought by one of two exchanges (`strategy.kv_exchange`):

- `allgather`: all-gather K and V along the sequence over the model group (backward: its
  adjoint, a reduce-scatter), then attention at global positions; the score matrix of a rank is
  (T/Pr) × T;
- `ring`: Pr − 1 ring shifts pass the K, V blocks around the model group (backward: the opposite
  shifts); each block that is not entirely in the rank's future is attended to, and the outputs
  merge by log-sum-exp (the online softmax of flash attention); a score matrix is (T/Pr)² per
  block;
- `auto`: the one of less predicted step time (`predict_step`: the ring computes fewer blocks,
  the all-gather waits on fewer latencies); without a global batch, the cheaper exchange under
  the α–β cost model (`runner.cost.collectives`).

The rows contract (`strategies.base`): a rank's output is the logits of its own positions of
its batch group's rows, so its output rows are the whole group's and it scores
`targets[:, own positions]`; every target is scored on exactly one rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.primitives import all_gather, ring_shift_adjoint_op, ring_shift_op
from runner.cost.collectives import CommOp, MachineCosts, comm_seconds
from runner.cost.compute import ComputeRates
from runner.cost.layers import layer_seconds
from strategies.base import (
    GradientExchange,
    ParallelModel,
    Score,
    cross_entropy_score,
    split_model_exchanges,
)
from strategies.exchange.buckets import predict_gradient_ops
from strategies.transformer.gpt import GPT, CausalAttention, GPTShapes, transformer_blocks

KV_EXCHANGES = ("auto", "allgather", "ring")


# -- the attention of a split sequence ----------------------------------------------------------


def _positions(part: Partition, rank: int, device: torch.device) -> torch.Tensor:
    own = part.slice(rank)
    return torch.arange(own.start, own.stop, device=device)


class GatheredAttention(CausalAttention):
    """Causal attention of this rank's queries against every position's keys and values,
    all-gathered along the sequence over the model group."""

    def __init__(self, comm: CountedComm, part: Partition, label: str = "kv") -> None:
        super().__init__()
        self.comm, self.part, self.label = comm, part, label

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # positions first, K and V together: one gather of a contiguous (t, 2, b, h, dh) block
        kv = torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)
        kv = all_gather(kv, self.comm, 0, self.part, label=self.label)
        k_all, v_all = kv.permute(1, 2, 3, 0, 4).unbind(0)  # each (b, h, T, dh)
        queries = _positions(self.part, self.comm.rank, q.device)
        keys = torch.arange(self.part.total, device=q.device)
        mask = keys[None, :] <= queries[:, None]  # True: attended to
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


class _RingBlocks(Function):
    """Every rank's K, V block as the ring brings it: output s (s = 0 .. P−1) is the block of
    rank (r − s) mod P, stacked (2, b, h, t, dh). Backward runs the shifts' adjoints in reverse
    (Horner: g_{s−1} + shift*(…)), so every rank issues all P − 1 of them whichever blocks it
    attended to (a rank that attends to none of the blocks it received still passes on the
    gradients of others)."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, v: torch.Tensor, comm: CountedComm,
                part: Partition, label: str) -> tuple[torch.Tensor, ...]:
        ctx.comm, ctx.part, ctx.label = comm, part, label
        held = torch.stack((k.detach(), v.detach()))
        blocks = [held]
        for step in range(1, comm.size):
            held = ring_shift_op(held, comm, 3, _held_sizes(part, step - 1), 1, label)
            blocks.append(held)
        return tuple(blocks)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        comm, part, label = ctx.comm, ctx.part, ctx.label
        acc = grads[-1]
        for step in range(comm.size - 1, 0, -1):
            acc = ring_shift_adjoint_op(acc.contiguous(), comm, 3, _held_sizes(part, step - 1),
                                        1, label) + grads[step - 1]
        return acc[0], acc[1], None, None, None


def _held_sizes(part: Partition, step: int) -> tuple[int, ...]:
    """Each rank's block length after `step` shifts: rank k holds block (k − step) mod P."""
    p = part.parts
    return tuple(part.sizes[(k - step) % p] for k in range(p))


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ/√dh) v over one block of keys, and the log-sum-exp of its scores."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:  # the rank's own block: query i sees keys 0..i
        t = scores.shape[-1]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


class RingAttention(CausalAttention):
    """Causal attention of this rank's queries against the K, V blocks a ring brings (Pr − 1
    shifts), merged blockwise by log-sum-exp; blocks entirely in the rank's future are passed
    on but not computed with."""

    def __init__(self, comm: CountedComm, part: Partition, label: str = "kv ring") -> None:
        super().__init__()
        self.comm, self.part, self.label = comm, part, label

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rank = self.comm.rank
        blocks = _RingBlocks.apply(k, v, self.comm, self.part, self.label)
        out, lse = _block_attention(q, blocks[0][0], blocks[0][1], causal=True)
        for step in range(1, rank + 1):  # blocks rank−1 .. 0; later steps bring future blocks
            block = blocks[step]
            out_b, lse_b = _block_attention(q, block[0], block[1], causal=False)
            merged = torch.logaddexp(lse, lse_b)
            out = out * torch.exp(lse - merged) + out_b * torch.exp(lse_b - merged)
            lse = merged
        return out


# -- the parallel model ---------------------------------------------------------------------------


class SequenceParallelGPT(ParallelModel):
    """A GPT on this rank's positions of its batch group's rows
    (`strategies.transformer.context_parallel`)."""

    def __init__(self, grid: ProcessGrid, gpt: GPT, length: int) -> None:
        super().__init__(grid)
        self.gpt = gpt
        self.positions = Partition(length, grid.pr)
        self.own = self.positions.slice(grid.model_index)
        gpt.sequence_offset = self.own.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.positions.total:
            raise ValueError(f"the sequence is split for {self.positions.total} positions, got "
                             f"a batch of {x.shape[1]}")
        out: torch.Tensor = self.gpt(x[:, self.own])
        return out

    def output_rows(self, global_rows: int) -> slice:
        """The whole batch group's rows: a rank scores its positions of each of them."""
        return self.input_rows(global_rows)

    def score(self, output: torch.Tensor, targets: torch.Tensor,
              correct: bool = False) -> Score:
        """Only this rank's positions of the targets (its output's)."""
        return cross_entropy_score(output, targets[:, self.own], correct)


def build_sequence_parallel(model: GPT, sample_shape: tuple[int, ...], grid: ProcessGrid,
                            kv_exchange: str, sync_replica_gradients: bool,
                            bucket_cap_bytes: int, first_bucket_bytes: int) -> ParallelModel:
    """`model` split along the sequence over the model group (`kv_exchange`: allgather or
    ring, already chosen); every gradient summed over the world (over the model group without
    replica synchronisation)."""
    if kv_exchange not in ("allgather", "ring"):
        raise ValueError(f"kv_exchange must be allgather or ring here, got '{kv_exchange}'")
    length = int(sample_shape[0])
    part = Partition(length, grid.pr)
    if grid.pr > 1:
        for i, block in enumerate(transformer_blocks(model)):
            block.attn.core = (GatheredAttention(grid.model, part, f"block {i} kv")
                               if kv_exchange == "allgather"
                               else RingAttention(grid.model, part, f"block {i} kv ring"))
    pmodel = SequenceParallelGPT(grid, model, length)
    params = list(model.parameters())
    pmodel.replicated_in_model_group = params
    reducers: list[GradientExchange] = split_model_exchanges(
        grid, [], params, sync_replica_gradients, bucket_cap_bytes, first_bucket_bytes)
    pmodel.reducers = reducers
    return pmodel


# -- what it can run, and predictions from shapes ---------------------------------------------


def sequence_problems(model: GPT, sample_shape: tuple[int, ...], grid: GridShape) -> list[str]:
    """Why the sequence of `model`'s samples cannot be split over the model group."""
    if len(sample_shape) != 1:
        return [f"strategy=domain splits a GPT's sequences: got samples of shape "
                f"{tuple(sample_shape)}, expected (length,)"]
    problems = []
    length = int(sample_shape[0])
    if length < grid.pr:
        problems.append(f"strategy=domain splits each sequence over grid.pr={grid.pr} ranks, "
                        f"but sequences are {length} tokens: every rank needs a position (use a "
                        f"smaller grid.pr or longer sequences)")
    if length > model.context:
        problems.append(f"sequences of {length} tokens are longer than the GPT's context "
                        f"({model.context})")
    if model.tok_emb.sparse:
        problems.append("strategy=domain sums every gradient densely over the ranks: "
                        "model.sparse_embedding=true is for strategy=data")
    return problems


def kv_exchange_ops(mode: str, model: GPT, length: int, grid: GridShape, rows: int,
                    itemsize: int) -> list[CommOp]:
    """The key/value exchanges rank 0 issues in a step (forward and backward, every layer) for
    `rows` rows of its batch group, each element `itemsize` bytes."""
    if grid.pr == 1:
        return []
    shapes = GPTShapes.of(model)
    width, layers = shapes.width, shapes.layers
    part = Partition(length, grid.pr)
    per_position = rows * 2 * width * itemsize  # K and V of one position of every row
    ops: list[CommOp] = []
    for i in range(layers):
        if mode == "allgather":
            n = per_position * length
            ops += [CommOp("allgather", "model", grid.pr, n, f"block {i} kv"),
                    CommOp("reduce_scatter", "model", grid.pr, n, f"block {i} kv")]
        elif mode == "ring":
            label = f"block {i} kv ring"
            # forward: after s − 1 shifts rank 0 holds block (−(s − 1)) mod P and sends it on;
            # backward: the adjoint of shift s sends the gradient of the block it brought,
            # (−s) mod P
            ops += [CommOp("exchange", "model", grid.pr,
                           per_position * part.sizes[(1 - s) % grid.pr], label)
                    for s in range(1, grid.pr)]
            ops += [CommOp("exchange", "model", grid.pr,
                           per_position * part.sizes[(-s) % grid.pr], label)
                    for s in range(grid.pr - 1, 0, -1)]
        else:
            raise ValueError(f"unknown kv_exchange '{mode}'")
    return ops


def choose_kv_exchange(mode: str, model: GPT, length: int, grid: GridShape, rows: int,
                       itemsize: int, costs: MachineCosts) -> str:
    """`mode`, or for auto the exchange of fewer predicted seconds (α–β and the runner's cost
    per call: `runner.cost.collectives.comm_seconds`; the bytes are the same, so latency decides:
    the all-gather's ⌈log₂ Pr⌉ against the ring's Pr − 1). Ties go to allgather. A pure
    function of shapes and costs: every rank chooses alike."""
    if mode != "auto":
        return mode

    def seconds(choice: str) -> float:
        return comm_seconds(kv_exchange_ops(choice, model, length, grid, rows, itemsize), costs)

    return min(("allgather", "ring"), key=seconds)


def sequence_ops(model: GPT, sample_shape: tuple[int, ...], grid: GridShape, rows: int,
                 kv_exchange: str, itemsize: int, bucket_caps: tuple[int, int]) -> list[CommOp]:
    """Every collective rank 0 issues in a step, as the counted communicator records them:
    the key/value exchanges, and the gradient buckets' all-reduces over the world."""
    params = [(name, [(p.numel() * p.element_size(), p.dtype)])
              for name, p in model.named_parameters() if p.requires_grad]
    return (kv_exchange_ops(kv_exchange, model, int(sample_shape[0]), grid, rows, itemsize)
            + predict_gradient_ops(params, "world", grid.size, *bucket_caps))


def sequence_param_bytes(model: nn.Module) -> int:
    """Every weight is replicated: the whole model's bytes (a tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _attention_elements(mode: str, part: Partition, rank: int, rows: int, heads: int,
                        width: int) -> int:
    """What a rank's attention keeps for backward in one layer: the keys and values it attends
    to, and per score matrix its scores and probabilities."""
    t = part.sizes[rank]
    if part.parts == 1 or mode == "allgather":
        keys = part.total if part.parts > 1 else t
        # the gathered K, V of every position, and the (t × T) scores
        return 2 * rows * keys * width + 2 * rows * heads * t * keys
    # ring: blocks rank .. 0 (its own and the earlier ones), a (t × t_j) score matrix each
    seen = part.sizes[:rank + 1]
    return sum(2 * rows * tj * width + 2 * rows * heads * t * tj for tj in seen)


def sequence_activation_elements(model: GPT, length: int, grid: GridShape, rows: int,
                                 kv_exchange: str) -> int:
    """Elements of layer outputs the busiest rank keeps for backward in one step (an estimate,
    as `Strategy.predict_activation_bytes`): everything but attention on its t ≈ T/Pr positions;
    attention's keys and values and its score matrices, (t × T) with the all-gather, (t × t_j)
    per block the ring brings. With allgather the busiest rank is rank 0 (the longest piece);
    with ring, the last rank, which attends to every block."""
    shapes = GPTShapes.of(model)
    width, heads, hidden, vocab, layers = (shapes.width, shapes.heads, shapes.hidden,
                                           shapes.vocab, shapes.layers)
    part = Partition(length, grid.pr)

    def rank_elements(rank: int) -> int:
        t = part.sizes[rank]
        per_position = (width  # embeddings' sum
                        + layers * (8 * width + 2 * hidden)  # ln1, qkv (3), attn out, proj,
                        # residual, ln2, fc, gelu, mlp proj, residual
                        + width + vocab)  # final LayerNorm, logits
        attention = layers * _attention_elements(kv_exchange, part, rank, rows, heads, width)
        return rows * t * per_position + attention

    return max(rank_elements(rank) for rank in range(grid.pr))


def sequence_compute_seconds(model: GPT, length: int, grid: GridShape, rows: int,
                             kv_exchange: str, rates: ComputeRates) -> float:
    """Forward and backward seconds of the busiest rank, approximately: every layer but the
    attention core priced by `layer_seconds` on the rank's local shapes (rows, t, features);
    attention by its two products per score block (qkᵀ and pv, at rows·heads·t rows, the
    backward twice the forward's), a softmax's passes over the scores, and the residual
    sums. Not measured against a calibration: an estimate of the same form as the others'."""
    shapes = GPTShapes.of(model)
    width, heads, hidden = shapes.width, shapes.heads, shapes.hidden
    head_dim = shapes.head_dim
    part = Partition(length, grid.pr)
    itemsize = 4  # the rates are float32's

    def attention_seconds(rank: int) -> float:
        t = part.sizes[rank]
        if grid.pr == 1:
            blocks = [t]
        elif kv_exchange == "allgather":
            blocks = [length]
        else:
            blocks = list(part.sizes[:rank + 1])
        m = rows * heads * t
        seconds = 0.0
        for keys in blocks:
            products = rates.gemm_seconds(m, head_dim, keys) + rates.gemm_seconds(m, keys,
                                                                                    head_dim)
            seconds += 3 * products + rates.elementwise_seconds(6 * m * keys * itemsize)
            seconds += 12 * rates.dispatch  # products, mask, softmax and merge, both ways
        return seconds

    def rank_seconds(rank: int) -> float:
        t = part.sizes[rank]
        seconds = layer_seconds(model.tok_emb, (rows, t), rates, input_grad=False)
        seconds += layer_seconds(model.pos_emb, (t,), rates, input_grad=False)
        for block in transformer_blocks(model):
            seconds += layer_seconds(block.ln1, (rows, t, width), rates)
            seconds += layer_seconds(block.attn.qkv, (rows, t, width), rates)
            seconds += layer_seconds(block.attn.proj, (rows, t, width), rates)
            seconds += layer_seconds(block.ln2, (rows, t, width), rates)
            seconds += layer_seconds(block.mlp.fc, (rows, t, width), rates)
            seconds += layer_seconds(block.mlp.act, (rows, t, hidden), rates)
            seconds += layer_seconds(block.mlp.proj, (rows, t, hidden), rates)
            # two residual sums, forward and backward
            seconds += rates.elementwise_seconds(2 * 2.5 * rows * t * width * itemsize)
            seconds += attention_seconds(rank)
        seconds += layer_seconds(model.ln_f, (rows, t, width), rates)
        return seconds + layer_seconds(model.head, (rows, t, width), rates)

    return max(rank_seconds(rank) for rank in range(grid.pr))
