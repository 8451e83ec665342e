"""Datasets of the user's own, named by `dataset._target_=...`: a function returning the
training and validation sets, each a pair of tensors or a map-style `torch.utils.data.Dataset`."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset


def blobs(samples: int = 512, features: int = 16, classes: int = 3,
          seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                  tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian blobs around seeded centres, as tensors: ((train_x, train_y), (val_x, val_y))."""
    gen = torch.Generator().manual_seed(seed)
    centres = 2 * torch.randn(classes, features, generator=gen)
    y = torch.randint(0, classes, (samples,), generator=gen)
    x = centres[y] + torch.randn(samples, features, generator=gen)
    cut = samples * 3 // 4
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


class Rows(Dataset[tuple[torch.Tensor, int]]):
    """A map-style dataset (rows on demand). `num_classes` tells gridrun the classes without
    reading every row; `log_dir`, if given, records which process read which row."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int, split: str,
                 log_dir: str | None) -> None:
        self.x, self.y, self.num_classes = x, y, num_classes
        self.split, self.log_dir = split, log_dir

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.log_dir:
            reader = os.environ.get("PMI_RANK", f"pid{os.getpid()}")
            with open(os.path.join(self.log_dir, f"{reader}.log"), "a") as log:
                log.write(f"{self.split} {index}\n")
        return self.x[index], int(self.y[index])


def rows(samples: int = 512, features: int = 16, classes: int = 3,
         log_dir: str | None = None) -> dict[str, Rows]:
    """The blobs as map-style datasets: {'train': ..., 'val': ...}."""
    (train_x, train_y), (val_x, val_y) = blobs(samples, features, classes)
    return {"train": Rows(train_x, train_y, classes, "train", log_dir),
            "val": Rows(val_x, val_y, classes, "val", log_dir)}
