"""`strategy=data`: the model replicated on every rank, the global batch split over all P.

Gradients are averaged by bucketed all-reduces started from gradient hooks while backward still
runs (see `buckets.py`). Needs `Pr = 1`: every rank is a batch replica.
"""

from __future__ import annotations

import torch
from torch import nn

from runner.core import GridShape, Partition, ProcessGrid
from runner.core.cost import CommOp
from strategies.base import ParallelModel, Strategy, gradient_exchange
from strategies.buckets import predict_gradient_ops
from strategies.registry import register_strategy
from strategies.sharded import activation_itemsize, feature_sizes


class DataParallelModel(ParallelModel):
    def __init__(self, module: nn.Module, grid: ProcessGrid) -> None:
        super().__init__(grid)
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@register_strategy("data")
class DataParallel(Strategy):
    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if grid.pr != 1:
            return [f"strategy=data replicates the whole model and needs grid.pr=1, "
                    f"got grid.pr={grid.pr} (use strategy=grid to split the model)"]
        if global_batch < grid.size:
            return [f"trainer.batch_size={global_batch} is smaller than the {grid.size} ranks: "
                    f"pure batch parallelism needs a sample per rank (strategy=domain also "
                    f"splits each sample)"]
        return super().check(grid, global_batch)

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        pmodel = DataParallelModel(model, grid)
        if sync_replica_gradients:
            pmodel.reducers = gradient_exchange(list(model.parameters()), grid.world,
                                                1.0 / grid.size, self.bucket_cap_bytes,
                                                self.first_bucket_bytes)
        return pmodel

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        params = [(name.split(".")[0], [(p.numel() * p.element_size(), p.dtype)])
                  for name, p in model.named_parameters() if p.requires_grad]
        return predict_gradient_ops(params, "world", grid.size, *self.bucket_caps)

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        layers = list(model.children()) or [model]
        rows = Partition(global_batch, grid.size).sizes[0]
        return rows * sum(feature_sizes(layers, sample_shape)) * activation_itemsize(layers)
