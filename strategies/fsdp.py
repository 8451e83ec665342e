"""`strategy=fsdp`: sharded data parallelism, ZeRO's stages (PyTorch's FSDP, DeepSpeed's ZeRO),
for any module.

The global batch is split over all P ranks as under `data` (one process's BatchNorm statistics
and random draws included); the parameters are split by rows over the same ranks, unit by unit,
so each rank keeps 1/P of the parameters, of their gradients and of the optimizer's state (an
element-wise optimizer: SGD, Adam, AdamW, ... runs on the pieces as on the whole).
`strategy.stage` says what lives whole during a step:

- stage 3 (the default): a unit's whole parameters are all-gathered just before its forward
  and freed after it; backward gathers them again where it reads them, once; its gradients are
  reduce-scattered as soon as they are ready (the gather's adjoint) and the copies freed. The
  whole model's own unit (embeddings, final norm, head: what no block holds) is kept from its
  forward through backward instead, as FSDP2 keeps its root. At most the pieces, the model's
  unit, the largest block whole and what backward needs of one block.
- stage 2: the whole parameters are gathered before a unit's forward and kept, by autograd,
  until its backward is done; the gradients reduce-scattered as soon as they are ready.
- stage 1: as stage 2, but the whole gradients are kept until backward ends and
  reduce-scattered then (`finish_gradient_sync`): only the optimizer's state and update are
  sharded.

Bytes per step: every unit all-gathered and reduce-scattered once (as much as `data`'s
all-reduce moves), and under stage 3 each block gathered a second time where its backward reads
its weights. Parameters of fewer rows than ranks stay whole on every rank and are all-reduced in
buckets, as under `data`. `strategy.prefetch` (on by default) issues a unit's gather while the
unit before it computes, as FSDP2 does: the same bytes, earlier.

On a grid of Pr > 1 the model is first split over each model group as `strategy=grid` splits it
(`ModelGroupSplit`: a plan by module, GPT's tensor parallelism), in place, and its class made a
sharded one (`sharded_class`); each rank's part is then sharded over its batch group (the Pc ranks
holding the same part), the pieces of what a model group holds whole summed over the model group
too. The predictions read rank 0's part, built for a stand-in grid on a meta copy
(`split_view`, `runner.core.standin`).

This module is the strategy: its checks, its build and its predictions. Its machinery is in
`strategies/sharding/`: the units and their gathers (`units`), the hooks that gather and free
them during a step, prefetch included (`runtime`), and the model of the memory they hold
(`memory`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from runner.core import GridShape, Partition, ProcessGrid
from runner.core.comm import GridGroup
from runner.core.standin import rank_zero_grid
from runner.cost.collectives import CommOp
from strategies.base import (
    DEFAULT_PRICING,
    ParallelModel,
    PricingContext,
    Strategy,
    gradient_exchange,
)
from strategies.data import BATCH_NORM_MODES, DataParallel, DataParallelModel, replica_model
from strategies.exchange.buckets import predict_gradient_ops
from strategies.exchange.sparse_gradients import sparse_tables
from strategies.grid import GridParallel
from strategies.layers.norm import batch_norm_ops
from strategies.layers.split import activation_itemsize
from strategies.probe import sample_dtype
from strategies.recompute import checkpoint_targets
from strategies.registry import register_strategy
from strategies.sharding.memory import (
    HeldWhole,
    SplitView,
    gathered_peak,
    memory_per_rank,
    meta_copy,
    piece_bytes,
)
from strategies.sharding.runtime import ShardedModel
from strategies.sharding.units import (
    ROOT,
    ShardedParameters,
    ShardedUnit,
    Sharding,
    UnitParameters,
    container_units,
    trains,
    unit_parameters,
    unit_paths,
    unmatched_patterns,
    within,
)

FSDP_STAGES = (1, 2, 3)


class ShardedDataParallelModel(ShardedModel, DataParallelModel):
    """The whole model as a batch replica, sharded (grid.pr=1)."""


def split_in_place(pmodel: ParallelModel, model: nn.Module) -> str | None:
    """The path of `model` in `pmodel` with its dot, where the split kept the model's own
    modules (a plan by module, gridrun's GPT); None where it rebuilt the model."""
    return next((f"{name}." for name, child in pmodel.named_children() if child is model), None)


_SHARDED_CLASSES: dict[type, type] = {}


def sharded_class(cls: type[ParallelModel]) -> type[ShardedModel]:
    """`cls` with `ShardedModel`'s hooks: a split model's own class, sharded (made once per
    class; a module's class is swapped in place, as PyTorch's `fully_shard` does)."""
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModel, cls), {})
    return _SHARDED_CLASSES[cls]


