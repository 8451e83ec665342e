"""`strategy=data`: the model replicated on every rank, the global batch split over all P.

Gradients are averaged by bucketed all-reduces started from gradient hooks while backward still
runs (see `exchange/buckets.py`). Needs `Pr = 1`: every rank is a batch replica. Embedding
tables with sparse gradients are exchanged as `strategy.sparse` says
(`exchange/sparse_gradients.py`); with `sparse=dense` they join the buckets like any other
parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.core.row_sparse import NodeRoutes
from runner.cost.collectives import (
    CommOp,
    RowOwners,
    SparseMode,
    TableRows,
    choose_partitions,
    choose_sparse_mode,
    node_push_seconds,
    sharded_rows_per_rank,
    sparse_exchange_ops,
)
from strategies.base import (
    DEFAULT_PRICING,
    ParallelModel,
    PricingContext,
    Strategy,
    gradient_exchange,
)
from strategies.exchange.buckets import predict_gradient_ops
from strategies.exchange.sparse_gradients import (
    PER_STEP_MODES,
    SPARSE_CHOICES,
    EmbeddingTable,
    SparseChoice,
    SparseGradientExchange,
    sparse_tables,
)
from strategies.layers.norm import (
    batch_norm_ops,
    batch_norm_problems,
    distribute_batch_norms,
    is_plain_batch_norm,
)
from strategies.layers.split import activation_itemsize
from strategies.layers.whole_batch import BatchStatistics, RowDraws, forward_key
from strategies.probe import DrawPlan, draw_plan, logits_of, probe, training_calls
from strategies.registry import register_strategy
from strategies.transformer.gpt import GPT, activation_elements
from strategies.transformer.tensor_parallel import tp_compute_seconds


class DataParallelModel(ParallelModel):
    """The whole model on every rank. A training forward computes what couples rows as one
    process does (`whole_batch`): with `stats_comm`, `F.batch_norm` calls that no
    `DistributedBatchNorm` took over (a subclass's own forward, functional calls) normalize
    by every rank's statistics; with a plan of its `draws`, random operators over the batch's
    rows draw row by row (the same masks at every P)."""

    def __init__(self, module: nn.Module, grid: ProcessGrid,
                 stats_comm: CountedComm | None = None, draws: DrawPlan | None = None) -> None:
        super().__init__(grid)
        self.module = module
        self.stats_comm, self.draws = stats_comm, draws
        self._statistics: BatchStatistics | None = None
        self._draws: RowDraws | None = None  # the training forward's, while it runs
        self._key = 0  # the step's key of its draws (its micro-batches share it)
        if stats_comm is not None:  # name what each batch norm moves
            for name, child in module.named_modules():
                if isinstance(child, nn.modules.batchnorm._BatchNorm):
                    child.register_forward_pre_hook(self._labeller(f"bn:{name}"))

    def _labeller(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            if self._statistics is not None:
                self._statistics.label = label
        return hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return logits_of(self.module(x))
        with contextlib.ExitStack() as modes:
            if self.stats_comm is not None:
                self._statistics = modes.enter_context(BatchStatistics(self.stats_comm))
                modes.callback(setattr, self, "_statistics", None)
            if self.draws is not None:
                # a micro-batch draws its rows of the whole step's draws: one key per step, the
                # rows by their place in the global batch
                micro = self.micro
                if micro is None or micro.index == 0:
                    self._key = forward_key()
                start = (self.input_rows(x.shape[0] * self.grid.pc).start if micro is None
                         else micro.inputs.start)
                self._draws = modes.enter_context(
                    RowDraws(self.draws, self._key, start, x.shape[0]))
                modes.callback(setattr, self, "_draws", None)
            return logits_of(self.module(x))

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager[None],
                                          contextlib.AbstractContextManager[Any]]:
        """A recomputation draws the rows of the draws its forward made (the same key, rows
        and draw indices), inside `RowDraws` again: backward runs outside the forward's."""
        draws = self._draws
        if draws is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), draws.again()


def replica_model(model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                  batch_norm: str, sync_replica_gradients: bool = True,
                  model_class: type[DataParallelModel] = DataParallelModel) -> DataParallelModel:
    """The whole `model` as a batch replica on this rank, its rows coupled as one process
    couples them (BatchNorm statistics, random draws: see `DataParallel.parallelize`); no
    gradient exchange yet."""
    calls = training_calls(model, sample_shape) if sync_replica_gradients else None
    plan = draw_plan(model, sample_shape) if calls is not None and calls.draws else None
    global_norm = batch_norm == "global"
    if sync_replica_gradients and global_norm:
        distribute_batch_norms(model, grid.world)
    functional = calls is not None and global_norm and grid.size > 1 and any(
        not is_plain_batch_norm(model.get_submodule(name)) for name in calls.batch_norms)
    return model_class(model, grid, grid.world if functional else None, plan)


