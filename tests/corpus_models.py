"""The conformance corpus: small PyTorch models written from scratch, each standing for one
architectural pattern that today's model zoos (timm, torchvision, the transformers library) use
(depthwise and grouped convolutions, squeeze-and-excitation, BatchNorm subclasses that call
`F.batch_norm` themselves, SyncBatchNorm, ConvNeXt's channels-last LayerNorm and layer scale,
ceil-mode pooling, stochastic depth, hand-written and fused attention, shape-dependent control
flow, keyword/dict/dataclass/tuple outputs, buffers and `nn.ModuleDict`, tied embeddings, token
classifiers); the suite trains every one of them under every parallel strategy and compares the
result with one process, so each is tiny, deterministic given torch's seed, and dtype-agnostic
(it runs in float32 and float64 alike)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# convolutional patterns


class DepthwiseSeparable(nn.Module):
    """torchvision's MobileNetV2 / timm's DepthwiseSeparableConv: depthwise then pointwise conv."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8,
                 out_width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU6(),
        )
        self.dw = nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False)
        self.bn_dw = nn.BatchNorm2d(width)
        self.act_dw = nn.ReLU6()
        self.pw = nn.Conv2d(width, out_width, 1, bias=False)
        self.bn_pw = nn.BatchNorm2d(out_width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(out_width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.act_dw(self.bn_dw(self.dw(x)))
        x = self.bn_pw(self.pw(x))
        return self.head(torch.flatten(self.pool(x), 1))


class GroupedConv(nn.Module):
    """torchvision's ResNeXt Bottleneck: a grouped 3x3 conv in a residual block, with GroupNorm."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8,
                 groups: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
            nn.GroupNorm(2, width),
            nn.ReLU(),
        )
        self.conv1 = nn.Conv2d(width, width, 1, bias=False)
        self.norm1 = nn.GroupNorm(2, width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, groups=groups, bias=False)
        self.norm2 = nn.GroupNorm(2, width)
        self.conv3 = nn.Conv2d(width, width, 1, bias=False)
        self.norm3 = nn.GroupNorm(2, width)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.relu(self.norm1(self.conv1(x)))
        y = self.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        x = self.relu(x + y)
        return self.head(torch.flatten(self.pool(x), 1))


class SEModule(nn.Module):
    """timm's SEModule: pool, reduce, ReLU, expand, sigmoid gate multiplied into the input."""

    def __init__(self, channels: int, reduction: int = 4) -> None:
        super().__init__()
        hidden = max(1, channels // reduction)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, hidden, 1)
        self.act = nn.ReLU()
        self.fc2 = nn.Conv2d(hidden, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc2(self.act(self.fc1(self.pool(x))))
        return x * self.gate(s)


class SqueezeExcite(nn.Module):
    """timm's / torchvision's squeeze-and-excitation (SE-ResNet, EfficientNet) after a conv."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU()
        self.se = SEModule(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.se(self.act(self.bn(self.conv(x))))
        return self.head(torch.flatten(self.pool(x), 1))


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: a BatchNorm2d subclass calling F.batch_norm itself, then act."""

    def __init__(self, num_features: int, act: bool = True, drop: float = 0.0,
                 eps: float = 1e-5, momentum: float | None = 0.1) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.drop: nn.Module = nn.Dropout(drop) if drop > 0 else nn.Identity()
        self.act: nn.Module = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as timm/layers/norm_act.py does it
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
            else:  # exponential moving average
                exponential_average_factor = self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        x = F.batch_norm(
            x,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.weight,
            self.bias,
            bn_training,
            exponential_average_factor,
            self.eps,
        )
        x = self.drop(x)
        return self.act(x)


class BNActNet(nn.Module):
    """timm's norm-act layers (ResNet-D, EfficientNet): convs each followed by BatchNormAct2d."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False)
        self.bn1 = BatchNormAct2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = BatchNormAct2d(2 * width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.head(torch.flatten(self.pool(x), 1))


class ScaledBatchNorm(nn.BatchNorm2d):
    """A user's BatchNorm2d subclass whose forward calls super().forward and rescales it."""

    def __init__(self, num_features: int, gain: float = 1.5) -> None:
        super().__init__(num_features)
        self.gain = nn.Parameter(torch.full((1,), gain))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain + 0.1


class ScaledBNNet(nn.Module):
    """User code subclassing a zoo layer: two ScaledBatchNorm (BatchNorm2d subclasses) in a net."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False)
        self.bn1 = ScaledBatchNorm(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = ScaledBatchNorm(width)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        return self.head(torch.flatten(self.pool(x), 1))


class SyncBNNet(nn.Module):
    """torchvision's reference scripts' --sync-bn: nn.SyncBatchNorm.convert_sync_batchnorm."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)
        # the root is no BatchNorm: its children are converted in place and the root returned
        nn.SyncBatchNorm.convert_sync_batchnorm(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class ConvNeXtBlock(nn.Module):
    """timm's / torchvision's ConvNeXt stage: dw 7x7, channels-last LayerNorm, MLP, layer scale."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16,
                 layer_scale: float = 1e-1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(input_shape[0], width, 2, stride=2)
        self.dwconv = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm = nn.LayerNorm(width)
        self.pwconv1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * width, width)
        self.gamma = nn.Parameter(torch.full((width,), layer_scale))
        self.head_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.dwconv(x).permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        y = (y * self.gamma).permute(0, 3, 1, 2)  # back to (N, C, H, W)
        x = x + y
        return self.head(self.head_norm(x.mean((2, 3))))


class PoolingVariants(nn.Module):
    """torchvision's GoogLeNet / timm's ceil-mode pooling: Max/Avg ceil_mode, adaptive max."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], width, 3, padding=1)
        self.maxpool = nn.MaxPool2d(3, stride=2, ceil_mode=True)  # 8 -> 4 (3 without ceil)
        self.conv2 = nn.Conv2d(width, width, 2)  # 4 -> 3
        self.avgpool = nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False)  # 3 -> 2
        self.adaptive = nn.AdaptiveMaxPool2d((2, 2))
        self.relu = nn.ReLU()
        self.head = nn.Linear(width * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.conv1(x)))
        x = self.avgpool(self.relu(self.conv2(x)))
        return self.head(torch.flatten(self.adaptive(x), 1))


class DropPath(nn.Module):
    """timm's DropPath: stochastic depth, dropping a whole residual branch per sample."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class StochasticDepth(nn.Module):
    """timm's drop_path_rate / torchvision's StochasticDepth: residual branches through DropPath."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8,
                 drop_path: float = 0.2, dropout: float = 0.25) -> None:
        super().__init__()
        self.stem = nn.Conv2d(input_shape[0], width, 3, padding=1)
        self.branches = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(width, width, 3, padding=1),
            )
            for _ in range(2)
        )
        self.drop_path = DropPath(drop_path)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.stem(x))
        for branch in self.branches:
            x = self.relu(x + self.drop_path(branch(x)))
        return self.head(self.dropout(torch.flatten(self.pool(x), 1)))


