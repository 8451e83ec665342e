"""The runtime of sharded data parallelism (`strategy=fsdp`, `strategies.fsdp`): `ShardedModel`,
whose hooks gather each unit's whole parameters (`strategies.sharding.units`) just before its
forward and put the pieces back after it, keeping whole what the stage keeps.

- Stage 3: what autograd saves of a unit's whole parameters is a note (`SavedPiece`), and the
  unit's first use in backward gathers them again, once (`ShardedUnit.copies_for_backward`).
  The whole model's own unit (what no block holds) is kept whole from its forward through
  backward instead (`KeptWhole`), as FSDP2 keeps its root: it would be gathered again at once.
- Stages 1 and 2: autograd keeps the whole parameters it saves (`KeptWhole`: parameter memory,
  which the runner's activation meter does not count) until the unit's backward is done.
- A step's micro-batches (`feeding`): the units keep their whole gradients until the last,
  which reduce-scatters each once. A recomputed unit (`trainer.activation_checkpointing`)
  gathers its parameters inside its recomputation (`recomputed_forward`), so backward gathers
  it once more.

Prefetch (`prefetch`, on by default), as FSDP2 does: a unit's gather is issued while the unit
before it computes, and waited for when the unit starts.
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
  from its issue, so about one unit more is held at once (`strategies.sharding.memory`).
- Progress: MPI moves a non-blocking collective only inside MPI calls (MPICH runs no progress
  thread), so under `comm.backend=mpi` a prefetched gather mostly moves when it is waited for
  (or while another collective runs); gloo's worker threads move it while the rank computes
  (`comm.backend=torch`). No progress thread of gridrun's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from runner.core.primitives import GatherInFlight
from strategies.base import MicroBatch, ParallelModel
from strategies.sharding.units import ROOT, HeldBytes, ShardedUnit


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
    its forward, the next one's gather issued ahead where `prefetch` (see the module doc).
    Mixed into the class of the model it shards (`strategies.fsdp`): the whole model's replica
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

    def unit_names(self) -> list[str]:
        """The sharded units but the whole model's own (what no block holds)."""
        return [unit.path for unit in self.units if unit.path != ROOT]

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
