"""Which samples make each global batch: the same on every rank and for every grid."""

from __future__ import annotations

from typing import Any

import torch


class EpochSampler:
    """Global batches from a seeded permutation per epoch: identical on every rank and for every
    grid, so a run's sample order does not depend on P. Drops the incomplete last batch."""

    def __init__(self, num_samples: int, batch_size: int, seed: int) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position = 0, 0
        self._order = torch.randperm(num_samples, generator=self.generator)

    def state(self) -> dict[str, Any]:
        """Where the sample order stands: the epoch's permutation, the position in it, and
        the generator that draws the next one (restored exactly on resume)."""
        return {"epoch": self.epoch, "position": self.position,
                "generator": self.generator.get_state(), "order": self._order.clone()}

    def load_state(self, state: dict[str, Any]) -> None:
        if len(state["order"]) != self.num_samples:
            raise ValueError(f"the checkpoint's sample order covers {len(state['order'])} "
                             f"samples, this dataset has {self.num_samples}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.generator.set_state(state["generator"])
        self._order = state["order"].clone()

    def next_batch(self) -> torch.Tensor:
        if self.position + self.batch_size > self.num_samples:
            self.epoch += 1
            self.position = 0
            self._order = torch.randperm(self.num_samples, generator=self.generator)
        batch = self._order[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return batch
