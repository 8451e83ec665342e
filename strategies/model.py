"""`strategy=model`: pure model parallelism (`Pc = 1`), every layer split over all P ranks.

Fully-connected layers are split by rows of W, convolutions by output channel (`sharded.py`);
every rank sees the whole batch. This is the grid strategy with one model group and no
batch-parallel prefix.
"""

from __future__ import annotations

from torch import nn

from runner.core import GridShape, ProcessGrid
from runner.core.cost import CommOp
from strategies.base import ParallelModel, Strategy
from strategies.grid import build_grid_model, predict_grid_ops, sequential_problems
from strategies.registry import register_strategy
from strategies.sharded import split_param_bytes


@register_strategy("model")
class ModelParallel(Strategy):
    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if grid.pc != 1:
            return [f"strategy=model splits every layer over all ranks and needs grid.pc=1, got "
                    f"grid.pc={grid.pc} (use strategy=grid to also split the batch)"]
        return super().check(grid, global_batch)

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        return sequential_problems(model, self.name)

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        assert isinstance(model, nn.Sequential)
        return build_grid_model(model, grid, 0, sync_replica_gradients, self.bucket_cap_bytes,
                                self.first_bucket_bytes)

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        assert isinstance(model, nn.Sequential)
        return predict_grid_ops(model, 0, sample_shape, grid, global_batch, self.bucket_caps)

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        assert isinstance(model, nn.Sequential)
        return split_param_bytes(list(model), 0, grid.pr)
