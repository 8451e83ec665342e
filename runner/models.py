"""The model zoo: plain sequential PyTorch models (strategies transform them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from runner.registry import register_model

_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def _activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation '{name}'; known: {', '.join(_ACTIVATIONS)}") from None


@register_model("mlp")
def mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128, 128),
        activation: str = "relu") -> nn.Sequential:
    """Flatten → (Linear → activation) per hidden width → Linear to the classes."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), _activation(activation)]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


@register_model("cnn")
def cnn(input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (6, 16),
        kernel_size: int = 3, hidden: Sequence[int] = (120, 84),
        activation: str = "relu") -> nn.Sequential:
    """LeNet-style: (Conv 'same' → activation → 2×2 max-pool) per channel count, then an MLP head.

    A pooling step is skipped once the feature map is smaller than 2×2, so small inputs such as
    the 8×8 digits work with any number of convolution stages.
    """
    if len(input_shape) != 3:
        raise ValueError(f"cnn needs image inputs (channels, height, width), got shape "
                         f"{tuple(input_shape)}")
    in_channels, height, width = (int(d) for d in input_shape)
    layers: list[nn.Module] = []
    for out_channels in channels:
        layers += [nn.Conv2d(in_channels, int(out_channels), kernel_size, padding=kernel_size // 2),
                   _activation(activation)]
        if height >= 2 and width >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        in_channels = int(out_channels)
    layers.append(nn.Flatten())
    features = in_channels * height * width
    for h in hidden:
        layers += [nn.Linear(features, int(h)), _activation(activation)]
        features = int(h)
    layers.append(nn.Linear(features, num_classes))
    return nn.Sequential(*layers)
