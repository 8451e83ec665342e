"""The units of sharded data parallelism (`strategies.fsdp`): which modules' parameters are
gathered together, each parameter split by rows over the ranks, and the gather itself.

A unit is a module (`strategy.units`: every child of the model's largest repeated stack by
default, the whole model for the rest); its parameters are those it holds that no inner unit
holds, a parameter held by modules of several units going to the innermost unit holding them
all (a tied embedding and head: their common ancestor). A parameter is split by rows (dim 0)
over the P ranks, balanced (`Partition`: pieces differing by one row), and a rank keeps its
piece as the module's own parameter: the optimizer, its state and the checkpoints see pieces
only, each placed in its global tensor (`place_rows`). A parameter of fewer rows than ranks
stays whole on every rank (its gradient all-reduced, as under `data`).

`ShardedUnit.gather` puts a unit's whole parameters together in one collective: every
parameter's piece, padded to its longest piece, packed into one buffer in the same order on every
rank, all-gathered (`runner.core.primitives.all_gather`), and each whole parameter cut out of the
ranks' blocks. Packing, padding and cutting are autograd's own (cat, pad, views); the gather's
backward is its adjoint, the reduce-scatter, so each rank's pieces receive the sum over the ranks
of their rows' gradients (scaled by 1/P: the mean of the ranks' losses). Stage 1 keeps the whole
gradient instead and reduce-scatters it once backward is done (`DeferredGradient`); so does every
stage on a step's micro-batches before its last (`trainer.accumulate_steps`), whose backward adds
the kept gradient to its own before the unit's one reduce-scatter of the step.

A gather may also be issued ahead of its use (`start_gather`: the pieces packed and the
all-gather started without waiting) and completed when the unit needs its parameters
(`gather(started)`): the same collective, the same bytes, its backward the same reduce-scatter
(`all_gather_wait`), the buffer counted as gathered from the moment it is issued.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from runner.core import CountedComm, Partition
from runner.core.placement import place_rows
from runner.core.primitives import (
    GatherInFlight,
    all_gather,
    all_gather_op,
    all_gather_start,
    all_gather_wait,
    reduce_scatter_op,
)

ROOT = ""  # the path of the whole model's unit


# Modules that hold others but are never called (their members are): a unit's gather runs
# before its module's forward, so one of these can never be a unit.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _matches(path: str, module: nn.Module, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern) or type(module).__name__ == pattern


def unit_paths(model: nn.Module, units: str | list[str]) -> list[str]:
    """The modules whose parameters are gathered together, by path, the whole model's ("")
    first: for "auto", each child of the model's stack (`nn.ModuleList` or `nn.Sequential`) of
    the most parameters in two children or more, else each child of the model that holds
    parameters; else the outermost modules whose path or class name a pattern matches."""
    paths = [ROOT]
    if units == "auto":
        stacks = [(sum(p.numel() for p in m.parameters()), name, m)
                  for name, m in model.named_modules()
                  if isinstance(m, (nn.ModuleList, nn.Sequential))
                  and sum(1 for c in m.children() if any(True for _ in c.parameters())) >= 2]
        if stacks:
            _, name, stack = max(stacks, key=lambda s: s[0])
            prefix = f"{name}." if name else ""
            paths += [f"{prefix}{child}" for child, module in stack.named_children()
                      if any(True for _ in module.parameters())]
        else:
            for child, module in model.named_children():
                if isinstance(module, CONTAINERS):  # its forward never runs: its members
                    paths += [f"{child}.{name}" for name, member in module.named_children()
                              if any(True for _ in member.parameters())]
                elif any(True for _ in module.parameters()):
                    paths.append(child)
        return paths
    patterns = [units] if isinstance(units, str) else list(units)
    matched = [name for name, module in model.named_modules()
               if name and any(_matches(name, module, p) for p in patterns)]
    # the outermost matches (`*` runs over dots, as in a plan's patterns: `blocks.*` is each
    # block, not each of its parts too)
    return paths + [name for name in matched
                    if not any(within(name, other) for other in matched if other != name)]


def container_units(model: nn.Module, units: str | list[str]) -> list[str]:
    """The modules `units` names that are containers (`CONTAINERS`), which never run."""
    return [name for name in unit_paths(model, units)
            if name and isinstance(model.get_submodule(name), CONTAINERS)]


def unmatched_patterns(model: nn.Module, units: str | list[str]) -> list[str]:
    """The patterns of `units` that match no module (by path or class name)."""
    if units == "auto":
        return []
    patterns = [units] if isinstance(units, str) else list(units)
    return [p for p in patterns
            if not any(name and _matches(name, module, p)
                       for name, module in model.named_modules())]


@dataclass
class Holder:
    """A module's parameter slot: `module._parameters[name]`."""

    module: nn.Module
    name: str


