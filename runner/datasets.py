"""Datasets: real (scikit-learn's bundled 8×8 digits) and synthetic (seeded, sized by config).

Every rank loads the same tensors; a strategy picks its samples of each global batch. Nothing is
downloaded: digits ships inside scikit-learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.registry import register_dataset

_SPLIT_SEED = 0  # the train/val split is fixed, whatever the run's seed


@dataclass(frozen=True)
class DatasetSpec:
    input_shape: tuple[int, ...]
    num_classes: int
    train_size: int
    val_size: int


@dataclass
class ClassificationData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def _split(x: torch.Tensor, y: torch.Tensor, val_size: int) -> ClassificationData:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    val, train = order[:val_size], order[val_size:]
    return ClassificationData(x[train], y[train], x[val], y[val])


def _val_size(samples: int, val_fraction: float) -> int:
    return round(samples * val_fraction)


@register_dataset("digits")
class Digits:
    """scikit-learn's 1797 handwritten 8×8 digits, scaled to [0, 1], shaped (1, 8, 8)."""

    samples = 1797

    def __init__(self, val_fraction: float = 0.2) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = val_fraction

    def spec(self) -> DatasetSpec:
        val = _val_size(self.samples, self.val_fraction)
        return DatasetSpec((1, 8, 8), 10, self.samples - val, val)

    def load(self) -> ClassificationData:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        return _split(x, y, self.spec().val_size)


@register_dataset("synthetic")
class Synthetic:
    """Seeded classification data with learnable structure.

    Each class has a prototype; a sample is its class prototype plus Gaussian noise. For image
    shapes (C, H, W) prototypes are smooth patterns (upsampled coarse noise), so convolutions
    have spatial structure to find; for flat shapes they are random directions.
    """

    def __init__(self, shape: Sequence[int] = (64,), classes: int = 10, samples: int = 4096,
                 noise: float = 1.0, val_fraction: float = 0.2, seed: int = 0) -> None:
        self.shape = tuple(int(d) for d in shape)
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError(f"dataset.shape must be positive sizes, got {list(shape)}")
        if classes < 2 or samples < classes:
            raise ValueError("dataset.classes must be >= 2 and dataset.samples >= classes")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        self.classes, self.samples, self.noise = classes, samples, noise
        self.val_fraction, self.seed = val_fraction, seed

    def spec(self) -> DatasetSpec:
        val = _val_size(self.samples, self.val_fraction)
        return DatasetSpec(self.shape, self.classes, self.samples - val, val)

    def load(self) -> ClassificationData:
        gen = torch.Generator().manual_seed(self.seed)
        if len(self.shape) == 3:
            c, h, w = self.shape
            coarse = torch.randn(self.classes, c, max(1, h // 4), max(1, w // 4), generator=gen)
            prototypes = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
        else:
            prototypes = torch.randn(self.classes, *self.shape, generator=gen)
        # Normalise prototypes so `noise` is a signal-to-noise knob independent of the shape.
        flat = prototypes.reshape(self.classes, -1)
        prototypes = (flat / flat.std(dim=1, keepdim=True)).reshape(prototypes.shape)
        y = torch.randint(0, self.classes, (self.samples,), generator=gen)
        x = prototypes[y] + self.noise * torch.randn(self.samples, *self.shape, generator=gen)
        return _split(x, y, self.spec().val_size)
