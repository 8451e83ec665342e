"""What every strategy provides: a config check and the `parallelize` transformation."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from runner.core import CountedComm, GridShape, ProcessGrid, balanced_slice


class ParallelModel(nn.Module):
    """A model whose forward runs on this rank's part of the global batch.

    `batch_comm` is the group of ranks that hold different samples of the batch: the global mean
    loss is the mean of their local mean losses (all shards are equal, see `Strategy.check`).
    """

    def __init__(self, module: nn.Module, grid: ProcessGrid) -> None:
        super().__init__()
        self.module = module
        self.grid = grid

    @property
    def batch_comm(self) -> CountedComm:
        return self.grid.batch

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module(inputs)

    def local_rows(self, global_rows: int) -> slice:
        """This rank's rows of a global batch (or evaluation set) of `global_rows` samples."""
        return balanced_slice(global_rows, self.grid.pc, self.grid.batch_index)

    def zero_grad(self, set_to_none: bool = False) -> None:
        # Gradients may be views into communication buckets: zero them, never drop them.
        for p in self.parameters():
            if p.grad is not None:
                p.grad.zero_()

    def finish_gradient_sync(self) -> None:
        """Complete every gradient exchange started during backward."""

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


class Strategy:
    """A registered parallel strategy. Options come from the `strategy` config group."""

    name: ClassVar[str] = ""

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        """Every reason this strategy cannot run `global_batch` samples on `grid` (empty: fine)."""
        if global_batch < grid.pc:
            return [f"trainer.batch_size={global_batch} is smaller than the {grid.pc} ranks that "
                    f"split the batch (grid.pc): each needs at least one sample"]
        if global_batch % grid.pc:
            return [f"trainer.batch_size={global_batch} is not divisible by the {grid.pc} ranks "
                    f"that split the batch (grid.pc)"]
        return []

    def parallelize(self, model: nn.Module, grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        """Turn the sequential `model` (same seed on every rank) into this rank's part.

        `sync_replica_gradients=False` leaves the batch replicas' gradients unsynchronised, for
        replica optimizers (the EASGD family) that let replicas agree by other means.
        """
        raise NotImplementedError

    def predicted_comm_bytes_per_step(self, model: nn.Module, grid: GridShape,
                                      global_batch: int) -> int:
        """Payload bytes rank 0 hands to collectives in one training step."""
        raise NotImplementedError
