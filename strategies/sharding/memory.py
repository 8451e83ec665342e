"""The memory model of sharded data parallelism (`strategy=fsdp`, `strategies.fsdp`): what a rank
holds, predicted from one forward of rank 0's part of the model.

`memory_per_rank` is a rank's memory by part: its pieces (`piece_bytes`), their gradients and
the optimizer's state, the whole gradients kept, and the whole parameters gathered at once.
The part the predictions read is a `SplitView`: the model itself at grid.pr=1; on a grid of
Pr > 1 the model split over the model group, built on a copy on the meta device (`meta_copy`).
`unit_calls` runs one sample through it and records each unit's calls, entries and exits, and
the parameters whose values autograd saves for backward; from those, `HeldWhole` says which
units stay whole past their forward, and `gathered_peak` replays the hooks of
`strategies.sharding.runtime` on the entries and exits: the most whole parameters held at
once. The bytes a step moves (`ShardedDataParallel.predict_ops`) are counted from the same
calls.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.core import Partition
from strategies.probe import one_sample
from strategies.sharding.units import ROOT, ShardedParameters, UnitParameters, trains

Slot = tuple[nn.Module, str, nn.Parameter]  # a module, its parameter's name, the parameter
Event = tuple[str, bool]  # a unit's path; True at its entry, False at its exit
Step = str | list[str]  # backward's: a regather's path, or a recomputation's units


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
              events: list[Event] | None = None) -> tuple[dict[str, int], set[int]]:
        """`unit_calls` of the units at `paths` (of the host), keyed by those paths."""
        found: list[Event] = []
        # each unit's path in the forward's model → its path in the host
        back = {self.prefix + p if p else self.prefix.rstrip("."): p for p in paths}
        calls, read = unit_calls(self.forward, sample_shape, list(back), compute_dtype, found,
                                 self.sample_dtype)
        if events is not None:
            events += [(back[path], entering) for path, entering in found]
        return {back[path]: n for path, n in calls.items()}, read


def meta_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
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


def memory_per_rank(shards: ShardedParameters, sizes: dict[str, int], gathered: int,
                    whole_gradients_kept: bool, state_copies: int) -> dict[str, int]:
    """What a rank holds, by part: its pieces and the parameters kept whole (`piece_bytes`),
    their gradients and `state_copies` copies of them as the optimizer's state, the most whole
    parameters gathered at once (`gathered`, `gathered_peak`); where `whole_gradients_kept`
    (stage 1, and every stage over a step's micro-batches) every trained unit's whole gradient
    (its whole bytes as gathered: `sizes`) too, with the gradients."""
    trained = piece_bytes(shards, trained_only=True)
    whole_gradients = sum(size for path, size in sizes.items() if trains(shards.split[path]))
    return {"parameters": piece_bytes(shards),
            "gradients": trained + (whole_gradients if whole_gradients_kept else 0),
            "optimizer state": state_copies * trained,
            "gathered parameters": gathered}


def piece_bytes(shards: ShardedParameters, trained_only: bool = False) -> int:
    """Bytes of what a rank holds of the parameters: the first rank's pieces (the largest)
    and the whole ones; `trained_only`: of those that need gradients."""
    pieces = sum(Partition(p.shape[0], shards.ranks).sizes[0] * p.shape[1:].numel()
                 * p.element_size() for params in shards.split.values()
                 for _, _, p in params if p.requires_grad or not trained_only)
    return pieces + sum(p.numel() * p.element_size() for _, p in shards.whole
                        if p.requires_grad or not trained_only)


@dataclass(frozen=True)
class HeldWhole:
    """The units whose whole parameters outlive their forward, by path: those autograd keeps
    whole through backward (`kept`), those stage 3's backward gathers again (`regathered`) and
    those a recomputed module gathers again, by module (`recomputed`)."""

    kept: set[str]
    regathered: set[str]
    recomputed: dict[str, list[str]]

    @staticmethod
    def of(split: dict[str, UnitParameters], read: set[int], recomputed: dict[str, list[str]],
           stage: int) -> HeldWhole:
        """From each unit's parameters, those whose values autograd saves (`read`, by id) and
        the recomputed modules' units: a unit whose backward reads its weights outside a
        recomputation is kept (stages 1 and 2; the whole model's own unit at stage 3) or, where
        it is trained, gathered again (stage 3)."""
        inside = {path for group in recomputed.values() for path in group}
        reads = {path for path, params in split.items()
                 if path not in inside and any(id(p) in read for _, _, p in params)}
        kept = {path for path in reads if stage != 3 or path == ROOT}
        regathered = {path for path in reads
                      if stage == 3 and path != ROOT and trains(split[path])}
        return HeldWhole(kept, regathered, recomputed)


def gathered_peak(events: list[Event], sizes: dict[str, int], held: HeldWhole,
                  prefetch: bool) -> int:
    """The most bytes of whole parameters held at once in a step, as the model's hooks hold
    them (`ShardedModel`), from one forward's entries and exits of the units (`events`), each
    unit's whole bytes and the units held past their forward (`held`).

    Forward: a unit's gather at its entry, freed at its exit unless kept; with `prefetch`, at
    each entry the next entry's gather issued too (unless that unit is open or issued
    already), counted from then. Backward (after the forward, the kept units held
    throughout), in the reverse order of the units' calls: a regather, freed before the next
    one (its reduce-scatter comes first), with `prefetch` the next regather issued at each; a
    recomputed module's units all gathered by its recomputation and freed by their backward,
    before the module before it is recomputed (never prefetched)."""
    entries = [path for path, entering in events if entering]
    live, peak = _forward_peak(events, entries, sizes, held.kept, prefetch)
    steps = _backward_steps(entries, held)
    return max(peak, _backward_peak(steps, live, sizes, prefetch))


def _forward_peak(events: list[Event], entries: list[str], sizes: dict[str, int],
                  kept: set[str], prefetch: bool) -> tuple[int, int]:
    """The bytes held at the forward's end (the kept units) and the most held during it."""
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
    return live, peak


def _backward_steps(entries: list[str], held: HeldWhole) -> list[Step]:
    """Backward's gathers in the order it makes them (the reverse of the units' entries): each
    regathered unit's, and each recomputed module's units, once, where its last unit's backward
    comes."""
    target_of = {path: target for target, group in held.recomputed.items() for path in group}
    steps: list[Step] = []
    for path in reversed(entries):
        if path in held.regathered:
            steps.append(path)
        elif path in target_of and not any(isinstance(step, list) and path in step
                                           for step in steps):
            steps.append([p for p in entries if target_of.get(p) == target_of[path]])
    return steps


def _backward_peak(steps: list[Step], live: int, sizes: dict[str, int], prefetch: bool) -> int:
    """The most held during backward, from `live` (what the forward left held)."""
    plan = [step for step in steps if isinstance(step, str)]  # the regathers
    peak = live
    ahead: set[str] = set()
    position = -1
    for step in steps:
        if isinstance(step, list):  # a recomputation: its units whole until their backward
            peak = max(peak, live + sum(sizes[p] for p in step))
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
               compute_dtype: torch.dtype | None = None, events: list[Event] | None = None,
               sample_dtype: torch.dtype | None = None) -> tuple[dict[str, int], set[int]]:
    """From one sample's forward with gradients recorded (under autocast to `compute_dtype`
    where given, the floating parameters cast to it as the gathers cast them, as training
    runs): how many times each unit's module runs, and the parameters (by id) whose values
    autograd saves for backward (a view of one counts; a copy an operator casts does not:
    backward reads the copy). `events`, where given, receives each unit's entry (path, True)
    and exit (path, False) in the order they happen. `sample_dtype`: the sample's (by default
    what `model` reads, `strategies.probe.sample_dtype`)."""
    calls = dict.fromkeys(paths, 0)
    slots: list[Slot] = [(module, name, param) for module in model.modules()
                         for name, param in module._parameters.items() if param is not None]
    casts = _compute_copies(slots, compute_dtype)
    # a saved tensor's base, by id → the parameter whose values it holds (itself, or its cast)
    origin = {id(p): id(p) for p in model.parameters()}
    origin.update({id(cast): key for key, cast in casts.items()})
    read: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in origin:
            read.add(origin[id(base)])
        return tensor

    handles = _unit_hooks(model, paths, calls, events if events is not None else [])
    device = slots[0][2].device if slots else torch.device("cpu")
    autocast: contextlib.AbstractContextManager[Any] = (
        torch.autocast(device.type, dtype=compute_dtype)
        if compute_dtype is not None and device.type != "meta" else contextlib.nullcontext())
    with (_installed(slots, casts),
          one_sample(model, sample_shape, handles, sample_dtype) as sample,
          torch.enable_grad(), autocast,
          torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.random.fork_rng(devices=[])):
        model(sample)
    return calls, read


