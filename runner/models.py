"""The model zoo: plain sequential PyTorch models (strategies transform them).

A factory takes the dataset's sample shape and number of classes, and, for token datasets, the
vocabulary size (`vocab_size`, given by `runner.assembly`), then its own options from the `model`
config group.
"""

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


def _first(value: object) -> int:
    """The height entry of a layer's kernel size, stride or padding (an int or a pair)."""
    if isinstance(value, int):
        return value
    assert isinstance(value, tuple), value  # alexnet's layers use numbers, never 'same'
    return int(value[0])


@register_model("alexnet")
def alexnet(input_shape: Sequence[int], num_classes: int,
            sample_shape: Sequence[int] = (3, 227, 227), classes: int = 1000) -> nn.Sequential:
    """The 8-layer ImageNet network (Krizhevsky et al., 2012): five convolutions, three
    fully-connected layers, about 61M weights for 227x227x3 inputs and 1000 classes.

    `sample_shape` and `classes` say what it was designed for, so the planner can plan it from
    shapes alone (`python -m runner.plan model=alexnet`); training uses the dataset's."""
    del sample_shape, classes
    channels = int(input_shape[0])
    features = [
        nn.Conv2d(channels, 96, 11, stride=4), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
    ]
    height, width = int(input_shape[1]), int(input_shape[2])
    for layer in features:
        if isinstance(layer, (nn.Conv2d, nn.MaxPool2d)):
            k, st, pd = (_first(layer.kernel_size), _first(layer.stride),
                         _first(layer.padding))
            height, width = (height + 2 * pd - k) // st + 1, (width + 2 * pd - k) // st + 1
    flat = 256 * height * width
    return nn.Sequential(*features, nn.Flatten(),
                         nn.Linear(flat, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, num_classes))


@register_model("bag_classifier")
def bag_classifier(input_shape: Sequence[int], num_classes: int, vocab_size: int | None = None,
                   embedding_dim: int = 64, hidden: Sequence[int] = (64,), mode: str = "mean",
                   sparse: bool = True, activation: str = "relu",
                   padding_idx: int | None = None) -> nn.Sequential:
    """A bag of tokens: EmbeddingBag (the mean of a document's token vectors) → MLP → classes.

    Nearly all weights are the (vocab_size × embedding_dim) table, and a batch touches only the
    rows of its tokens: with `sparse=True` its gradient holds just those rows, which is what the
    sparse exchanges of `strategy.sparse` move."""
    if vocab_size is None or vocab_size < 1:
        raise ValueError("bag_classifier embeds token ids: it needs a token dataset "
                         "(dataset=tokens)")
    if len(input_shape) != 1:
        raise ValueError(f"bag_classifier reads documents of token ids, shape (length,), got "
                         f"{tuple(input_shape)}")
    layers: list[nn.Module] = [nn.EmbeddingBag(int(vocab_size), int(embedding_dim), mode=mode,
                                               sparse=bool(sparse), padding_idx=padding_idx)]
    width = int(embedding_dim)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), _activation(activation)]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
