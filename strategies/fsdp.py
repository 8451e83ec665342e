"""`strategy=fsdp`: sharded data parallelism, ZeRO's stages (PyTorch's FSDP, DeepSpeed's ZeRO),
for any module.

The global batch is split over all P ranks as under `data` (one process's BatchNorm statistics
and random draws included); the parameters are split by rows over the same ranks, unit by unit
(`strategies.sharding.units`), so each rank keeps 1/P of the parameters, of their gradients and of
the optimizer's state (an element-wise optimizer: SGD, Adam, AdamW, ... runs on the pieces as
on the whole). `strategy.stage` says what lives whole during a step:

- stage 3 (the default): a unit's whole parameters are all-gathered just before its forward
  and freed after it; what backward needs of them is kept as a note (`SavedPiece`), and the
  unit's first use in backward gathers them again, once; its gradients are reduce-scattered as
  soon as they are ready (the gather's adjoint) and the copies freed. The whole model's own
  unit (embeddings, final norm, head: what no block holds) is kept from its forward through
  backward instead, as FSDP2 keeps its root: it would be gathered again at once. At most the
  pieces, the model's unit, the largest block whole and what backward needs of one block.
- stage 2: the whole parameters are gathered before a unit's forward and kept, by autograd,
  until its backward is done; the gradients reduce-scattered as soon as they are ready.
- stage 1: as stage 2, but the whole gradients are kept until backward ends and
  reduce-scattered then (`finish_gradient_sync`): only the optimizer's state and update are
  sharded.

Bytes per step: every unit all-gathered and reduce-scattered once (as much as `data`'s
all-reduce moves), and under stage 3 each block gathered a second time where its backward reads
its weights. Parameters of fewer rows than ranks stay whole on every rank and are all-reduced in
buckets, as under `data`.

On a grid of Pr > 1 the model is first split over each model group as `strategy=grid` splits it
(`ModelGroupSplit`: a plan by module, GPT's tensor parallelism), in place, and its class made a
sharded one (`sharded_class`); each rank's part is then sharded over its batch group (the Pc ranks
holding the same part), the pieces of what a model group holds whole summed over the model group
too. The predictions read rank 0's part, built for a stand-in grid on a meta copy
(`split_view`, `runner.core.standin`). Over a step's micro-batches (`trainer.accumulate_steps`)
the units keep their whole gradients until the last, which reduce-scatters each once; a
recomputed unit (`trainer.activation_checkpointing`) gathers its parameters inside its
recomputation (`recomputed_forward`), so backward gathers it once more.

Prefetch (`strategy.prefetch`, on by default), as FSDP2 does: a unit's gather is issued while the
unit before it computes, and waited for when the unit starts.
- Forward: the first forward of each kind (training with gradients; evaluation) gathers each
  unit as it starts and records the order the units enter in; every later one, at a unit's
  entry and after its own gather, issues the non-blocking gather of the unit that entered next
  the time before, unless that unit is open or issued already, and that unit's entry waits for
  it (`ShardedUnit.gather(started)`: the same all-gather, its backward the same reduce-scatter).
  Not by module order on the first forward: the order modules are registered in need not be
  the order they run in, and the recorded order is exact.
- Backward (stage 3): a unit's regather (its first use in backward) issues the regather of the
  unit whose backward comes next: the units whose forward saved notes, in reverse order (the
  whole model's unit, kept, and a unit whose backward reads no weights have none).
- Which gather is issued when depends only on the order of entries, the same on every rank,
  never on timing: every rank issues the same collectives in the same order. A gather issued
  for a unit that then does not come (the order changed) is waited for and freed at the
  forward's end (backward's: at `finish_gradient_sync` or the next forward), so none is in
  flight past a step and the pieces never change between issue and use (the optimizer steps
  after backward).
- The bytes moved are the same gathers, issued earlier; a prefetched buffer counts as gathered
  from its issue, so about one unit more is held at once (`gathered_peak`).
- Progress: MPI moves a non-blocking collective only inside MPI calls (MPICH runs no progress
  thread), so under `comm.backend=mpi` a prefetched gather mostly moves when it is waited for
  (or while another collective runs); gloo's worker threads move it while the rank computes
  (`comm.backend=torch`). No progress thread of gridrun's own.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from runner.core import GridShape, Partition, ProcessGrid
from runner.core.comm import GridGroup
from runner.core.primitives import GatherInFlight
from runner.core.standin import rank_zero_grid
from runner.cost.collectives import CommOp
from strategies.base import (
    DEFAULT_PRICING,
    MicroBatch,
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
from strategies.probe import one_sample, sample_dtype
from strategies.recompute import checkpoint_targets
from strategies.registry import register_strategy
from strategies.sharding.units import (
    ROOT,
    HeldBytes,
    ShardedUnit,
    unit_parameters,
    unit_paths,
    unmatched_patterns,
    within,
)

FSDP_STAGES = (1, 2, 3)


@dataclass(frozen=True)
class SavedPiece:
    """What autograd keeps of a unit's whole parameter under stage 3: which one, and the view
    of it that was saved (gathered again when backward reads it)."""

    unit: ShardedUnit
    index: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class KeptWhole:
    """A whole parameter autograd keeps under stages 1 and 2 (parameter memory, which the
    runner's activation meter does not count)."""

    tensor: torch.Tensor


class ShardedModel(ParallelModel):
    """A parallel model with its units' parameters split by rows; each unit gathered around
    its forward, the next one's gather issued ahead where `prefetch` (`strategies.fsdp`).
    Mixed into the class of the model it shards: the whole model's replica
    (`ShardedDataParallelModel`), or a model split over the model group (`sharded_class`)."""

    units: list[ShardedUnit]
    stage: int
    prefetch: bool

    def attach(self, units: list[ShardedUnit], stage: int, prefetch: bool = True) -> None:
        self.units, self.stage, self.prefetch = units, stage, prefetch
        self.gathered, self.whole_gradients = HeldBytes(), HeldBytes()
        for unit in units:  # one count for the model
            unit.gathered, unit.whole_gradients = self.gathered, self.whole_gradients
        self._open: list[tuple[ShardedUnit, list[torch.Tensor]]] = []
        self._wholes: dict[int, tuple[ShardedUnit, int]] = {}  # storage → (unit, parameter)
        # Prefetch. Forward: the units' entries of the last forward of each kind (training
        # with gradients or not), the entries of this one so far, and the gathers issued ahead
        # of a unit's entry. Backward (stage 3): the regathers this forward's notes expect, in
        # the order backward makes them (the units' calls reversed), how far backward got
        # along them, and the regathers issued ahead.
        self._orders: dict[bool, list[ShardedUnit]] = {}
        self._entered: list[ShardedUnit] | None = None  # None: outside the model's forward
        self._ahead: dict[int, tuple[ShardedUnit, GatherInFlight]] = {}
        self._noted: set[int] = set()  # open units whose call has saved a note
        self._saved: list[ShardedUnit] = []  # this forward's calls that saved notes, in order
        self._plan: list[ShardedUnit] = []
        self._cursor = 0
        self._behind: dict[int, tuple[ShardedUnit, GatherInFlight]] = {}
        for unit in units:
            unit.module.register_forward_pre_hook(partial(self._gather_hook, unit))
            unit.module.register_forward_hook(partial(self._reshard_hook, unit),
                                              always_call=True)
        # the summary's per-module layouts: a split model's own, and each unit's sharding
        self.layouts = {**getattr(self, "layouts", {}),
                        **{unit.path or "(model)": f"fsdp stage {stage}" for unit in units}}
        self.recomputing = False  # inside a recomputation in backward

    def _gather_hook(self, unit: ShardedUnit, module: nn.Module, args: Any) -> None:
        if not unit.recomputed:
            self._gather(unit, module, args)

    def _reshard_hook(self, unit: ShardedUnit, module: nn.Module, args: Any,
                      output: Any) -> None:
        if not unit.recomputed:
            self._reshard(unit, module, args, output)

    def _gather(self, unit: ShardedUnit, module: nn.Module, args: Any) -> None:
        pieces = unit.pieces()
        ahead = self._ahead.pop(id(unit), None)
        if ahead is not None:  # issued at an earlier unit's entry: counted since
            wholes = unit.gather(ahead[1])
        else:
            wholes = unit.gather()
            unit.gathered.add(unit.whole_bytes)
        unit.install(wholes)
        self._open.append((unit, pieces))
        self._noted.discard(id(unit))
        for index, whole in enumerate(wholes):
            self._wholes[whole.untyped_storage().data_ptr()] = (unit, index)
        if self._entered is not None:
            self._entered.append(unit)
            self._prefetch_after(len(self._entered) - 1, unit)

    def _prefetch_after(self, position: int, unit: ShardedUnit) -> None:
        """Issue the gather of the unit that entered after `unit` in the last forward of this
        kind, when `unit` is where that forward had it and the next one is neither open nor
        issued already. The decision depends only on the order of entries, never on timing:
        every rank issues the same gathers in the same order."""
        order = self._orders.get(self._training_forward())
        if (not self.prefetch or order is None or position + 1 >= len(order)
                or order[position] is not unit):
            return
        after = order[position + 1]
        if id(after) in self._ahead or any(u is after for u, _ in self._open):
            return
        self._ahead[id(after)] = (after, after.start_gather())

    def _training_forward(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _reshard(self, unit: ShardedUnit, module: nn.Module, args: Any, output: Any) -> None:
        opened, pieces = self._open.pop()
        assert opened is unit, "units gathered and put back out of order"
        for key in [k for k, (u, _) in self._wholes.items() if u is unit]:
            del self._wholes[key]
        unit.reshard(pieces)
        if self.recomputing:  # backward reads this recomputation's whole parameters
            unit.kept = True
        unit.forward_done()

    def _pack(self, tensor: torch.Tensor) -> Any:
        """A note in place of a whole parameter (stage 3), the parameter itself (stages 1 and 2:
        parameter memory, not an activation), anything else to the runner's hooks."""
        found = self._wholes.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
        if found is None:
            return (self.outer_saved_hooks[0](tensor) if self.outer_saved_hooks is not None
                    else tensor)
        unit, index = found
        if self.stage != 3 or unit.path == ROOT:  # the whole model's unit: kept, as FSDP2 does
            unit.kept = True
            return KeptWhole(tensor)
        if id(unit) not in self._noted:  # this call's first note: a regather in backward
            self._noted.add(id(unit))
            self._saved.append(unit)
        return SavedPiece(unit, index, tuple(tensor.size()), tuple(tensor.stride()),
                          int(tensor.storage_offset()))

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, SavedPiece):
            if saved.unit.backward_copies is None:
                self._regather(saved.unit)
            whole = saved.unit.copies_for_backward()[saved.index]
            return whole.as_strided(saved.size, saved.stride, saved.offset)
        if isinstance(saved, KeptWhole):
            return saved.tensor
        if self.outer_saved_hooks is not None:
            return self.outer_saved_hooks[1](saved)
        return cast(torch.Tensor, saved)

    def _regather(self, unit: ShardedUnit) -> None:
        """Stage 3: `unit`'s first use in backward gathers its parameters again (or waits for
        that gather, issued ahead), then issues the regather of the unit whose backward comes
        next along the plan, when it holds no copies yet."""
        behind = self._behind.pop(id(unit), None)
        unit.copies_for_backward(None if behind is None else behind[1])
        plan = self._plan
        position = next((i for i in range(self._cursor, len(plan)) if plan[i] is unit), None)
        if position is None:  # not where the plan has it: nothing issued ahead
            return
        self._cursor = position + 1
        if not self.prefetch or position + 1 >= len(plan):
            return
        after = plan[position + 1]
        if after.backward_copies is None and id(after) not in self._behind:
            self._behind[id(after)] = (after, after.start_gather())

    def _finish_prefetches(self, issued: dict[int, tuple[ShardedUnit, GatherInFlight]]) -> None:
        """Complete and free the gathers issued ahead that nothing used (the order of units
        changed): none is left in flight past a forward or a step."""
        for unit, started in issued.values():
            unit.drop_gather(started)
        issued.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor
        training = self._training_forward()
        # a backward's left unused, or (after a forward that raised) a forward's: never used
        # across a step, whose optimizer may have changed the pieces since
        self._finish_prefetches(self._behind)
        self._finish_prefetches(self._ahead)
        self._entered, self._saved = [], []
        if training:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                out = super().forward(x)
        else:
            out = super().forward(x)
        # Not reached when the forward raises: a failing rank does not wait here for gathers
        # its peers may never complete.
        self._finish_prefetches(self._ahead)
        self._orders[training] = self._entered
        self._entered = None
        if training:
            self._plan, self._cursor = self._saved[::-1], 0
        return out

    @contextlib.contextmanager
    def feeding(self, micro: MicroBatch) -> Iterator[None]:
        """As `data`'s, and the units keep their whole gradients on the micro-batches before the
        step's last, which reduce-scatters each unit's sum once."""
        for unit in self.units:
            unit.accumulating = not micro.last
        try:
            with super().feeding(micro):
                yield
        finally:
            for unit in self.units:
                unit.accumulating = False

    def recomputed_forward(self, module: nn.Module) -> Callable[..., Any]:
        """A unit's own module gathers its parameters inside its recomputation (the hooks,
        outside it, would leave its recomputation the pieces); any other module recomputes the
        units it holds by their hooks."""
        unit = next((u for u in self.units if u.module is module), None)
        own = module.forward
        if unit is None:
            return own
        unit.recomputed = True

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._gather(unit, module, args)
            try:
                return own(*args, **kwargs)
            finally:
                self._reshard(unit, module, args, None)
        return forward

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager[None],
                                          contextlib.AbstractContextManager[Any]]:
        forward, again = super().recompute_contexts()
        return forward, self._recomputing(again)

    @contextlib.contextmanager
    def _recomputing(self, inner: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        self.recomputing = True
        try:
            with inner:
                yield
        finally:
            self.recomputing = False

    def finish_gradient_sync(self) -> None:
        self._finish_prefetches(self._behind)
        for unit in self.units:
            unit.finish()
        super().finish_gradient_sync()

    def gathered_peak_bytes(self) -> int:
        return self.gathered.peak

    def whole_gradient_peak_bytes(self) -> int:
        return self.whole_gradients.peak


class ShardedDataParallelModel(ShardedModel, DataParallelModel):
    """The whole model as a batch replica, sharded (grid.pr=1)."""


@dataclass
class SplitView:
    """What rank 0 cuts its units from: at grid.pr=1 the model itself; on a grid of Pr > 1 its
    part of the model split over the model group by `strategy=grid`'s rules (a plan by module,
    gridrun's GPT), built on a copy on the meta device for a stand-in grid
    (`runner.core.standin`) — shapes only, nothing moved."""

    forward: nn.Module  # what runs a forward: the split model (or the model)
    host: nn.Module  # the module the unit paths name: the model, split in place
    prefix: str  # the host's path in `forward`, with its dot ("" at grid.pr=1)
    replicated: set[int]  # the parameters every rank of a model group holds whole (by id)
    sample_dtype: torch.dtype  # what the model reads: its samples' type

    def calls(self, sample_shape: tuple[int, ...], paths: list[str],
              compute_dtype: torch.dtype | None,
              events: list[tuple[str, bool]] | None = None) -> tuple[dict[str, int], set[int]]:
        """`unit_calls` of the units at `paths` (of the host), keyed by those paths."""
        found: list[tuple[str, bool]] = []
        # each unit's path in the forward's model → its path in the host
        back = {self.prefix + p if p else self.prefix.rstrip("."): p for p in paths}
        calls, read = unit_calls(self.forward, sample_shape, list(back), compute_dtype, found,
                                 self.sample_dtype)
        if events is not None:
            events += [(back[path], entering) for path, entering in found]
        return {back[path]: n for path, n in calls.items()}, read


def _meta_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device (no memory); the
    floating parameters in `dtype` where given."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            cast_to = (dtype if dtype is not None and isinstance(tensor, nn.Parameter)
                       and tensor.is_floating_point() else tensor.dtype)
            empty = torch.empty_like(tensor, device="meta", dtype=cast_to)
            memo[id(tensor)] = (nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                if isinstance(tensor, nn.Parameter) else empty)
    return copy.deepcopy(model, memo)


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
            twin = _meta_copy(model)
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
            self._views[key] = (model, _meta_copy(model, dtype))
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

    def _gather_dtype(self, params: list[Any]) -> torch.dtype | None:
        """bf16 and fp16 training gathers the whole parameters in the half type (the pieces
        and their optimizer state stay in the parameters' type); None: their own type."""
        half = self.pricing.compute_dtype
        return half if half is not None and params[0][2].is_floating_point() else None

    def _gather_itemsize(self, params: list[Any]) -> int:
        dtype = self._gather_dtype(params) or params[0][2].dtype
        return dtype.itemsize

    def _split_and_whole(self, model: nn.Module, ranks: int
                         ) -> tuple[dict[str, list[Any]], list[tuple[str, nn.Parameter]]]:
        """Each unit's parameters split by rows, and those of fewer rows than ranks (whole)."""
        split: dict[str, list[Any]] = {}
        whole: list[tuple[str, nn.Parameter]] = []
        for path, params in unit_parameters(model, unit_paths(model, self.units)).items():
            split[path] = [(n, h, p) for n, h, p in params if p.dim() and p.shape[0] >= ranks]
            whole += [(n, p) for n, h, p in params if not (p.dim() and p.shape[0] >= ranks)]
        return split, whole

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
        split, whole = self._split_and_whole(model, comm.size)
        units = [ShardedUnit.split(path, model.get_submodule(path), params, comm, self.stage,
                                   self._gather_dtype(params), 1.0 / grid.size,
                                   grid.model if grid.pr > 1 else None, frozenset(replicated))
                 for path, params in split.items() if params]
        pmodel.attach(units, self.stage, self.prefetch)
        comms = {"world": grid.world, "batch": grid.batch}
        pmodel.reducers = [reducer for params, group, _ in
                           self._whole_exchanges(whole, replicated, grid.shape)
                           for reducer in gradient_exchange(
                               params, comms[group], 1.0 / grid.size, self.bucket_cap_bytes,
                               self.first_bucket_bytes)]
        if grid.pr > 1:  # the pieces of what a model group holds whole
            pmodel.replicated_in_model_group = (
                [cast(nn.Parameter, piece) for unit in units
                 for p, piece in zip(unit.params, unit.pieces(), strict=True)
                 if p.summed_over_model]
                + [p for _, p in whole if id(p) in replicated])
        return pmodel

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        if grid.size == 1:
            return []
        view = self.split_view(model, sample_shape, grid)
        assert view is not None, "check_model refuses a model the split rebuilds"
        group: GridGroup = "world" if grid.pr == 1 else "batch"
        ranks = grid.size if grid.pr == 1 else grid.pc
        split, whole = self._split_and_whole(view.host, ranks)
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
            trained = any(p.requires_grad for _, _, p in params)
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
        for params, exchange_group, size in self._whole_exchanges(whole, view.replicated,
                                                                  grid):
            items = [(by_name[id(p)].split(".")[0], [(p.numel() * p.element_size(), p.dtype)])
                     for p in params]
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
        ranks = grid.size if grid.pr == 1 else grid.pc
        split, whole = self._split_and_whole(view.host, ranks)

        def piece_bytes(trained_only: bool) -> int:
            pieces: int = sum(Partition(p.shape[0], ranks).sizes[0] * p.shape[1:].numel()
                              * p.element_size() for params in split.values()
                              for _, _, p in params if p.requires_grad or not trained_only)
            return pieces + sum(p.numel() * p.element_size() for _, p in whole
                                if p.requires_grad or not trained_only)

        trained = piece_bytes(True)
        sizes = {path: sum(p.numel() for _, _, p in params) * self._gather_itemsize(params)
                 for path, params in split.items() if params}
        events: list[tuple[str, bool]] = []
        _, read = view.calls(sample_shape, list(sizes), self.pricing.compute_dtype, events)
        recomputed = self.recomputed_groups(view.host, list(sizes))
        inside = {path for group in recomputed.values() for path in group}
        reads = {path for path in sizes if any(id(p) in read for _, _, p in split[path])
                 and path not in inside}
        kept = {path for path in reads if self.stage != 3 or path == ROOT}
        regathered = {path for path in reads if self.stage == 3 and path != ROOT
                      and any(p.requires_grad for _, _, p in split[path])}
        kept_whole = self.stage == 1 or self.pricing.accumulate_steps > 1
        return {"parameters": piece_bytes(False),
                "gradients": trained + (sum(size for path, size in sizes.items()
                                            if any(p.requires_grad for _, _, p in split[path]))
                                        if kept_whole else 0),
                "optimizer state": state_copies * trained,
                "gathered parameters": gathered_peak(events, sizes, kept, regathered,
                                                     self.prefetch, recomputed)}

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        view = self.split_view(model, sample_shape, grid)
        assert view is not None, "check_model refuses a model the split rebuilds"
        ranks = grid.size if grid.pr == 1 else grid.pc
        split, whole = self._split_and_whole(view.host, ranks)
        pieces: int = sum(Partition(p.shape[0], ranks).sizes[0] * p.shape[1:].numel()
                          * p.element_size() for params in split.values() for _, _, p in params)
        return pieces + sum(p.numel() * p.element_size() for _, p in whole)

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