@dataclass
class SplitParameter:
    """A parameter of a unit, split by rows over the ranks: its slots (more than one where
    the parameter is tied), its whole shape and the rows each rank holds."""

    path: str  # its name in the model
    holders: list[Holder]
    shape: torch.Size
    rows: Partition
    # held whole by every rank of a model group (grid.pr > 1): its pieces' gradients are
    # summed over the model group too
    summed_over_model: bool = False

    @property
    def row_elements(self) -> int:
        return self.shape[1:].numel()

    @property
    def padded(self) -> int:
        """Elements of each rank's block of it in the packed buffer (the longest piece)."""
        return max(self.rows.sizes) * self.row_elements


UnitParameters = list[tuple[str, list[Holder], nn.Parameter]]  # (name, slots, parameter)


def trains(params: UnitParameters) -> bool:
    """Whether any of a unit's parameters needs gradients."""
    return any(p.requires_grad for _, _, p in params)


def unit_parameters(model: nn.Module, paths: list[str]) -> dict[str, UnitParameters]:
    """Each unit's parameters (name, slots, parameter) in `named_parameters` order: a
    parameter goes to the innermost unit holding every module that holds it."""
    holders: dict[int, list[Holder]] = {}
    holder_paths: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append(Holder(module, pname))
                holder_paths.setdefault(id(param), []).append(name)
    found: dict[str, UnitParameters] = {p: [] for p in paths}
    ordered = sorted(paths, key=lambda p: -len(p.split(".")) if p else 0)
    for name, param in model.named_parameters():
        owners = holder_paths[id(param)]
        unit = next((u for u in ordered if all(within(o, u) for o in owners)), ROOT)
        found[unit].append((name, holders[id(param)], param))
    return found


def within(path: str, unit: str) -> bool:
    """Whether the module at `path` is `unit`'s module or inside it."""
    return unit == ROOT or path == unit or path.startswith(unit + ".")


@dataclass
class ShardedParameters:
    """A model's parameters over `ranks` ranks: each unit's split by rows (`split`, by unit
    path), and those of fewer rows than ranks, whole on every rank (`whole`, by name)."""

    split: dict[str, UnitParameters]
    whole: list[tuple[str, nn.Parameter]]
    ranks: int

    @staticmethod
    def of(model: nn.Module, units: str | list[str], ranks: int) -> ShardedParameters:
        """The parameters of `model`'s units (`unit_paths`) over `ranks` ranks."""
        split: dict[str, UnitParameters] = {}
        whole: list[tuple[str, nn.Parameter]] = []
        for path, params in unit_parameters(model, unit_paths(model, units)).items():
            split[path] = [(n, h, p) for n, h, p in params if p.dim() and p.shape[0] >= ranks]
            whole += [(n, p) for n, h, p in params if not (p.dim() and p.shape[0] >= ranks)]
        return ShardedParameters(split, whole, ranks)


@dataclass(frozen=True)
class Sharding:
    """What a model's units are sharded by, the same for each: the ranks that split their
    parameters (`comm`), the stage, the gradients' factor (None: 1/P of those ranks, the mean
    of their losses; on a grid of Pr x Pc ranks 1/(Pr Pc)) and, on a grid of Pr > 1, the model
    group and the ids of the parameters every rank of a model group holds whole, whose pieces'
    gradients are summed over the model group too."""

    comm: CountedComm
    stage: int
    scale: float | None = None
    model_comm: CountedComm | None = None
    summed: frozenset[int] = frozenset()


