"""`strategy=data`: the model replicated on every rank, the global batch split over all P.

Gradients are averaged by bucketed all-reduces started from gradient hooks while backward still
runs (see `buckets.py`). Needs `Pr = 1`: every rank is a batch replica. Embedding tables with
sparse gradients are exchanged as `strategy.sparse` says (`sparse_exchange.py`); with
`sparse=dense` they join the buckets like any other parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runner.core import GridShape, Partition, ProcessGrid
from runner.core.compute import DEFAULT_RATES, ComputeRates
from runner.core.cost import (
    DEFAULT_COSTS,
    CommOp,
    MachineCosts,
    SparseMode,
    choose_sparse_mode,
    sparse_exchange_ops,
)
from strategies.base import ParallelModel, Strategy, gradient_exchange
from strategies.buckets import predict_gradient_ops
from strategies.norm import batch_norm_ops, batch_norm_problems, distribute_batch_norms
from strategies.registry import register_strategy
from strategies.sharded import activation_itemsize, feature_sizes
from strategies.sparse_exchange import (
    SPARSE_CHOICES,
    EmbeddingTable,
    SparseChoice,
    SparseGradientExchange,
    sparse_tables,
)
from strategies.transformer import GPT, activation_elements


class DataParallelModel(ParallelModel):
    def __init__(self, module: nn.Module, grid: ProcessGrid) -> None:
        super().__init__(grid)
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.module(x)
        return y


BATCH_NORM_MODES = ("global", "local")


@register_strategy("data")
class DataParallel(Strategy):
    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 sparse: SparseChoice = "auto", batch_norm: str = "global", *,
                 costs: MachineCosts = DEFAULT_COSTS,
                 rows_touched: Callable[[int], float] | None = None,
                 compute_dtype: torch.dtype | None = None,
                 rates: ComputeRates = DEFAULT_RATES, global_batch: int | None = None,
                 slowdown: float = 1.0) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, costs=costs, rows_touched=rows_touched,
                         compute_dtype=compute_dtype, rates=rates, global_batch=global_batch,
                         slowdown=slowdown)
        self.sparse = sparse
        # global: BatchNorm statistics of every rank's rows (one process's model); local: each
        # rank's own rows, as DDP without SyncBatchNorm (another model: not one process's
        # losses, no statistics exchanged).
        self.batch_norm = batch_norm

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if self.sparse not in SPARSE_CHOICES:
            return [f"strategy.sparse={self.sparse}: must be one of {', '.join(SPARSE_CHOICES)}"]
        if self.batch_norm not in BATCH_NORM_MODES:
            return [f"strategy.batch_norm={self.batch_norm}: must be one of "
                    f"{', '.join(BATCH_NORM_MODES)}"]
        if grid.pr != 1:
            return [f"strategy=data replicates the whole model and needs grid.pr=1, "
                    f"got grid.pr={grid.pr} (use strategy=grid to split the model)"]
        if global_batch < grid.size:
            return [f"trainer.batch_size={global_batch} is smaller than the {grid.size} ranks: "
                    f"pure batch parallelism needs a sample per rank (strategy=domain also "
                    f"splits each sample)"]
        return super().check(grid, global_batch)

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        if grid.size == 1:
            return []
        return [f"strategy=data cannot split {p}" for p in batch_norm_problems(model)]

    def _split(self, model: nn.Module) -> tuple[list[tuple[str, EmbeddingTable]],
                                               list[nn.Parameter]]:
        """The embedding tables exchanged sparsely, and the parameters the buckets carry."""
        tables = sparse_tables(model) if self.sparse != "dense" else []
        sparse = {id(module.weight) for _, module in tables}
        return tables, [p for p in model.parameters() if id(p) not in sparse]

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        # BatchNorm: every rank's statistics (an EASGD replica, or batch_norm=local: its own)
        if sync_replica_gradients and grid.size > 1 and self.batch_norm == "global":
            distribute_batch_norms(model, grid.world)
        pmodel = DataParallelModel(model, grid)
        if sync_replica_gradients:
            tables, dense = self._split(model)
            pmodel.reducers = gradient_exchange(dense, grid.world, 1.0 / grid.size,
                                                self.bucket_cap_bytes, self.first_bucket_bytes)
            if tables and grid.size > 1:
                pmodel.reducers.append(SparseGradientExchange(
                    tables, grid.world, 1.0 / grid.size, self.sparse, self.costs))
        return pmodel

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        tables, dense = self._split(model)
        exchanged = {id(p) for p in dense}
        params = [(name.split(".")[0], [(p.numel() * p.element_size(), p.dtype)])
                  for name, p in model.named_parameters()
                  if p.requires_grad and id(p) in exchanged]
        ops = predict_gradient_ops(params, "world", grid.size, *self.bucket_caps)
        if self.batch_norm == "global":
            ops += batch_norm_ops(model, "world", grid.size, activation_itemsize([model]))
        for name, module in tables:
            ops += self.predict_sparse_ops(name, module.weight, grid.size,
                                           global_batch // grid.size)
        return ops

    def predict_sparse_ops(self, name: str, weight: torch.Tensor, p: int,
                           samples_per_rank: int) -> list[CommOp]:
        """The exchange of one table, its rows per rank expected from the data (`rows_touched`;
        without it every row is assumed touched). `auto` predicts the mode the cost model
        (communication and local work) would choose for that many rows."""
        num_rows, row_bytes = weight.shape[0], weight[0].numel() * weight.element_size()
        rows = (num_rows if self.rows_touched is None
                else min(num_rows, self.rows_touched(samples_per_rank)))
        mode: SparseMode = (choose_sparse_mode(p, num_rows, row_bytes, [rows] * p, self.costs)
                            if self.sparse == "auto" else self.sparse)
        return sparse_exchange_ops(mode, "world", p, num_rows, row_bytes, rows, rows * p,
                                   label=name, counts_first=self.sparse == "auto")

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if isinstance(model, GPT):  # attention's products and passes, as tensor parallelism's
            from strategies.tensor_parallel import tp_compute_seconds

            return tp_compute_seconds(model, sample_shape, grid, global_batch, "pairing",
                                      self.rates)
        return super().predict_compute_seconds(model, sample_shape, grid, global_batch)

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if isinstance(model, GPT):
            rows = Partition(global_batch, grid.size).sizes[0]
            return (activation_elements(model, rows, sample_shape[0])
                    * activation_itemsize([model], self.compute_dtype))
        if not isinstance(model, nn.Sequential):  # every node's output, as the tree plan counts
            from strategies.tree import TreeRefused, tree_activation_bytes

            try:
                return tree_activation_bytes(model, sample_shape, grid, global_batch, "model",
                                             activation_itemsize([model], self.compute_dtype))
            except TreeRefused:
                pass  # a module no rule covers: the children's outputs below
        layers = list(model.children()) or [model]
        rows = Partition(global_batch, grid.size).sizes[0]
        return (rows * sum(feature_sizes(layers, sample_shape))
                * activation_itemsize(layers, self.compute_dtype))