def gathered_peak(events: list[tuple[str, bool]], sizes: dict[str, int], kept: set[str],
                  regathered: set[str], prefetch: bool,
                  recomputed: dict[str, list[str]] | None = None) -> int:
    """The most bytes of whole parameters held at once in a step, as the model's hooks hold
    them (`ShardedModel`), from one forward's entries and exits of the units (`events`), each
    unit's whole bytes, the units autograd keeps whole from their forward through backward,
    those backward gathers again (stage 3) and those a recomputed module gathers again, by
    module (`recomputed`).

    Forward: a unit's gather at its entry, freed at its exit unless kept; with `prefetch`, at
    each entry the next entry's gather issued too (unless that unit is open or issued
    already), counted from then. Backward (after the forward, the kept units held
    throughout), in the reverse order of the units' calls: a regather, freed before the next
    one (its reduce-scatter comes first), with `prefetch` the next regather issued at each; a
    recomputed module's units all gathered by its recomputation and freed by their backward,
    before the module before it is recomputed (never prefetched)."""
    entries = [path for path, entering in events if entering]
    live = peak = 0
    opened: list[str] = []
    ahead: set[str] = set()
    position = 0
    for path, entering in events:
        if not entering:
            opened.pop()
            if path not in kept:
                live -= sizes[path]
            continue
        if path in ahead:
            ahead.discard(path)
        else:
            live += sizes[path]
        opened.append(path)
        position += 1
        if prefetch and position < len(entries):
            after = entries[position]
            if after not in ahead and after not in opened:
                ahead.add(after)
                live += sizes[after]
        peak = max(peak, live)
    target_of = {path: target for target, group in (recomputed or {}).items()
                 for path in group}
    plan = [path for path in reversed(entries) if path in regathered]
    steps: list[str | list[str]] = []  # a regather's path, or a recomputation's units
    for path in reversed(entries):
        if path in regathered:
            steps.append(path)
        elif path in target_of and not any(isinstance(step, list) and path in step
                                           for step in steps):
            steps.append([p for p in entries if target_of.get(p) == target_of[path]])
    ahead.clear()
    position = -1
    for step in steps:
        if isinstance(step, list):  # a recomputation: its units whole until their backward
            held = sum(sizes[p] for p in step)
            peak = max(peak, live + held)
            continue
        path, position = step, position + 1
        if path in ahead:
            ahead.discard(path)
        else:
            live += sizes[path]
        if prefetch and position + 1 < len(plan):
            after = plan[position + 1]
            if after != path and after not in ahead:
                ahead.add(after)
                live += sizes[after]
        peak = max(peak, live)
        live -= sizes[path]
    return peak