@dataclass
class HeldBytes:
    """Bytes a sharded model holds beyond its pieces, live and at their peak: whole
    parameters from a unit's gather until nothing needs them (its forward's end, or its
    backward's where autograd keeps them), and stage 1's whole gradients until they are
    scattered."""

    live: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        self.live -= nbytes


class DeferredGradient(Function):
    """Identity on the gathered `whole`; backward keeps its gradient in `unit.pending` (stage
    1: reduce-scattered once backward is done) and passes none on. `packed` (the pieces, which
    need gradients) only makes autograd run this backward."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, packed: torch.Tensor,
                unit: ShardedUnit) -> torch.Tensor:
        ctx.unit = unit
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        unit: ShardedUnit = ctx.unit
        if unit.pending is None:
            unit.pending = grad.clone()
            unit.whole_gradients.add(unit.whole_bytes)
        else:
            unit.pending += grad
        unit.backward_done()
        return None, None, None


class ScaleGradient(Function):
    """Identity forward; backward scales the gradient (1/P: the mean of the ranks' losses)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


@dataclass
class ShardedUnit:
    """One unit: its split parameters and the communicator whose ranks split them."""

    path: str
    module: nn.Module
    params: list[SplitParameter]
    comm: CountedComm
    stage: int
    pending: torch.Tensor | None = None  # stage 1: the whole gradient of this step
    backward_copies: list[torch.Tensor] | None = field(default=None, repr=False)
    # what the model holds beyond its pieces (shared by its units)
    gathered: HeldBytes = field(default_factory=HeldBytes, repr=False)
    whole_gradients: HeldBytes = field(default_factory=HeldBytes, repr=False)
    kept: bool = False  # stages 1 and 2: autograd keeps this forward's whole parameters
    gather_dtype: torch.dtype | None = None  # None: the parameters' own
    # a micro-batch before a step's last: the whole gradient kept in `pending`, not scattered
    accumulating: bool = False
    # recomputed in backward (`trainer.activation_checkpointing` names its module): gathered
    # inside its recomputation, not by the module's hooks
    recomputed: bool = False
    # the gradients' factor (None: 1/P of the sharding ranks: the mean of their losses; on a
    # grid of Pr x Pc ranks 1/(Pr Pc))
    scale: float | None = None
    # grid.pr > 1: the model group, over which the pieces of parameters every rank of a model
    # group holds are summed
    model_comm: CountedComm | None = None

    @staticmethod
    def split(path: str, module: nn.Module, params: UnitParameters, sharding: Sharding,
              gather_dtype: torch.dtype | None = None) -> ShardedUnit:
        """Replace each parameter's slots by this rank's rows of it; `gather_dtype`: the type
        the whole parameters are gathered in (bf16 training: half the bytes, the pieces and
        their optimizer state staying float32), None: the parameters' own."""
        comm, model_comm = sharding.comm, sharding.model_comm
        split = []
        for name, holders, param in params:
            rows = Partition(param.shape[0], comm.size)
            piece = nn.Parameter(param.detach()[rows.slice(comm.rank)].clone(),
                                 requires_grad=param.requires_grad)
            place_rows(piece, param, rows.slice(comm.rank))
            for holder in holders:
                holder.module._parameters[holder.name] = piece
            split.append(SplitParameter(name, holders, param.shape, rows,
                                        model_comm is not None and id(param) in sharding.summed))
        return ShardedUnit(path, module, split, comm, sharding.stage, gather_dtype=gather_dtype,
                           scale=sharding.scale, model_comm=model_comm)

    @property
    def whole_bytes(self) -> int:
        """Bytes of the unit's whole parameters."""
        return sum(p.shape.numel() for p in self.params) * self.comm_itemsize

    @property
    def comm_itemsize(self) -> int:
        """Bytes of one element as gathered."""
        dtype = self.gather_dtype or self.pieces()[0].dtype
        return dtype.itemsize

    @property
    def label(self) -> str:
        return f"fsdp {self.path or '(model)'}"

    @property
    def gradient_scale(self) -> float:
        return 1.0 / self.comm.size if self.scale is None else self.scale

    def sum_over_model(self, block: torch.Tensor) -> torch.Tensor:
        """This rank's reduce-scattered gradient block (the packed layout), its parameters held
        by every rank of a model group summed over that group (one all-reduce of their
        padded pieces): the sum over every rank that computed a gradient of their rows."""
        summed = [(offset, p.padded) for offset, p in zip(self._offsets(), self.params,
                                                          strict=True) if p.summed_over_model]
        if not summed or self.model_comm is None:
            return block
        together = torch.cat([block[o:o + n] for o, n in summed])
        self.model_comm.allreduce_(together, label=self.label)
        block = block.clone()
        start = 0
        for offset, n in summed:
            block[offset:offset + n] = together[start:start + n]
            start += n
        return block

    def _offsets(self) -> list[int]:
        offsets, offset = [], 0
        for p in self.params:
            offsets.append(offset)
            offset += p.padded
        return offsets

    @property
    def width(self) -> int:
        """Elements of each rank's packed buffer."""
        return sum(p.padded for p in self.params)

    def pieces(self) -> list[torch.Tensor]:
        """What the slots hold now: this rank's pieces (or, during the unit's forward, the
        whole parameters)."""
        found = [p.holders[0].module._parameters[p.holders[0].name] for p in self.params]
        assert all(t is not None for t in found)
        return [t for t in found if t is not None]

    def _packed(self) -> torch.Tensor:
        """This rank's pieces, each padded to its longest piece, in one buffer (autograd's own
        cat and pad: differentiable when grad mode is on)."""
        pieces = self.pieces()
        if self.gather_dtype is not None:  # a cast: its backward casts the gradient back
            pieces = [piece.to(self.gather_dtype) for piece in pieces]
        return torch.cat([torch.nn.functional.pad(piece.reshape(-1),
                                                  (0, p.padded - piece.numel()))
                          for p, piece in zip(self.params, pieces, strict=True)])

    @property
    def _partition(self) -> Partition:
        """The ranks' blocks of the packed buffers."""
        return Partition(self.width * self.comm.size, self.comm.size)

    def start_gather(self) -> GatherInFlight:
        """Issue this unit's gather without waiting for it (a prefetch): its buffer counts as
        gathered from now; `gather(started)` completes it, `drop_gather` discards it. The
        pieces must not change before then."""
        with torch.no_grad():
            packed = self._packed()
        started = all_gather_start(packed, self.comm, 0, self._partition, self.label)
        self.gathered.add(self.whole_bytes)
        return started

    def drop_gather(self, started: GatherInFlight) -> None:
        """Complete a gather issued ahead that nothing used, and free its buffer."""
        started.wait()
        self.gathered.sub(self.whole_bytes)

    def gather(self, started: GatherInFlight | None = None) -> list[torch.Tensor]:
        """The whole parameters, differentiable when grad mode is on (see the module doc).
        `started`: this unit's gather issued earlier (`start_gather`), waited for here in place
        of a new one; where gradients are wanted, the pieces are packed again (the same
        values) for autograd to differentiate, so that the gather's backward nodes come
        after the computation before this use, as a blocking gather's do."""
        size, ranks = self.width, self.comm.size
        part = self._partition
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.pieces())
        if not grad:
            whole = (started.wait() if started is not None
                     else all_gather_op(self._packed(), self.comm, 0, part, self.label))
        elif self.stage == 1 or self.accumulating:
            packed = self._packed()
            whole = DeferredGradient.apply(
                started.wait() if started is not None
                else all_gather_op(packed.detach(), self.comm, 0, part, self.label),
                packed, self)
        else:
            packed = self._packed()
            whole = ScaleGradient.apply(
                all_gather_wait(packed, started) if started is not None
                else all_gather(packed, self.comm, 0, part, self.label), self.gradient_scale)
            if any(p.summed_over_model for p in self.params):
                packed.register_hook(self.sum_over_model)
            if self.pending is not None:  # the earlier micro-batches' gradient joins this one's
                whole.register_hook(self._add_pending)
            # the reduce-scatter is done: the copies for backward (stage 3) or the whole
            # parameters autograd kept (stage 2) go
            packed.register_hook(lambda grad: self.backward_done())
        # Each parameter's column of the ranks' blocks, cut in one split: its backward writes
        # the unit's gradient once (a view per rank and parameter would zero-fill a whole
        # unit's buffer for each, P × parameters times).
        columns = torch.split(whole.view(ranks, size), [p.padded for p in self.params], dim=1)
        wholes = []
        for p, column in zip(self.params, columns, strict=True):
            sizes = p.rows.sizes
            if all(n == sizes[0] for n in sizes):  # every rank's block full: one reshape
                wholes.append(column.reshape(p.shape))
            else:  # uneven rows: each rank's block cut to its rows
                wholes.append(torch.cat([block[:n * p.row_elements] for block, n
                                         in zip(column.unbind(0), sizes, strict=True)])
                              .view(p.shape))
        return wholes

    def _add_pending(self, grad: torch.Tensor) -> torch.Tensor:
        """The step's last micro-batch: the gradient kept over the earlier ones added to its
        own before the one reduce-scatter (once, where a unit runs twice)."""
        if self.pending is None:
            return grad
        kept, self.pending = self.pending, None
        self.whole_gradients.sub(self.whole_bytes)
        return grad + kept

    def install(self, wholes: list[torch.Tensor]) -> None:
        for p, whole in zip(self.params, wholes, strict=True):
            for holder in p.holders:
                holder.module._parameters[holder.name] = whole  # type: ignore[assignment]

    def reshard(self, pieces: list[torch.Tensor]) -> None:
        for p, piece in zip(self.params, pieces, strict=True):
            for holder in p.holders:
                holder.module._parameters[holder.name] = piece  # type: ignore[assignment]

    def copies_for_backward(self, started: GatherInFlight | None = None) -> list[torch.Tensor]:
        """Stage 3: the whole parameters again, for backward (gathered once per step);
        `started`: that gather, issued ahead (`start_gather`)."""
        if self.backward_copies is None:
            with torch.no_grad():
                self.backward_copies = self.gather(started)
            if started is None:
                self.gathered.add(self.whole_bytes)
        elif started is not None:
            self.drop_gather(started)
        return self.backward_copies

    def forward_done(self) -> None:
        """The unit's forward ended: its whole parameters go unless autograd keeps them."""
        if not self.kept:
            self.gathered.sub(self.whole_bytes)

    def backward_done(self) -> None:
        """The unit's gradients are scattered (or kept, stage 1): what it gathered goes."""
        if self.backward_copies is not None:
            self.backward_copies = None
            self.gathered.sub(self.whole_bytes)
        if self.kept:
            self.kept = False
            self.gathered.sub(self.whole_bytes)

    def finish(self) -> None:
        """Stage 1 (and a micro-batch's unit that the last did not run): reduce-scatter the
        whole gradient kept over backward into the pieces."""
        if self.pending is None:
            return
        grad, self.pending = self.pending, None
        self.whole_gradients.sub(self.whole_bytes)
        ranks = self.comm.size
        own = self.sum_over_model(reduce_scatter_op(
            grad, self.comm, 0, Partition(self.width * ranks, ranks), self.label)
            * self.gradient_scale)
        offset = 0
        for p, piece in zip(self.params, self.pieces(), strict=True):
            n = p.rows.sizes[self.comm.rank] * p.row_elements
            if piece.requires_grad:
                part = own[offset:offset + n].view(piece.shape).to(piece.dtype)
                if piece.grad is None:
                    piece.grad = part.clone()
                else:
                    piece.grad += part
            offset += p.padded
