"""Plugins registered by name: list this module in `plugins` and every rank imports it
(`gridrun plugins=[my_pkg.register] model=wide_mlp`)."""

from __future__ import annotations

import math

from torch import nn

from runner.config.registry import register_model


@register_model("wide_mlp")
def wide_mlp(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> nn.Sequential:
    """One wide hidden layer: an nn.Sequential of Linear and ReLU, so every strategy splits it."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                         nn.Linear(width, num_classes))
