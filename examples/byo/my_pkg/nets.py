"""Models of the user's own: any `torch.nn.Module`, built by `model._target_=...`.

gridrun passes `input_shape` and `num_classes` (and, for token data, `vocab_size`) to the
arguments of those names, if the constructor has them; every other argument is a config key.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class ResidualMLP(nn.Module):
    """Linear → ReLU, then a residual block, then the classifier: a module tree with a skip
    connection (data trains it; model and grid split it by the rules of
    strategies/layers/tree.py)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(math.prod(input_shape), width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x.flatten(1)))
        return self.head(h + self.block(h))


class Attention(nn.Module):
    """Causal self-attention with one fused q/k/v projection; heads reshaped by `-1`, so a
    plan that splits the projection over ranks runs it on each rank's heads unchanged."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (part.reshape(b, t, self.heads, -1).transpose(1, 2)
                   for part in self.qkv(x).chunk(3, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm attention and MLP, each a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    """A causal language model of the user's own (token ids in, a score per position and
    token out): split by `strategy.plan` over the ranks of a model group (README)."""

    objective = "next_token"

    def __init__(self, vocab_size: int, input_shape: tuple[int, ...], width: int = 32,
                 heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.zeros(input_shape[0], width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
