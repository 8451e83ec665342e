"""`strategy=model`: pure model parallelism (`Pc = 1`), every layer split over all P ranks.

Fully-connected layers are split by rows of W, convolutions by output channel (`layers/split.py`);
every rank sees the whole batch. This is the grid strategy with one model group and no
batch-parallel layers; a GPT is split Megatron-style over all P ranks (`tensor_parallel.py`,
`strategy.tp_layout`).
"""

from __future__ import annotations

from torch import nn

from runner.core import GridShape
from strategies.grid import GridParallel
from strategies.layers.tree import Mode
from strategies.registry import register_strategy


@register_strategy("model")
class ModelParallel(GridParallel):
    tree_mode: Mode = "model"
    def split(self, model: nn.Sequential) -> int:
        return 0  # every layer split, none batch-parallel

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if grid.pc != 1:
            return [f"strategy=model splits every layer over all ranks and needs grid.pc=1, got "
                    f"grid.pc={grid.pc} (use strategy=grid to also split the batch)"]
        return super().check(grid, global_batch)