def unit_calls(model: nn.Module, sample_shape: tuple[int, ...], paths: list[str],
               compute_dtype: torch.dtype | None = None,
               events: list[tuple[str, bool]] | None = None,
               sample_dtype: torch.dtype | None = None) -> tuple[dict[str, int], set[int]]:
    """From one sample's forward with gradients recorded (under autocast to `compute_dtype`
    where given, the floating parameters cast to it as the gathers cast them, as training
    runs): how many times each unit's module runs, and the parameters (by id) whose values
    autograd saves for backward (a view of one counts; a copy an operator casts does not:
    backward reads the copy). `events`, where given, receives each unit's entry (path, True)
    and exit (path, False) in the order they happen. `sample_dtype`: the sample's (by default
    what `model` reads, `strategies.probe.sample_dtype`)."""
    calls = dict.fromkeys(paths, 0)
    params = {id(p): id(p) for p in model.parameters()}
    read: set[int] = set()
    slots = [(module, name, param) for module in model.modules()
             for name, param in module._parameters.items() if param is not None]
    casts: dict[int, torch.Tensor] = {}
    if compute_dtype is not None:  # what the module computes with: the gathered half copies
        for _, _, param in slots:
            if param.is_floating_point() and id(param) not in casts:
                casts[id(param)] = param.to(compute_dtype)
                params[id(casts[id(param)])] = id(param)
    order = events if events is not None else []

    def count(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            calls[path] += 1
            order.append((path, True))
        return hook

    def leave(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            order.append((path, False))
        return hook

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in params:
            read.add(params[id(base)])
        return tensor

    handles = [model.get_submodule(path).register_forward_pre_hook(count(path))
               for path in paths]
    handles += [model.get_submodule(path).register_forward_hook(leave(path))
                for path in paths]
    device = slots[0][2].device if slots else torch.device("cpu")
    autocast: contextlib.AbstractContextManager[Any] = (
        torch.autocast(device.type, dtype=compute_dtype)
        if compute_dtype is not None and device.type != "meta" else contextlib.nullcontext())
    for module, name, param in slots:
        if id(param) in casts:
            module._parameters[name] = casts[id(param)]  # type: ignore[assignment]
    try:
        with (one_sample(model, sample_shape, handles, sample_dtype) as sample,
              torch.enable_grad(), autocast,
              torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
              torch.random.fork_rng(devices=[])):
            model(sample)
    finally:
        for module, name, param in slots:
            module._parameters[name] = param
    return calls, read