def _compute_copies(slots: list[Slot], compute_dtype: torch.dtype | None
                    ) -> dict[int, torch.Tensor]:
    """What each floating parameter computes with (by the parameter's id): its copy in
    `compute_dtype`, as the gathers hand it; none where `compute_dtype` is None."""
    casts: dict[int, torch.Tensor] = {}
    if compute_dtype is not None:
        for _, _, param in slots:
            if param.is_floating_point() and id(param) not in casts:
                casts[id(param)] = param.to(compute_dtype)
    return casts


@contextlib.contextmanager
def _installed(slots: list[Slot], casts: dict[int, torch.Tensor]) -> Iterator[None]:
    """The parameters' compute copies in their slots, the parameters put back on leaving."""
    for module, name, param in slots:
        if id(param) in casts:
            module._parameters[name] = casts[id(param)]  # type: ignore[assignment]
    try:
        yield
    finally:
        for module, name, param in slots:
            module._parameters[name] = param


def _unit_hooks(model: nn.Module, paths: list[str], calls: dict[str, int],
                events: list[Event]) -> list[RemovableHandle]:
    """Hooks on the units' modules that count each one's calls in `calls` and append its
    entries and exits to `events`."""

    def enter(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            calls[path] += 1
            events.append((path, True))
        return hook

    def leave(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            events.append((path, False))
        return hook

    handles = [model.get_submodule(path).register_forward_pre_hook(enter(path))
               for path in paths]
    handles += [model.get_submodule(path).register_forward_hook(leave(path))
                for path in paths]
    return handles
