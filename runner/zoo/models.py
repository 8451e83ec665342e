"""The model zoo: plain PyTorch models, most of them one nn.Sequential, ResNet a module tree
laid out as torchvision's (strategies transform them).

A factory takes the dataset's sample shape and number of classes, and, for token datasets, the
vocabulary size (`vocab_size`, given by `runner.training.assembly`), then its own options from the
`model` config group.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn

from runner.config.registry import register_model
from strategies.transformer.gpt import GPT

_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def _activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"model.activation={name}: unknown; known: "
                         f"{', '.join(_ACTIVATIONS)}") from None


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
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
        raise ValueError(f"model.kernel_size={kernel_size}: must be an integer >= 1")
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


def _token_inputs(model: str, samples: str, input_shape: Sequence[int], vocab_size: int | None,
                  datasets: str) -> int:
    """The vocabulary of a model that embeds token ids, or ValueError naming what it needs."""
    if vocab_size is None or vocab_size < 1:
        raise ValueError(f"{model} embeds token ids: it needs a token dataset ({datasets})")
    if len(input_shape) != 1:
        raise ValueError(f"{model} reads {samples} of token ids, shape (length,), got "
                         f"{tuple(input_shape)}")
    return int(vocab_size)


@register_model("bag_classifier")
def bag_classifier(input_shape: Sequence[int], num_classes: int, vocab_size: int | None = None,
                   embedding_dim: int = 64, hidden: Sequence[int] = (64,), mode: str = "mean",
                   sparse: bool = True, activation: str = "relu",
                   padding_idx: int | None = None) -> nn.Sequential:
    """A bag of tokens: EmbeddingBag (the mean of a document's token vectors) → MLP → classes.

    Nearly all weights are the (vocab_size × embedding_dim) table, and a batch touches only the
    rows of its tokens: with `sparse=True` its gradient holds just those rows, which is what the
    sparse exchanges of `strategy.sparse` move."""
    vocab_size = _token_inputs("bag_classifier", "documents", input_shape, vocab_size,
                               "dataset=tokens")
    if mode not in ("sum", "mean", "max"):
        raise ValueError(f"model.mode={mode}: must be one of sum, mean, max")
    layers: list[nn.Module] = [nn.EmbeddingBag(int(vocab_size), int(embedding_dim), mode=mode,
                                               sparse=bool(sparse), padding_idx=padding_idx)]
    width = int(embedding_dim)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), _activation(activation)]
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------------------------
# ResNet (He et al., 2016) with basic blocks: an nn.Module tree laid out as torchvision's is.


def _downsampled(size: int) -> int:
    """A side of the feature map after a 3×3 convolution with stride 2 and padding 1."""
    return (size - 1) // 2 + 1


class BasicBlock(nn.Module):
    """conv3×3 → BN → ReLU → conv3×3 → BN, plus the shortcut, then ReLU.

    The shortcut is the identity when the block keeps its input's shape (`shortcut` is None),
    else a projection: conv1×1 with the block's stride → BN. Without batch norm (`batch_norm=
    False`) the convolutions have biases and `bn1`, `bn2` are None. Submodules are registered in
    the order they run: conv1, bn1, relu1, conv2, bn2, shortcut, relu2; the addition is
    `out + identity` in `forward` (torch.fx traces it as `operator.add`)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1,
                 batch_norm: bool = True) -> None:
        super().__init__()
        bias = not batch_norm
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=bias)
        self.bn1 = nn.BatchNorm2d(out_channels) if batch_norm else None
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=bias)
        self.bn2 = nn.BatchNorm2d(out_channels) if batch_norm else None
        self.shortcut: nn.Sequential | None = None
        if stride != 1 or in_channels != out_channels:
            projection: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, 1, stride=stride,
                                                     bias=bias)]
            if batch_norm:
                projection.append(nn.BatchNorm2d(out_channels))
            self.shortcut = nn.Sequential(*projection)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(x)
        if self.bn1 is not None:
            out = self.bn1(out)
        out = self.relu1(out)
        out = self.conv2(out)
        if self.bn2 is not None:
            out = self.bn2(out)
        identity = x if self.shortcut is None else self.shortcut(x)
        out = out + identity
        return self.relu2(out)


class ResNet(nn.Module):
    """`stem` → `layer1` … `layerN` (nn.Sequential of BasicBlocks) → `pool` (global average)
    → `flatten` → `fc`."""

    def __init__(self, stem: nn.Sequential, stages: Sequence[nn.Sequential], width: int,
                 num_classes: int) -> None:
        super().__init__()
        self.stem = stem
        self.num_stages = len(stages)
        for index, stage in enumerate(stages, start=1):
            self.add_module(f"layer{index}", stage)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(width, num_classes)

    def stages(self) -> list[nn.Module]:
        return [self.get_submodule(f"layer{i}") for i in range(1, self.num_stages + 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages():
            x = stage(x)
        return self.fc(self.flatten(self.pool(x)))


_STEMS = ("cifar", "imagenet")


def _image_shape(model: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"{model} needs image inputs (channels, height, width), got shape "
                         f"{tuple(input_shape)}")
    channels, height, width = (int(d) for d in input_shape)
    return channels, height, width


def _init_convolutions(model: nn.Module) -> None:
    """torchvision's initialisation of convolutions and batch norms: Kaiming-normal weights
    (fan-out, ReLU) and zero biases; batch norms weight 1, bias 0. Linear layers keep PyTorch's
    default: torchvision's N(0, 0.01²) for VGG's classifier leaves a small VGG at chance for
    its first hundred steps at lr 0.1, the default trains it within twenty."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


@register_model("resnet")
def resnet(input_shape: Sequence[int], num_classes: int, widths: Sequence[int] = (16, 32, 64),
           blocks: Sequence[int] = (1, 1, 1), stem: Literal["cifar", "imagenet"] = "cifar",
           batch_norm: bool = True) -> ResNet:
    """ResNet with basic blocks (He et al., 2016). Stage i has `blocks[i]` blocks of
    `widths[i]` channels; `resnet18` is widths [64, 128, 256, 512], blocks [2, 2, 2, 2].

    `stem`: "cifar" is conv3×3 stride 1 (→ BN → ReLU), for 32×32 and smaller images;
    "imagenet" is conv7×7 stride 2 (→ BN → ReLU) and a 3×3 max-pool with stride 2. The first
    block of every stage after the first downsamples with stride 2, unless the feature map is
    already 2 or fewer pixels high or wide: then it keeps stride 1 (its projection shortcut only
    changes the channels), so an 8×8 input (digits) runs any number of stages (8 → 4 → 2 → 2).
    A shortcut is a projection (conv1×1 with the block's stride → BN) exactly where the
    channels or the stride change. `batch_norm=False`: no batch norms, biases in every
    convolution."""
    channels, height, width = _image_shape("resnet", input_shape)
    widths, blocks = [int(w) for w in widths], [int(b) for b in blocks]
    if not widths or len(widths) != len(blocks):
        raise ValueError(f"model.widths and model.blocks must be lists of the same length >= 1 "
                         f"(one entry per stage), got {widths} and {blocks}")
    if min(widths) < 1 or min(blocks) < 1:
        raise ValueError(f"every entry of model.widths and model.blocks must be >= 1, got "
                         f"{widths} and {blocks}")
    if stem not in _STEMS:
        raise ValueError(f"model.stem must be one of {', '.join(_STEMS)}, got {stem!r}")
    bias = not batch_norm
    norm: list[nn.Module] = [nn.BatchNorm2d(widths[0])] if batch_norm else []
    if stem == "cifar":
        stem_layers = nn.Sequential(nn.Conv2d(channels, widths[0], 3, padding=1, bias=bias),
                                    *norm, nn.ReLU())
    else:
        stem_layers = nn.Sequential(nn.Conv2d(channels, widths[0], 7, stride=2, padding=3,
                                              bias=bias),
                                    *norm, nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        height, width = _downsampled(_downsampled(height)), _downsampled(_downsampled(width))
    stages, in_channels = [], widths[0]
    for index, (out_channels, count) in enumerate(zip(widths, blocks, strict=True)):
        stride = 2 if index > 0 and height > 2 and width > 2 else 1
        if stride == 2:
            height, width = _downsampled(height), _downsampled(width)
        stage = [BasicBlock(in_channels, out_channels, stride, batch_norm)]
        stage += [BasicBlock(out_channels, out_channels, 1, batch_norm) for _ in range(count - 1)]
        stages.append(nn.Sequential(*stage))
        in_channels = out_channels
    model = ResNet(stem_layers, stages, in_channels, num_classes)
    _init_convolutions(model)
    return model


# ---------------------------------------------------------------------------------------------
# VGG (Simonyan & Zisserman, 2015): one nn.Sequential, features then classifier.

# The paper's configurations A (11 weight layers), B (13), D (16) and E (19): a number is a
# 3×3 convolution's output channels, "M" a 2×2 max-pool.
VGG_CONFIGS: dict[str, list[int | str]] = {
    "11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
           512, 512, 512, "M"],
    "19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
           512, 512, 512, 512, "M"],
}


def _vgg_layers(config: int | str | Sequence[int | str]) -> list[int | str]:
    if isinstance(config, (bool, int, str)):
        key = str(config)
        if key not in VGG_CONFIGS:
            raise ValueError(f"model.config={key}: must be one of {', '.join(VGG_CONFIGS)} or a "
                             f"list of channel counts and 'M' (max-pool)")
        return list(VGG_CONFIGS[key])
    layers: list[int | str] = []
    for entry in config:
        if isinstance(entry, str) and entry.upper() == "M":
            layers.append("M")
        elif isinstance(entry, int) and not isinstance(entry, bool) and entry >= 1:
            layers.append(entry)
        else:
            raise ValueError(f"model.config: {entry!r} is neither a channel count >= 1 nor 'M' "
                             f"(max-pool)")
    if not any(isinstance(entry, int) for entry in layers):
        raise ValueError("model.config needs at least one convolution (a channel count)")
    return layers


@register_model("vgg")
def vgg(input_shape: Sequence[int], num_classes: int,
        config: int | str | Sequence[int | str] = (16, "M", 32, "M", 64, "M"),
        batch_norm: bool = False, hidden: int = 128, dropout: float = 0.5,
        sample_shape: Sequence[int] = (3, 224, 224), classes: int = 1000) -> nn.Sequential:
    """VGG (Simonyan & Zisserman, 2015) as one nn.Sequential: per number of `config` a 3×3
    convolution (padding 1) [→ BatchNorm2d when `batch_norm`] → ReLU, per "M" a 2×2 max-pool;
    then Flatten → Linear(hidden) → ReLU → Dropout → Linear(hidden) → ReLU → Dropout →
    Linear(classes). `config` "11", "13", "16", "19" are the paper's A, B, D and E (`vgg16`:
    138,357,544 parameters for 3×224×224 and 1000 classes, `hidden=4096`), or a list such as
    [16, "M", 32, "M"]. A max-pool is skipped once the feature map is 1 pixel high or wide, so
    every configuration runs on 8×8 inputs; the classifier reads the flattened feature map of
    the input's size (512×7×7 for VGG-16 at 224×224).

    `sample_shape` and `classes` say what it was designed for, so the planner can plan it from
    shapes alone (`python -m runner.plan model=vgg16`); training uses the dataset's."""
    del sample_shape, classes
    channels, height, width = _image_shape("vgg", input_shape)
    if hidden < 1:
        raise ValueError(f"model.hidden must be >= 1, got {hidden}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.dropout must be in [0, 1), got {dropout}")
    layers: list[nn.Module] = []
    for entry in _vgg_layers(config):
        if isinstance(entry, str):  # "M"
            if height >= 2 and width >= 2:
                layers.append(nn.MaxPool2d(2))
                height, width = height // 2, width // 2
            continue
        layers.append(nn.Conv2d(channels, entry, 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(entry))
        layers.append(nn.ReLU())
        channels = entry
    layers += [nn.Flatten(),
               nn.Linear(channels * height * width, hidden), nn.ReLU(), nn.Dropout(dropout),
               nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
               nn.Linear(hidden, num_classes)]
    model = nn.Sequential(*layers)
    _init_convolutions(model)
    return model


# ---------------------------------------------------------------------------------------------
# GPT (Radford et al., 2019): a decoder-only transformer of gridrun's splittable layers.


@register_model("gpt")
class ZooGPT(GPT):
    """`strategies.transformer.gpt.GPT` for a token dataset: the context is the dataset's sequence
    length, the vocabulary its. Trained on next-token targets (`objective`). GPT-2 small is
    width 768, 12 layers, 12 heads, vocabulary 50257, context 1024 (`conf/model/gpt2_small`)."""

    def __init__(self, input_shape: Sequence[int], vocab_size: int | None = None,
                 width: int = 64, layers: int = 2, heads: int = 4, mlp_ratio: int = 4,
                 bias: bool = True, tie_weights: bool = True, sparse_embedding: bool = False,
                 context: int | None = None) -> None:
        vocab_size = _token_inputs("gpt", "sequences", input_shape, vocab_size,
                                   "dataset=kjv or dataset=tokens")
        problems = [f"model.{name} must be >= 1, got {value}" for name, value in
                    (("width", width), ("layers", layers), ("heads", heads),
                     ("mlp_ratio", mlp_ratio)) if int(value) < 1]
        if not problems and width % heads:
            problems.append(f"model.width={width} must be a multiple of model.heads={heads}")
        length = int(input_shape[0])
        if context is not None and context < length:
            problems.append(f"model.context={context} is shorter than the dataset's sequences "
                            f"({length} tokens)")
        if problems:
            raise ValueError("; ".join(problems))
        super().__init__(int(vocab_size), int(context or length), int(width), int(layers),
                         int(heads), int(mlp_ratio), bool(bias), bool(tie_weights),
                         bool(sparse_embedding))


# Class names of the transformers library's models trained on next tokens (the rest classify).
NEXT_TOKEN_MODELS = ("ForCausalLM", "LMHeadModel")


def built_from_config(model_class: type) -> bool:
    """Whether `model_class` is an `nn.Module` built from a configuration object (the
    transformers library's models: a `config_class` attribute)."""
    return (issubclass(model_class, nn.Module)
            and isinstance(getattr(model_class, "config_class", None), type))


@functools.cache
def configured_model(model_class: type) -> Callable[..., nn.Module]:
    """A model class built from a configuration object, as a factory of keyword options: the
    configuration's own fields (no weights are read), the dataset's vocabulary as `vocab_size`
    where the configuration has one, and its classes as `num_labels` for a classifier. A causal
    language model (`...ForCausalLM`, `...LMHeadModel`) trains on next tokens."""
    config_class = model_class.config_class  # type: ignore[attr-defined]
    fields = {k: v for k, v in config_class().to_dict().items()
              if k.isidentifier() and not k.startswith("_")}
    next_token = model_class.__name__.endswith(NEXT_TOKEN_MODELS)

    def build(**options: Any) -> nn.Module:
        num_classes = options.pop("num_classes", None)
        if num_classes is not None and not next_token and "num_labels" not in options:
            options["num_labels"] = num_classes
        return cast(nn.Module, model_class(config_class(**options)))

    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(name, keyword, default=default)
              for name, default in sorted(fields.items())]
    if not next_token:
        params.append(inspect.Parameter("num_classes", keyword, default=None))
        if "num_labels" not in fields:
            params.append(inspect.Parameter("num_labels", keyword, default=None))
    build.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = model_class.__name__
    build.objective = "next_token" if next_token else "classify"  # type: ignore[attr-defined]
    return build