# ---------------------------------------------------------------------------------------------
# transformer patterns


class Attention(nn.Module):
    """timm's vision_transformer.Attention: a qkv Linear, reshape/permute heads, softmax by hand."""

    def __init__(self, dim: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim ** -0.5
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = q @ k.transpose(-2, -1) * self.scale
        if self.causal:
            future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            attn = attn.masked_fill(future, float("-inf"))
        x = attn.softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class SdpaAttention(Attention):
    """The transformers library's SDPA attention: view/transpose heads, fused attention."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (
            t.view(b, n, self.heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        x = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    """timm's Mlp: Linear, GELU, Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """timm's vision_transformer.Block: pre-norm attention and MLP, each a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2,
                 attention: type[Attention] = Attention, causal: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attention(dim, heads, causal=causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_ratio * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTTiny(nn.Module):
    """timm's VisionTransformer: conv patch embedding, cls token, position embedding, blocks."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, patch: int = 4,
                 dim: int = 16, depth: int = 2, heads: int = 2,
                 attention: type[Attention] = Attention) -> None:
        super().__init__()
        channels, height, width = input_shape
        patches = (height // patch) * (width // patch)
        self.patch_embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        self.blocks = nn.Sequential(*(Block(dim, heads, attention=attention)
                                      for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, C)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.blocks(x + self.pos_embed)
        return self.head(self.norm(x[:, 0]))


class ViTSdpa(ViTTiny):
    """timm's fused_attn / the transformers library's ViT: F.scaled_dot_product_attention."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, patch: int = 4,
                 dim: int = 16, depth: int = 2, heads: int = 2) -> None:
        super().__init__(input_shape, num_classes, patch=patch, dim=dim, depth=depth,
                         heads=heads, attention=SdpaAttention)


# ---------------------------------------------------------------------------------------------
# forward signatures, outputs and module containers


class ShapeControlFlow(nn.Module):
    """timm's / torchvision's shape-dependent branches in forward (no fx-traceable graph)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.width = width
        self.pool = nn.MaxPool2d(2)
        self.proj = nn.Conv2d(input_shape[0], width, 1)
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.relu = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] >= 8:
            x = self.pool(x)
        if x.shape[1] != self.width:
            x = self.proj(x)
        x = self.relu(self.conv(x))
        return self.head(torch.flatten(self.gap(x), 1))


class _ConvFeatures(nn.Module):
    """A convolution, global pooling and a Linear head: the body of the output patterns below
    (what they return is what differs)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(input_shape[0], width, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.relu(self.conv(x))), 1)