class ModelGroupSplit(GridParallel):
    """strategy=grid's split over the model group, as fsdp uses it on a grid of Pr > 1 (its
    problems named as fsdp's)."""

    name = "fsdp"


@register_strategy("fsdp")
class ShardedDataParallel(Strategy):
    # its pieces are updated by the optimizer from the summed gradients: no replica optimizer
    synchronous_only = True

    def __init__(self, stage: int = 3, units: str | list[str] = "auto",
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 batch_norm: str = "global", plan: Mapping[str, str] | None = None,
                 tp_layout: str = "auto", prefetch: bool = True, *,
                 pricing: PricingContext = DEFAULT_PRICING) -> None:
        super().__init__(bucket_cap_mb, first_bucket_mb, pricing=pricing)
        # 1: optimizer state sharded; 2: also the gradients; 3: also the parameters
        self.stage = stage
        # "auto" or module path patterns / class names: the modules gathered together
        self.units = units if isinstance(units, str) else [str(u) for u in units]
        # as `data`'s: global (one process's statistics) or local
        self.batch_norm = batch_norm
        # issue the next unit's gather (and, stage 3, backward's next regather) ahead of its use
        self.prefetch = prefetch
        # grid.pr > 1: the split over the model group, as strategy=grid's (its plan by
        # module, a GPT's tensor-parallel layout)
        self.splitter = ModelGroupSplit(bucket_cap_mb, first_bucket_mb, tp_layout, plan,
                                        pricing=pricing)
        # rank 0's views of a model (`split_view`, `_as_gathered`), each kept with its model
        self._views: dict[tuple[object, ...], tuple[nn.Module, Any]] = {}

    def _replica(self) -> DataParallel:
        return DataParallel(self.bucket_cap_bytes / 2**20, self.first_bucket_bytes / 2**20,
                            sparse="dense", batch_norm=self.batch_norm, pricing=self.pricing)

    def split_view(self, model: nn.Module, sample_shape: tuple[int, ...],
                   grid: GridShape) -> SplitView | None:
        """Rank 0's model to cut units from on `grid` (None: the split rebuilds the model, whose
        modules are no longer the user's)."""
        if grid.pr == 1:
            return SplitView(model, model, "", {id(p) for p in model.parameters()},
                             sample_dtype(model))
        key = (id(model), grid, tuple(sample_shape))
        if key not in self._views:  # the model is kept with its view: its id stays its own
            twin = meta_copy(model)
            pmodel = self.splitter.parallelize(twin, sample_shape, rank_zero_grid(grid))
            prefix = split_in_place(pmodel, twin)
            view = None if prefix is None else SplitView(
                pmodel, twin, prefix, {id(p) for p in pmodel.replicated_in_model_group},
                sample_dtype(model))
            self._views[key] = (model, view)
        return cast(SplitView | None, self._views[key][1])

    def _as_gathered(self, model: nn.Module) -> nn.Module:
        """The model as its units compute: under bf16 or fp16 their gathers hand them
        half-type parameters, so what a parameter outputs outside autocast (an embedding's rows)
        is half too (a meta copy, kept with the model)."""
        dtype = self.pricing.compute_dtype
        if dtype is None:
            return model
        key = ("gathered", id(model), dtype)
        if key not in self._views:
            self._views[key] = (model, meta_copy(model, dtype))
        return cast(nn.Module, self._views[key][1])

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        if self.stage not in FSDP_STAGES or isinstance(self.stage, bool):
            return [f"strategy.stage={self.stage}: must be 1 (optimizer state sharded), 2 (and "
                    f"gradients) or 3 (and parameters)"]
        if not isinstance(cast(object, self.prefetch), bool):  # any value a config gives
            return [f"strategy.prefetch={self.prefetch}: must be true (each unit's gather "
                    f"issued ahead of its use) or false (each gather when its unit starts)"]
        if self.batch_norm not in BATCH_NORM_MODES:
            return [f"strategy.batch_norm={self.batch_norm}: must be one of "
                    f"{', '.join(BATCH_NORM_MODES)}"]
        if grid.pr > 1 and grid.pc == 1:
            return [f"strategy=fsdp shards over the grid.pc ranks that split the batch; "
                    f"grid.pc=1 shards nothing (use strategy=grid to split the model over "
                    f"grid.pr={grid.pr})"]
        if grid.pr > 1 and self.batch_norm != "global":
            return [f"strategy.batch_norm={self.batch_norm}: on grid.pr={grid.pr} a BatchNorm "
                    f"takes the statistics of its batch group's rows, as under strategy=grid "
                    f"(one process's); use strategy.batch_norm=global"]
        if grid.pr > 1:
            return self.splitter.check(grid, global_batch)
        if global_batch < grid.size:
            return [f"trainer.batch_size={global_batch} is smaller than the {grid.size} ranks: "
                    f"sharded data parallelism needs a sample per rank"]
        return super().check(grid, global_batch)

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        if grid.pr > 1:
            problems = self.splitter.check_model(model, sample_shape, grid)
            if problems:
                return problems
        view = self.split_view(model, sample_shape, grid)
        if view is None:
            return [f"strategy=fsdp on grid.pr={grid.pr} shards a model split in place over the "
                    f"model group (by a parallel plan, strategy.plan or the model's own, or "
                    f"gridrun's GPT); {type(model).__name__} is rebuilt by the layer rules: "
                    f"give it strategy.plan, or use grid.pr=1"]
        problems = [f"strategy.units: {pattern} matches no module (by path or class name)"
                    for pattern in unmatched_patterns(view.host, self.units)]
        problems += [f"strategy.units: {name} is a {type(view.host.get_submodule(name)).__name__}"
                     f", which is never called (its members are): name its members ({name}.*)"
                     for name in container_units(view.host, self.units)]
        if grid.size == 1:
            return problems
        if grid.pr == 1:
            problems += self._replica().check_model(model, sample_shape, grid)
        problems += [f"strategy=fsdp cannot shard {name or 'the model'} "
                     f"({type(module).__name__}): its gradients are sparse (sparse=True); "
                     f"use strategy=data" for name, module in sparse_tables(model)]
        for path, params in unit_parameters(view.host, unit_paths(view.host,
                                                                   self.units)).items():
            dtypes = {p.dtype for _, _, p in params}
            if len(dtypes) > 1:
                problems.append(f"strategy=fsdp: unit {path or '(model)'} holds parameters of "
                                f"several dtypes ({', '.join(sorted(map(str, dtypes)))}): "
                                f"give each dtype its own unit (strategy.units)")
        return problems

    def reproduces_random_draws(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape) -> bool:
        if grid.pr > 1:
            return self.splitter.reproduces_random_draws(model, sample_shape, grid)
        return True  # as `data`: every row's masks drawn alike at every P

    def draws_rows_alike(self, model: nn.Module, sample_shape: tuple[int, ...],
                         grid: GridShape) -> bool:
        if grid.pr > 1:
            return self.splitter.draws_rows_alike(model, sample_shape, grid)
        return self._replica().draws_rows_alike(model, sample_shape, grid)

    def recompute_problem(self, model: nn.Module, targets: list[str],
                          grid: GridShape) -> str | None:
        """A recomputed module must hold whole units: one whose parameters an enclosing unit
        gathers outside its recomputation would be recomputed from the pieces."""
        if grid.pr > 1:
            return self.splitter.recompute_problem(model, targets, grid)
        if grid.size == 1:
            return None
        paths = unit_paths(model, self.units)
        owners = {id(p): path for path, params in unit_parameters(model, paths).items()
                  for _, _, p in params}
        for target in targets:
            module = model.get_submodule(target)
            outside = sorted({owners[id(p)] for p in module.parameters()
                              if not within(owners[id(p)], target)})
            if outside:
                return (f"{target} holds parameters of the fsdp unit "
                        f"{outside[0] or '(the model)'}, gathered outside its recomputation; "
                        f"recompute whole units (strategy.units={target} or one inside it)")
        return None

    def recomputed_groups(self, model: nn.Module, paths: list[str]) -> dict[str, list[str]]:
        """The units gathered again in backward by `trainer.activation_checkpointing`, by the
        recomputed module holding them (each a unit inside or equal to it), in `paths` order."""
        targets, _ = checkpoint_targets(model, self.pricing.activation_checkpointing)
        groups: dict[str, list[str]] = {}
        for path in paths:
            target = next((t for t in targets if path != ROOT and within(path, t)), None)
            if target is not None:
                groups.setdefault(target, []).append(path)
        return groups

    def exchanged_once(self, op: CommOp) -> bool:
        # the buckets' all-reduces, and the units' reduce-scatters (and the model group's sums
        # of their pieces): the micro-batches before a step's last keep their whole gradients
        return super().exchanged_once(op) or (op.op in ("reduce_scatter", "allreduce")
                                              and op.layer.startswith("fsdp "))

    def splits_parameters(self, grid: GridShape) -> bool:
        return grid.size > 1

    def _gather_dtype(self, params: UnitParameters) -> torch.dtype | None:
        """bf16 and fp16 training gathers the whole parameters in the half type (the pieces
        and their optimizer state stay in the parameters' type); None: their own type."""
        half = self.pricing.compute_dtype
        return half if half is not None and params[0][2].is_floating_point() else None

    def _gather_itemsize(self, params: UnitParameters) -> int:
        dtype = self._gather_dtype(params) or params[0][2].dtype
        return dtype.itemsize

    def _rank_zero_shards(self, view: SplitView, grid: GridShape) -> ShardedParameters:
        """Rank 0's parameters as it shards them: its part's over its batch group (every rank
        at grid.pr=1)."""
        return ShardedParameters.of(view.host, self.units,
                                    grid.size if grid.pr == 1 else grid.pc)

    def _whole_exchanges(self, whole: list[tuple[str, nn.Parameter]], replicated: set[int],
                         grid: GridShape) -> list[tuple[list[nn.Parameter], GridGroup, int]]:
        """The unsharded trained parameters' gradient exchanges, as `strategy=grid` makes them:
        those a model group splits summed over the batch group, the others over every rank."""
        trained = [p for _, p in whole if p.requires_grad]
        if grid.pr == 1:
            return [(trained, "world", grid.size)]
        return [([p for p in trained if id(p) not in replicated], "batch", grid.pc),
                ([p for p in trained if id(p) in replicated], "world", grid.size)]

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        if grid.pr > 1:
            split_model = self.splitter.parallelize(model, sample_shape, grid)
            prefix = split_in_place(split_model, model)
            assert prefix is not None, "check_model refuses a model the split rebuilds"
            split_model.__class__ = sharded_class(type(split_model))
            pmodel = cast(ShardedModel, split_model)
            comm, replicated = grid.batch, {id(p) for p in split_model.replicated_in_model_group}
        else:
            replica = replica_model(model, sample_shape, grid, self.batch_norm,
                                    sync_replica_gradients, ShardedDataParallelModel)
            assert isinstance(replica, ShardedDataParallelModel)
            pmodel = replica
            comm, replicated = grid.world, {id(p) for p in model.parameters()}
        if grid.size == 1:
            pmodel.attach([], self.stage)
            return pmodel
        shards = ShardedParameters.of(model, self.units, comm.size)
        sharding = Sharding(comm, self.stage, 1.0 / grid.size,
                            grid.model if grid.pr > 1 else None, frozenset(replicated))
        units = [ShardedUnit.split(path, model.get_submodule(path), params, sharding,
                                   self._gather_dtype(params))
                 for path, params in shards.split.items() if params]
        pmodel.attach(units, self.stage, self.prefetch)
        comms = {"world": grid.world, "batch": grid.batch}
        pmodel.reducers = [reducer for params, group, _ in
                           self._whole_exchanges(shards.whole, replicated, grid.shape)
                           for reducer in gradient_exchange(
                               params, comms[group], 1.0 / grid.size, self.bucket_cap_bytes,
                               self.first_bucket_bytes)]
        if grid.pr > 1:  # the pieces of what a model group holds whole
            pmodel.replicated_in_model_group = (
                [cast(nn.Parameter, piece) for unit in units
                 for p, piece in zip(unit.params, unit.pieces(), strict=True)
                 if p.summed_over_model]
                + [p for _, p in shards.whole if id(p) in replicated])
        return pmodel

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        if grid.size == 1:
            return []
        view = self.split_view(model, sample_shape, grid)
        assert view is not None, "check_model refuses a model the split rebuilds"
        group: GridGroup = "world" if grid.pr == 1 else "batch"
        shards = self._rank_zero_shards(view, grid)
        split, whole, ranks = shards.split, shards.whole, shards.ranks
        calls, read = view.calls(sample_shape, list(split), self.pricing.compute_dtype)
        recomputed = {path for group in self.recomputed_groups(view.host, list(split)).values()
                      for path in group}
        ops: list[CommOp] = []
        if grid.pr > 1:  # the split's activation collectives; its gradient buckets are ours
            ops += [op for op in self.splitter.predict_ops(self._as_gathered(model),
                                                           sample_shape, grid, global_batch)
                    if op.op != "iallreduce"]
        for path, params in split.items():
            if not params:
                continue
            label = f"fsdp {path or '(model)'}"
            itemsize = self._gather_itemsize(params)
            padded = [max(Partition(p.shape[0], ranks).sizes) * p.shape[1:].numel()
                      for _, _, p in params]
            nbytes = ranks * sum(padded) * itemsize
            summed = (sum(n for n, (_, _, p) in zip(padded, params, strict=True)
                          if id(p) in view.replicated) * itemsize if grid.pr > 1 else 0)
            trained = trains(params)
            gather = CommOp("allgather", group, ranks, nbytes, label)
            scatter = ([CommOp("reduce_scatter", group, ranks, nbytes, label)]
                       + ([CommOp("allreduce", "model", grid.pr, summed, label)]
                          if summed else [])) if trained else []
            # gathered again in backward: by its recomputation (every stage), or where stage 3's
            # backward reads the weights it freed
            again = path in recomputed or (trained and self.stage == 3 and path != ROOT
                                           and any(id(p) in read for _, _, p in params))
            if self.stage == 1:  # one reduce-scatter at the end, however many calls
                ops += [gather] * ((2 if again else 1) * calls[path]) + scatter
            else:
                ops += ([gather, *scatter] + ([gather] if again else [])) * calls[path]
        by_name = {id(p): name for name, p in whole}
        for exchanged, exchange_group, size in self._whole_exchanges(whole, view.replicated,
                                                                     grid):
            items = [(by_name[id(p)].split(".")[0], [(p.numel() * p.element_size(), p.dtype)])
                     for p in exchanged]
            ops += predict_gradient_ops(items, exchange_group, size, *self.bucket_caps)
        if self.batch_norm == "global" and grid.pr == 1:
            ops += batch_norm_ops(model, "world", ranks, activation_itemsize([model]))
        return ops

    def predict_memory(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                       state_copies: int) -> dict[str, int]:
        """The pieces, their gradients and state; the whole parameters gathered at once (stage
        3: a unit and the units enclosing it; stages 1 and 2: also every unit before it whose
        backward reads its weights, which autograd keeps), with prefetch also the next unit's,
        issued at a unit's entry, and under stage 3 backward's too (a regather and the next
        one issued ahead, beside the units kept); a recomputed module's units from its
        recomputation to their backward; stage 1's whole gradients of every unit, kept until
        backward ends, count with the gradients (as every stage's do over a step's
        micro-batches)."""
        if grid.size == 1:
            return super().predict_memory(model, sample_shape, grid, state_copies)
        view = self.split_view(model, sample_shape, grid)
        assert view is not None, "check_model refuses a model the split rebuilds"
        shards = self._rank_zero_shards(view, grid)
        sizes = {path: sum(p.numel() for _, _, p in params) * self._gather_itemsize(params)
                 for path, params in shards.split.items() if params}
        events: list[tuple[str, bool]] = []
        _, read = view.calls(sample_shape, list(sizes), self.pricing.compute_dtype, events)
        held = HeldWhole.of(shards.split, read, self.recomputed_groups(view.host, list(sizes)),
                            self.stage)
        return memory_per_rank(shards, sizes, gathered_peak(events, sizes, held, self.prefetch),
                               self.stage == 1 or self.pricing.accumulate_steps > 1,
                               state_copies)

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        view = self.split_view(model, sample_shape, grid)
        assert view is not None, "check_model refuses a model the split rebuilds"
        return piece_bytes(self._rank_zero_shards(view, grid))

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        if grid.pr > 1:
            return self.splitter.predict_compute_seconds(model, sample_shape, grid,
                                                         global_batch)
        return self._replica().predict_compute_seconds(model, sample_shape, grid, global_batch)

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        if grid.pr > 1:
            return self.splitter.predict_activation_bytes(model, sample_shape, grid,
                                                          global_batch)
        return self._replica().predict_activation_bytes(model, sample_shape, grid,
                                                        global_batch)

