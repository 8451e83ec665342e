"""Vision transformers split by a parallel plan by module name (`strategies.plans.module_plan`): the
transformers library's `ViTForImageClassification` from a tiny config, and a timm-style ViT
whose attention is one fused `qkv` Linear. Tiny, dropout 0 (under model splitting each rank
would draw its own masks), images of `CHANNELS` x `IMAGE` x `IMAGE`.

The library's ViT (version 5) keeps its layers as `vit.layers`, names its attention's
projections `q_proj`, `k_proj`, `v_proj` and `o_proj` and its MLP's `fc1` and `fc2`; its
attention reshapes by its `head_dim` and -1, and the plan divides its `num_attention_heads`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, IMAGE, PATCH = 3, 8, 4

# Attention's query, key and value column-split (whole heads per rank), its output row-split;
# the MLP's first Linear column-split, its second row-split.
HF_VIT_PLAN = {"vit.layers.*.attention.q_proj": "colwise",
               "vit.layers.*.attention.k_proj": "colwise",
               "vit.layers.*.attention.v_proj": "colwise",
               "vit.layers.*.attention.o_proj": "rowwise",
               "vit.layers.*.mlp.fc1": "colwise",
               "vit.layers.*.mlp.fc2": "rowwise"}
# The fused projection split by heads within each of q, k and v; the class head column-split
# (the model's output: gathered).
TIMM_VIT_PLAN = {"blocks.*.attn.qkv": "fused_qkv", "blocks.*.attn.proj": "rowwise",
                 "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise",
                 "head": "colwise"}


def hf_vit(num_classes: int, input_shape: tuple[int, ...] = (CHANNELS, IMAGE, IMAGE)
           ) -> nn.Module:
    """The transformers library's ViT for image classification: 4 heads of 4 features, 2
    layers, patches of `PATCH` pixels; attention by PyTorch's scaled dot product (the eager
    one computes its softmax in float32 whatever the model's dtype)."""
    from transformers import ViTConfig, ViTForImageClassification

    channels, height, _ = input_shape
    config = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=32, image_size=height, patch_size=PATCH,
                       num_channels=channels, num_labels=num_classes, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return ViTForImageClassification(config)


class FusedAttention(nn.Module):
    """timm's attention: one Linear makes q, k and v, split into heads by reshaping."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    """timm's MLP: two Linears, GELU between."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm attention and MLP, each a residual."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, num_heads)
        self.mlp = Mlp(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TimmStyleViT(nn.Module):
    """A timm-style vision transformer: patches embedded by a strided convolution, a class
    token, learned positions, `Block`s, and a Linear head on the class token (its plan:
    `TIMM_VIT_PLAN`)."""

    def __init__(self, num_classes: int,
                 input_shape: tuple[int, ...] = (CHANNELS, IMAGE, IMAGE), dim: int = 16,
                 num_heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=PATCH, stride=PATCH)
        patches = (height // PATCH) * (width // PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])
