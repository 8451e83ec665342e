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
    connection (data trains it; model and grid split it by the rules of strategies/tree.py)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(math.prod(input_shape), width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x.flatten(1)))
        return self.head(h + self.block(h))