class KeywordOutputs(_ConvFeatures):
    """The transformers library's forward(pixel_values=..., return_dict=...) returning a dict."""

    def forward(self, pixel_values: torch.Tensor | None = None, return_dict: bool = True,
                **kwargs: Any) -> dict[str, torch.Tensor] | tuple[torch.Tensor, torch.Tensor]:
        if pixel_values is None:
            raise ValueError("KeywordOutputs needs pixel_values")
        features = self.features(pixel_values)
        logits = self.head(features)
        if return_dict:
            return {"logits": logits, "features": features}
        return logits, features


@dataclass
class ClassifierOutput:
    """The transformers library's ModelOutput: a dataclass holding the logits and more."""

    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOutput(_ConvFeatures):
    """The transformers library's ImageClassifierOutput: forward returns a dataclass."""

    def forward(self, x: torch.Tensor) -> ClassifierOutput:
        hidden = self.features(x)
        return ClassifierOutput(logits=self.head(hidden), hidden=hidden)


class TupleOutput(_ConvFeatures):
    """torchvision's GoogLeNet / Inception aux outputs: forward returns (logits, aux)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        aux = self.features(x)
        return self.head(aux), aux


class BuffersAndModuleDict(nn.Module):
    """torchvision's normalizing transforms as buffers, layers held in an nn.ModuleDict by key."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> None:
        super().__init__()
        channels, height, width_px = input_shape
        imagenet_mean, imagenet_std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
        mean = imagenet_mean if channels == 3 else [0.5] * channels
        std = imagenet_std if channels == 3 else [0.25] * channels
        # constants rebuilt at construction: kept out of the state dict (persistent=False)
        self.register_buffer("mean", torch.tensor(mean).view(channels, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(channels, 1, 1), persistent=False)
        # a fixed (not learned, not a counter) positional bias, saved with the model
        rows = torch.linspace(-1.0, 1.0, height).view(1, 1, height, 1)
        cols = torch.linspace(-1.0, 1.0, width_px).view(1, 1, 1, width_px)
        scales = torch.arange(1, width + 1, dtype=torch.get_default_dtype()).view(1, width, 1, 1)
        self.register_buffer("pos_bias", 0.1 * torch.sin(scales * rows) * torch.cos(scales * cols))
        self.layers = nn.ModuleDict({
            "stem": nn.Conv2d(channels, width, 3, padding=1),
            "body": nn.Sequential(nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten()),
            "head": nn.Linear(width, num_classes),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        x = self.layers["stem"](x) + self.pos_bias
        return self.layers["head"](self.layers["body"](x))


# ---------------------------------------------------------------------------------------------
# token models


class TiedTokenLM(nn.Module):
    """The transformers library's GPT-2 LM head: causal SDPA block, head tied to the embedding."""

    objective = "next_token"

    def __init__(self, vocab_size: int, input_shape: tuple[int, ...] | None = None,
                 dim: int = 16, heads: int = 2, max_len: int = 64) -> None:
        super().__init__()
        if input_shape is not None:
            max_len = max(max_len, input_shape[0])
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        nn.init.normal_(self.pos, std=0.02)
        self.block = Block(dim, heads, mlp_ratio=4, attention=SdpaAttention, causal=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.pos.shape[0]:
            raise ValueError(f"sequence of {seq_len} tokens, longer than max_len "
                             f"{self.pos.shape[0]}")
        x = self.embed(tokens) + self.pos[:seq_len]
        return self.head(self.norm(self.block(x)))


class TokenClassifier(nn.Module):
    """The transformers library's sequence classification head over mean-pooled embeddings,
    its layers registered head first (nothing in its modules says it reads token ids: the
    dataset does)."""

    def __init__(self, vocab_size: int, num_classes: int, dim: int = 16,
                 hidden: int = 32) -> None:
        super().__init__()
        self.fc2 = nn.Linear(hidden, num_classes)
        self.fc1 = nn.Linear(dim, hidden)
        self.relu = nn.ReLU()
        self.embed = nn.Embedding(vocab_size, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(self.embed(tokens).mean(dim=1))))


# ---------------------------------------------------------------------------------------------
# the lists the suite iterates over

IMAGE_MODELS: tuple[str, ...] = (
    "DepthwiseSeparable",
    "GroupedConv",
    "SqueezeExcite",
    "BNActNet",
    "ScaledBNNet",
    "SyncBNNet",
    "ConvNeXtBlock",
    "PoolingVariants",
    "StochasticDepth",
    "ViTTiny",
    "ViTSdpa",
    "ShapeControlFlow",
    "KeywordOutputs",
    "DataclassOutput",
    "TupleOutput",
    "BuffersAndModuleDict",
)
TOKEN_MODELS: tuple[str, ...] = ("TiedTokenLM", "TokenClassifier")
LANGUAGE_MODELS: tuple[str, ...] = tuple(
    name for name in TOKEN_MODELS if getattr(globals()[name], "objective", None) == "next_token"
)

PATTERNS: dict[str, str] = {
    "DepthwiseSeparable": "depthwise + pointwise conv, ReLU6 (MobileNet)",
    "GroupedConv": "grouped conv residual block, GroupNorm (ResNeXt)",
    "SqueezeExcite": "squeeze-and-excitation gate (SE-ResNet, EfficientNet)",
    "BNActNet": "BatchNorm2d subclass calling F.batch_norm (timm BatchNormAct2d)",
    "ScaledBNNet": "user BatchNorm2d subclass calling super().forward",
    "SyncBNNet": "nn.SyncBatchNorm.convert_sync_batchnorm",
    "ConvNeXtBlock": "dw 7x7, channels-last LayerNorm, layer scale (ConvNeXt)",
    "PoolingVariants": "ceil_mode max/avg pooling, adaptive max pooling",
    "StochasticDepth": "DropPath on residual branches, Dropout head",
    "ViTTiny": "ViT with hand-written attention (timm)",
    "ViTSdpa": "ViT with F.scaled_dot_product_attention",
    "ShapeControlFlow": "branches on tensor shapes in forward",
    "KeywordOutputs": "keyword forward, dict output (transformers)",
    "DataclassOutput": "dataclass output (transformers ModelOutput)",
    "TupleOutput": "(logits, aux) tuple output (Inception)",
    "BuffersAndModuleDict": "normalizing buffers, fixed bias buffer, nn.ModuleDict",
    "TiedTokenLM": "causal LM with tied input/output embedding (GPT-2)",
    "TokenClassifier": "embedding mean-pool classifier",
}


class MetaUnfriendly(nn.Module):
    """A constructor that reads its own weights (`.item()`), which the meta device cannot run:
    gridrun builds it for real instead of refusing it."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)
        with torch.no_grad():
            self.head.weight.mul_(1.0 / max(1.0, float(self.head.weight.abs().max().item())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))


def hf_gpt2(vocab_size: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's GPT-2 (a language model, its dropout on), built from a tiny
    config: no weights are downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=max(16, input_shape[0]), n_embd=16,
                        n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


hf_gpt2.objective = "next_token"  # type: ignore[attr-defined]


def hf_bert(vocab_size: int, num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """The transformers library's BERT for sequence classification, from a tiny config."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=max(16, input_shape[0]), num_labels=num_classes)
    return BertForSequenceClassification(config)


IMAGE_MODELS += ("MetaUnfriendly",)
PATTERNS["MetaUnfriendly"] = "constructor that reads its weights (no meta-device build)"
# Models of the transformers library, built from configs (the `transformers` test extra).
TRANSFORMERS_MODELS: tuple[str, ...] = ("hf_gpt2", "hf_bert")
PATTERNS["hf_gpt2"] = "transformers GPT2LMHeadModel: `.logits`, SDPA attention dropout"
PATTERNS["hf_bert"] = "transformers BertForSequenceClassification: keyword forward, dropout"
LANGUAGE_MODELS += ("hf_gpt2",)

# The grids every model is tried on (the MPI check trains the accepted ones on 4 ranks).
CASES: tuple[tuple[str, int, int], ...] = (("data", 1, 4), ("model", 2, 1), ("grid", 2, 2),
                                           ("domain", 2, 1), ("auto", 1, 2))


def run_config(model: str, strategy: str, pr: int, pc: int, steps: int = 3) -> dict[str, Any]:
    """A run of corpus model `model` (a name in this module) as a plain config: float64, a
    batch of 8, synthetic 3×8×8 images in 4 classes or 50-token documents of 8 tokens."""
    tokens = model in TOKEN_MODELS or model in TRANSFORMERS_MODELS
    dataset = ({"name": "tokens", "vocab_size": 50, "seq_len": 8, "classes": 4, "samples": 64}
               if tokens else {"name": "synthetic", "shape": [3, 8, 8], "classes": 4,
                               "samples": 64})
    return {"seed": 1, "grid": {"pr": pr, "pc": pc},
            "trainer": {"steps": steps, "batch_size": 8, "dtype": "float64", "log_every": 1,
                        "eval_every": 1000, "checkpoint_every": None, "resume": None,
                        "threads": None},
            "model": {"_target_": f"tests.corpus_models.{model}"}, "dataset": dataset,
            "strategy": {"name": strategy}, "optimizer": {"name": "sgd", "lr": 0.1},
            "launcher": {"command": None, "args": []}, "debug": {"fail_at_step": None}}


class TorchEncoder(nn.Module):
    """torch's own `nn.TransformerEncoderLayer` (batch first, dropout 0.1): its attention
    dropout is drawn inside `F.multi_head_attention_forward`, over batch × heads."""

    objective = "next_token"

    def __init__(self, vocab_size: int, width: int = 16, heads: int = 2,
                 batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab_size, width)
        self.layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.1,
                                                batch_first=batch_first)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=h.dtype)
        if self.batch_first:
            return self.head(self.layer(h, src_mask=causal, is_causal=True))
        out = self.layer(h.transpose(0, 1), src_mask=causal, is_causal=True)
        return self.head(out.transpose(0, 1))


class SeqFirstEncoder(TorchEncoder):
    """The same layer sequence-first (`batch_first=False`, torch's default): its dropout masks
    are drawn over (positions, batch, features), the batch in dim 1."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size, batch_first=False)


TOKEN_MODELS += ("TorchEncoder", "SeqFirstEncoder")
LANGUAGE_MODELS += ("TorchEncoder", "SeqFirstEncoder")
PATTERNS["TorchEncoder"] = "nn.TransformerEncoderLayer, batch first, dropout in attention"
PATTERNS["SeqFirstEncoder"] = "nn.TransformerEncoderLayer sequence-first (batch in dim 1)"
# What strategy=data refuses (by name): one process's draws cannot be cut into rows there.
REFUSED_BY_DATA: tuple[str, ...] = ("SeqFirstEncoder",)