BATCH_NORM_MODES = ("global", "local")
# Hot rows per owners-only table. Blocks of frequency-ranked ids put the head of the vocabulary
# on owner 0; replicating the 256 most widely read rows takes it away (measured on
# `dataset=tokens`, 4 ranks: rank 0 moved 39% more than the balanced prediction with none,
# within 3% with 256), and their all-reduce stays small (256 rows). The cost model may take
# fewer.
DEFAULT_HOT_ROWS = 256


@register_strategy("data")
class DataParallel(Strategy):
    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 sparse: SparseChoice = "auto", batch_norm: str = "global",
                 sparse_hot_rows: int = DEFAULT_HOT_ROWS, sparse_partitions: int | str = "auto",
                 ranks_per_node: int | str = "auto", *,
                 pricing: PricingContext = DEFAULT_PRICING) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, pricing=pricing)
        self.sparse = sparse
        # the most rows of a table replicated on every rank under the owners-only exchange
        self.sparse_hot_rows = sparse_hot_rows
        # how many ranks own a table's rows: `auto` (the cost model) or a number ≤ P
        self.sparse_partitions = sparse_partitions
        # which ranks share a node, for the owners-only push's sums inside a node: `auto` (MPI's
        # shared-memory groups) or a number (ranks r // n share a node: a test on one machine)
        self.ranks_per_node = ranks_per_node
        # global: BatchNorm statistics of every rank's rows (one process's model); local: each
        # rank's own rows, as DDP without SyncBatchNorm (another model: not one process's
        # losses, no statistics exchanged).
        self.batch_norm = batch_norm

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if self.sparse not in SPARSE_CHOICES:
            return [f"strategy.sparse={self.sparse}: must be one of {', '.join(SPARSE_CHOICES)}"]
        if (not isinstance(self.sparse_hot_rows, int) or isinstance(self.sparse_hot_rows, bool)
                or self.sparse_hot_rows < 0):
            return [f"strategy.sparse_hot_rows={self.sparse_hot_rows}: must be a whole number "
                    f"of rows, 0 or more (0: no replicated hot rows)"]
        parts = self.sparse_partitions
        if parts != "auto" and (not isinstance(parts, int) or isinstance(parts, bool)
                                or not 1 <= parts <= grid.size):
            return [f"strategy.sparse_partitions={parts}: must be auto or a number of owner "
                    f"ranks from 1 to the {grid.size} ranks"]
        per_node = self.ranks_per_node
        if per_node != "auto" and (not isinstance(per_node, int) or isinstance(per_node, bool)
                                   or not 1 <= per_node <= grid.size):
            return [f"strategy.ranks_per_node={per_node}: must be auto or a number of ranks "
                    f"from 1 to the {grid.size} ranks"]
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
        problems = [f"strategy=data cannot split {p}" for p in batch_norm_problems(model)]
        if training_calls(model, sample_shape).draws:
            problems += [f"strategy=data cannot draw one process's random numbers in {what}; "
                         f"set its rate to 0 (or train on one rank)"
                         for what in draw_plan(model, sample_shape).problems]
        if self.sparse == "sharded":  # tables that live on their owners only
            problems += [f"strategy.sparse=sharded: table {name or 'model'} has max_norm, "
                         f"which renormalises the rows it reads in place; the owners-only "
                         f"exchange cannot (use strategy.sparse=allgather or dense)"
                         for name, module in sparse_tables(model) if module.max_norm is not None]
        return problems

    def reproduces_random_draws(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape) -> bool:
        return True  # every row's masks drawn alike at every P (`whole_batch.RowDraws`)

    def draws_rows_alike(self, model: nn.Module, sample_shape: tuple[int, ...],
                         grid: GridShape) -> bool:
        # a draw of a fixed shape comes from the run's generator, once per forward
        return None not in draw_plan(model, sample_shape).cuts

    def _split(self, model: nn.Module) -> tuple[list[tuple[str, EmbeddingTable]],
                                               list[nn.Parameter]]:
        """The embedding tables exchanged sparsely, and the parameters the buckets carry."""
        tables = sparse_tables(model) if self.sparse != "dense" else []
        sparse = {id(module.weight) for _, module in tables}
        return tables, [p for p in model.parameters() if id(p) not in sparse]

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        # BatchNorm: every rank's statistics (an EASGD replica, or batch_norm=local: its own).
        # One process too: its BatchNorms then normalize half-precision activations in
        # float32 as every rank's do at P > 1 (torch's CPU kernel on bfloat16 computes
        # otherwise), so one process is what P ranks reproduce. What couples rows beyond plain
        # BatchNorms comes from one training forward (an EASGD replica is a model of its own:
        # its own rows, its own draws).
        pmodel = replica_model(model, sample_shape, grid, self.batch_norm,
                               sync_replica_gradients)
        if sync_replica_gradients:
            tables, dense = self._split(model)
            pmodel.reducers = gradient_exchange(dense, grid.world, 1.0 / grid.size,
                                                self.bucket_cap_bytes, self.first_bucket_bytes)
            if tables and grid.size > 1:
                owners_only = [name for name, module in tables  # max_norm: whole tables
                               if self._table_mode(module.weight, grid.size) == "sharded"
                               and module.max_norm is None]
                parts = {name: self.table_parts(module.weight, grid.size)
                         for name, module in tables}
                nodes = self._nodes(grid) if owners_only else None
                routes = {name: NodeRoutes(nodes) for name, module in tables
                          if name in owners_only and nodes is not None
                          and self.node_push_pays(module.weight, grid.size, nodes)}
                pmodel.reducers.append(SparseGradientExchange(
                    tables, grid.world, 1.0 / grid.size, self.sparse, self.pricing.costs,
                    owners_only=owners_only, parts=parts, hot_rows=self.sparse_hot_rows,
                    node_routes=routes))
        return pmodel

    def _nodes(self, grid: ProcessGrid) -> list[int]:
        """Each rank's node (collective): by `ranks_per_node`, or MPI's shared-memory groups
        (each named by its lowest world rank)."""
        if isinstance(self.ranks_per_node, int):
            return [rank // self.ranks_per_node for rank in range(grid.size)]
        # imported here: importing mpi4py initialises MPI, which a 1-process run never does
        # (as in runner.core.comm)
        from mpi4py import MPI

        world = grid.world.communicator
        shared = world.Split_type(MPI.COMM_TYPE_SHARED)
        node = shared.allreduce(world.Get_rank(), op=MPI.MIN)
        shared.Free()
        return [int(k) for k in world.allgather(node)]

    def node_push_pays(self, weight: torch.Tensor, p: int, nodes: list[int]) -> bool:
        """Whether summing a node's rows before the push across nodes is cheaper for this
        table (`node_push_seconds`): only with nodes of equal size, more than one of them and
        of more than one rank, and rows that the node's ranks share (from the data's
        expected rows of a node's batch)."""
        sizes = {nodes.count(node) for node in set(nodes)}
        if len(sizes) != 1 or len(set(nodes)) < 2 or sizes == {1}:
            return False
        per_node = sizes.pop()
        num_rows, row_bytes = weight.shape[0], weight[0].numel() * weight.element_size()
        direct, through = node_push_seconds(p, per_node, row_bytes,
                                            self._expected_rows(num_rows, p),
                                            self._node_rows(num_rows, p, per_node),
                                            self.pricing.costs)
        return through < direct

    def _node_rows(self, num_rows: int, p: int, per_node: int) -> float | None:
        """The distinct rows a node's batch is expected to touch (None: no model of the data)."""
        touched, batch = self.pricing.rows_touched, self.pricing.global_batch
        if touched is None or batch is None:
            return None
        return min(num_rows, touched(batch // p * per_node))

    def _expected_rows(self, num_rows: int, p: int) -> float:
        """The rows of a table a rank's batch is expected to touch (all, without a model of
        the data)."""
        touched, batch = self.pricing.rows_touched, self.pricing.global_batch
        if touched is None or batch is None:
            return num_rows
        return min(num_rows, touched(batch // p))

    def _table_mode(self, weight: torch.Tensor, p: int) -> SparseChoice:
        """How a table is exchanged for the whole run: `sharded` (owners-only storage) when
        asked, or under `auto` when the cost model prefers it for the rows a batch is expected
        to touch (decided once: a table on its owners cannot become whole again every other
        step); `auto` then means a per-step choice of dense and allgather."""
        if self.sparse != "auto":
            return self.sparse
        if p <= 1:
            return "auto"
        num_rows, row_bytes = weight.shape[0], weight[0].numel() * weight.element_size()
        rows = self._expected_rows(num_rows, p)
        best = choose_sparse_mode(p, num_rows, row_bytes, [rows] * p, self.pricing.costs)
        return "sharded" if best == "sharded" else "auto"

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

    def exchanged_once(self, op: CommOp) -> bool:
        # A sparse table's exchange follows the step's backward too; its owners-only pull is
        # each forward's.
        return op.layer.split(" ")[-2:-1] != ["pull"]

    def table_parts(self, weight: torch.Tensor, p: int) -> int:
        """How many ranks own the rows of an owners-only table: `strategy.sparse_partitions`,
        or under `auto` the cost model's choice for the rows a batch is expected to touch."""
        if isinstance(self.sparse_partitions, int):
            return min(self.sparse_partitions, p)
        num_rows, row_bytes = weight.shape[0], weight[0].numel() * weight.element_size()
        return choose_partitions(p, num_rows, row_bytes, self._expected_rows(num_rows, p),
                                 self.pricing.costs)

    def table_rows_per_rank(self, weight: torch.Tensor, p: int) -> int:
        """Rows of a sparse table that rank 0 holds as parameters: the whole table, or under
        the owners-only exchange its block and the hot replicas (`sharded_rows_per_rank`)."""
        num_rows = weight.shape[0]
        if p <= 1 or self._table_mode(weight, p) != "sharded":
            return num_rows
        return sharded_rows_per_rank(num_rows, self.table_parts(weight, p),
                                     min(self.sparse_hot_rows, num_rows))

    def predict_sparse_ops(self, name: str, weight: torch.Tensor, p: int,
                           samples_per_rank: int) -> list[CommOp]:
        """The exchange of one table, its rows per rank expected from the data (`rows_touched`;
        without it every row is assumed touched). `auto` predicts the mode the cost model
        (communication and local work) would choose for that many rows."""
        num_rows, row_bytes = weight.shape[0], weight[0].numel() * weight.element_size()
        rows = (num_rows if self.pricing.rows_touched is None
                else min(num_rows, self.pricing.rows_touched(samples_per_rank)))
        if self._table_mode(weight, p) == "sharded":
            hot = min(self.sparse_hot_rows, num_rows)
            node_ranks, node_rows = 1, 0.0
            if isinstance(self.ranks_per_node, int):  # `auto`: the planner sees one node
                nodes = [rank // self.ranks_per_node for rank in range(p)]
                if self.node_push_pays(weight, p, nodes):
                    node_ranks = self.ranks_per_node
                    node_rows = (self._node_rows(num_rows, p, node_ranks)
                                 or rows * node_ranks)
            owners = RowOwners(self.table_parts(weight, p), hot, node_ranks, node_rows)
            return sparse_exchange_ops("sharded", "world", p,
                                       TableRows(num_rows, row_bytes, rows, rows * p),
                                       label=name, owners=owners)
        mode: SparseMode = (choose_sparse_mode(p, num_rows, row_bytes, [rows] * p,
                                               self.pricing.costs, PER_STEP_MODES)
                            if self.sparse == "auto" else self.sparse)
        return sparse_exchange_ops(mode, "world", p, TableRows(num_rows, row_bytes, rows, rows * p),
                                   label=name, counts_first=self.sparse == "auto")

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        tables = {id(module.weight): module.weight for _, module in self._split(model)[0]}
        total = sum(p.numel() * p.element_size() for p in model.parameters()
                    if id(p) not in tables)
        for weight in tables.values():  # rank 0's rows of each table
            row_bytes = weight[0].numel() * weight.element_size()
            total += self.table_rows_per_rank(weight, grid.size) * row_bytes
        return total

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if isinstance(model, GPT):  # attention's products and passes, as tensor parallelism's
            return tp_compute_seconds(model, sample_shape, grid, global_batch, "pairing",
                                      self.pricing.rates)
        return super().predict_compute_seconds(model, sample_shape, grid, global_batch)

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if isinstance(model, GPT):
            rows = Partition(global_batch, grid.size).sizes[0]
            return (activation_elements(model, rows, sample_shape[0])
                    * activation_itemsize([model], self.pricing.compute_dtype))
        rows = Partition(global_batch, grid.size).sizes[0]
        # every leaf's output, from one forward of the model itself (`strategies.probe`)
        return (rows * probe(model, sample_shape).activation_elements
                * activation_itemsize([model], self.pricing.compute_dtype))
