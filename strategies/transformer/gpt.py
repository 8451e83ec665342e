"""The transformer layers every strategy knows how to split: a decoder-only GPT built from them
(`model=gpt`) and a user's own model built from them train under `data`, `model`, `grid` and
`domain` alike.

They are plain PyTorch modules. What makes them splittable is the layout of their weights:

- `CausalSelfAttention.qkv` holds its output rows head by head, each head's query, key and
  value rows together (rows `[3·dh·h, 3·dh·(h+1))` are head h's q, k, v): a contiguous range
  of rows is a set of whole heads, which the model group splits without moving anything
  (tensor parallelism), and `forward` reads the number of heads from the weight it holds;
- the attention itself is a submodule (`core`, a `CausalAttention`), so sequence parallelism
  swaps in one that exchanges keys and values between ranks;
- `GPT.sequence_offset` is the global position of the first token a rank holds (0 unless the
  sequence is split).

Samples are token ids (batch, T); the output is logits (batch, T, vocab).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn


class CausalAttention(nn.Module):
    """softmax(q kᵀ / √dh + causal mask) v for q, k, v of shape (batch, heads, T, dh)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: `qkv` (head-major rows), attention, `proj`."""

    def __init__(self, width: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        if heads < 1 or width % heads:
            raise ValueError(f"the width {width} must be a multiple of the number of heads "
                             f"{heads}")
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.core = CausalAttention()
        self.proj = nn.Linear(width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, local heads, 3, dh) → three (b, heads, t, dh); the heads are those this rank's
        # rows of qkv hold (all of them unless the model group splits them)
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = self.core(q, k, v)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(nn.Module):
    """Linear to `hidden` features → GELU (tanh form, GPT-2's) → Linear back."""

    def __init__(self, width: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(width, hidden, bias=bias)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(hidden, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.act(self.fc(x)))
        return out


class TransformerBlock(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then + mlp(ln2(·))."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4, bias: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, bias)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width, mlp_ratio * width, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Token and position embeddings → blocks → final LayerNorm → `head` to the vocabulary.

    `tie_weights`: the head's weight is the token embedding's (GPT-2), so one table is both.
    `sparse_embedding`: the token table's gradient holds only the rows a batch touched (for
    `strategy=data`'s sparse exchange; needs an untied head, whose gradient is dense)."""

    # What it learns: the runner trains it on next-token targets (loss per token).
    objective = "next_token"

    def __init__(self, vocab_size: int, context: int, width: int = 64, layers: int = 2,
                 heads: int = 4, mlp_ratio: int = 4, bias: bool = True,
                 tie_weights: bool = True, sparse_embedding: bool = False) -> None:
        super().__init__()
        if sparse_embedding and tie_weights:
            raise ValueError("model.sparse_embedding=true needs model.tie_weights=false: a tied "
                             "head gives the table a dense gradient")
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, width, sparse=sparse_embedding)
        self.pos_emb = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads, mlp_ratio, bias)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        if tie_weights:
            self.head.weight = self.tok_emb.weight
        self.sequence_offset = 0  # the global position of this rank's first token
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, the residual projections scaled by
        1/√(2·layers) (each block adds two of them to the residual stream)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        positions = torch.arange(self.sequence_offset, self.sequence_offset + t,
                                 device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


@dataclass(frozen=True)
class GPTShapes:
    """A GPT's sizes, as its splits and their predictions need them."""

    vocab: int
    width: int
    heads: int
    head_dim: int
    hidden: int  # the MLP's features
    layers: int
    tied: bool

    @classmethod
    def of(cls, model: GPT) -> GPTShapes:
        blocks = transformer_blocks(model)
        width = model.tok_emb.embedding_dim
        heads = blocks[0].attn.heads if blocks else 0
        hidden = blocks[0].mlp.fc.out_features if blocks else 0
        return cls(model.tok_emb.num_embeddings, width, heads, width // max(heads, 1), hidden,
                   len(blocks), model.head.weight is model.tok_emb.weight)


def transformer_blocks(model: nn.Module) -> list[TransformerBlock]:
    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def is_gpt(model: nn.Module) -> TypeGuard[GPT]:
    return isinstance(model, GPT)


def activation_elements(model: GPT, rows: int, positions: int, key_positions: int | None = None,
                        model_split: int = 1) -> int:
    """What autograd keeps of a forward for `rows` sequences of `positions` tokens each (an
    estimate): per block the LayerNorm outputs, q/k/v, the attention's probabilities against
    `key_positions` keys, its output, the MLP's two hidden tensors and the residual sums; and the
    embeddings, final norm and logits. `model_split`: the heads, MLP features and vocabulary
    are split that many ways (tensor parallelism)."""
    shapes = GPTShapes.of(model)
    if not shapes.layers:
        return 0
    width, heads, hidden = shapes.width, shapes.heads, shapes.hidden
    keys = positions if key_positions is None else key_positions
    per_position = ((4 * width) + (4 * width + heads * keys + 2 * hidden) // model_split)
    return rows * positions * (shapes.layers * per_position + 2 * width
                               + shapes.vocab // model_split)
