"""The gradient exchange of embedding tables whose gradients are row-sparse (`strategy.sparse`).

An `nn.Embedding`/`nn.EmbeddingBag` built with `sparse=True` gets a gradient that holds only the
rows its batch touched. Per table, after backward, one of (DESIGN.md, "Sparse exchange"):

- `dense`: the rows scattered into a zero table and all-reduced (what a dense model would do);
- `allgather`: every rank's (indices, rows) gathered by all, duplicates summed; the optimizer
  then updates only the touched rows, on every rank alike;
- `sharded`: each row belongs to one rank (`CyclicRows`); gradients are pushed to the owners,
  which update their rows; every other copy of a row is a cache, refreshed from its owner (the
  pull) just before a forward pass reads it. Per-rank traffic does not grow with P. The
  optimizer's state of a row (momentum, Adam's moments) is likewise true on its owner alone:
  `refresh_states` makes every copy whole from the owners before a checkpoint keeps it;
- `auto`: per table and per step, every rank's number of touched rows is all-gathered and the
  mode with the least time is taken: α–β communication plus local work, since a sparse row
  costs ~15× a dense table byte to sort, sum and update (`choose_sparse_mode`: a function of
  values every rank holds alike, so all ranks choose the same, and the collectives that follow
  match).

The optimizer receives the summed gradient (scaled like the dense buckets) as a sparse tensor
from the sparse modes, so plain SGD updates only those rows (and a dense one when `auto` chose
dense: then nearly every row was touched anyway). With momentum or weight decay, which move
every row every step, `sgd` applies it densely (`runner/optim.py`): the exchange still moves
only rows, the update is what the rule demands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from runner.core import CountedComm
from runner.core.cost import SPARSE_MODES, MachineCosts, SparseMode, choose_sparse_mode
from runner.core.sparse import (
    CyclicRows,
    allgather_sum_rows,
    coalesce_rows,
    gather_counts,
    pull_rows,
    push_rows,
)

# `strategy.sparse`: a mode for every step, or `auto`, the cheapest mode chosen per step.
SparseChoice = Literal["auto", SparseMode]
SPARSE_CHOICES: tuple[SparseChoice, ...] = ("auto", *SPARSE_MODES)

EmbeddingTable = nn.Embedding | nn.EmbeddingBag


def sparse_tables(model: nn.Module) -> list[tuple[str, EmbeddingTable]]:
    """The embedding modules of `model` whose weight gets a row-sparse gradient."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse]


@dataclass
class _Table:
    name: str
    module: EmbeddingTable
    rows: CyclicRows
    stale: bool = False  # some copies of rows this rank does not own may be out of date
    # The optimizer's state of rows this rank does not own may be out of date: it took steps
    # without their gradients (their owners had them). Only `refresh_states` clears it: a
    # state once apart stays apart, whatever mode later steps take.
    states_stale: bool = False
    dense_buffer: torch.Tensor | None = None
    modes: dict[SparseMode, int] = field(default_factory=dict)  # steps exchanged in each mode
    last: dict[str, float | str] = field(default_factory=dict)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight


class UnevenState(RuntimeError):
    """Optimizer state of a sharded table that some ranks hold and others lack: its rows cannot
    be made whole from their owners. Raised on every rank alike (decided from gathered flags).
    Synchronous training never leaves it so: every rank's table gets a gradient every step."""


class SparseGradientExchange:
    """Exchanges the gradients of `tables` over `comm` in `mode` and scales them by `scale`,
    like `GradientBuckets` does for the dense parameters (same `finish`/`zero_` protocol)."""

    def __init__(self, tables: list[tuple[str, EmbeddingTable]], comm: CountedComm, scale: float,
                 mode: SparseChoice, costs: MachineCosts) -> None:
        if mode not in SPARSE_CHOICES:  # a string from a config is not checked against the type
            raise ValueError(f"strategy.sparse must be one of {', '.join(SPARSE_CHOICES)}, "
                             f"got '{mode}'")
        self.comm, self.scale, self.mode = comm, scale, mode
        self.costs = costs
        self.tables = [_Table(name, module, CyclicRows(module.weight.shape[0], comm.size))
                       for name, module in tables]
        if mode in ("sharded", "auto") and comm.size > 1:
            for table in self.tables:
                table.module.register_forward_pre_hook(self._pull_hook(table))

    def _pull_hook(self, table: _Table) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pull_before_forward(module: nn.Module, args: tuple[Any, ...]) -> None:
            if table.stale:
                self._pull(table, torch.unique(args[0]))
        return pull_before_forward

    def _pull(self, table: _Table, wanted: torch.Tensor) -> None:
        """Every rank calls this at the same forward (the stale flag is the same everywhere)."""
        weight = table.weight
        with torch.no_grad():
            fresh = pull_rows(self.comm, table.rows, wanted, weight.detach(),
                              label=f"{table.name} pull")
            weight[wanted] = fresh

    # -- the exchange, after backward ---------------------------------------------------------

    def finish(self) -> None:
        for table in self.tables:
            self._exchange(table)

    def _local_rows(self, table: _Table) -> tuple[torch.Tensor, torch.Tensor]:
        weight, grad = table.weight, table.weight.grad
        if grad is None:  # this rank's batch did not use the table at all
            return (torch.empty(0, dtype=torch.long, device=weight.device),
                    weight.new_empty((0, *weight.shape[1:])))
        return coalesce_rows(grad._indices()[0], grad._values())  # zero_() left it sparse

    def _exchange(self, table: _Table) -> None:
        weight = table.weight
        num_rows, row_bytes = weight.shape[0], weight[0].numel() * weight.element_size()
        indices, values = self._local_rows(table)
        touched = len(indices)
        counts = None
        if self.comm.size > 1 and self.mode in ("auto", "allgather"):
            counts = gather_counts(self.comm, touched, f"{table.name} counts")
        mode: SparseMode
        if self.mode == "auto":
            # no counts: a group of one, where nothing moves and dense is the plain update
            mode = ("dense" if counts is None else
                    choose_sparse_mode(self.comm.size, num_rows, row_bytes, counts, self.costs))
        else:
            mode = self.mode
        if mode == "dense":
            if table.dense_buffer is None:
                table.dense_buffer = torch.zeros_like(weight)
            buffer = table.dense_buffer
            buffer.zero_()
            buffer.index_add_(0, indices, values)
            self.comm.allreduce_(buffer, label=f"{table.name} dense")
            weight.grad = buffer.mul_(self.scale)  # a dense update, as the buckets would give
        else:
            if mode == "allgather":
                indices, values = allgather_sum_rows(self.comm, indices, values, counts,
                                                     label=table.name)
            else:
                indices, values = push_rows(self.comm, table.rows, indices, values,
                                            label=f"{table.name} push")
                table.stale = table.states_stale = self.comm.size > 1
            weight.grad = torch.sparse_coo_tensor(indices.unsqueeze(0),
                                                  values.mul_(self.scale), weight.shape,
                                                  is_coalesced=True, check_invariants=False)
        table.modes[mode] = table.modes.get(mode, 0) + 1
        # this rank's batch: what the choice was made from
        table.last = {"mode": mode, "rows": touched, "density": touched / num_rows}

    def zero_(self) -> None:
        for table in self.tables:
            table.weight.grad = None  # a sparse gradient is replaced every step, never reused

    # -- after training -----------------------------------------------------------------------

    def refresh(self) -> None:
        """Make every copy of every table whole again (collective): each owner's rows gathered
        by all. Costs one all-gather of the table; called when training ends and before a
        checkpoint."""
        for table in self.tables:
            if table.stale:
                self._gather_owned(table, table.weight, f"{table.name} refresh")
                table.stale = False

    def refresh_states(self, states: Mapping[str, Mapping[int, torch.Tensor | None]]) -> None:
        """Collective: make every rank's copy of each table's optimizer state whole from the
        rows' owners, in place, as `refresh` does for the weights (before a checkpoint keeps
        it). `states`: per kind of state (momentum, exp_avg, ...), the parameters' tensors by
        `id` of the parameter (None: no state yet). A tensor not shaped like its table
        (one-value state: Adam's step) is left alone.

        Each rank tells the others which of the tables' tensors it holds (one small all-gather)
        before anything moves, so the collectives match even where some rank lacks one: a
        tensor no rank holds is skipped, one that only some ranks hold is refused
        (`UnevenState`, on every rank), since the owners without it have no true rows to give.
        Costs one all-gather of each state tensor of a table a sharded step made stale."""
        tables = [t for t in self.tables if t.states_stale]
        if not tables:  # the same on every rank: the modes are chosen alike
            return
        wanted = [(t, kind, held.get(id(t.weight)))
                  for t in tables for kind, held in states.items()]
        present = [tensor is not None and tensor.shape == t.weight.shape
                   for t, _, tensor in wanted]
        flags = torch.tensor(present, dtype=torch.uint8)  # host: control (flags, read as a list)
        every = torch.empty(len(present) * self.comm.size, dtype=torch.uint8)  # host: control
        self.comm.allgatherv_(flags, every, [len(present)] * self.comm.size,
                              label="state refresh flags")
        holders = every.view(self.comm.size, len(present)).sum(dim=0).tolist()
        for (table, kind, _), count in zip(wanted, holders, strict=True):
            if 0 < count < self.comm.size:
                raise UnevenState(f"optimizer state '{kind}' of the sharded table {table.name} "
                                  f"is held by {count} of {self.comm.size} ranks: its rows "
                                  f"cannot be made whole from their owners")
        for (table, _, tensor), count in zip(wanted, holders, strict=True):
            if count:
                assert tensor is not None  # every rank holds it
                self._gather_owned(table, tensor, f"{table.name} state refresh")
        for table in tables:
            table.states_stale = False

    def _gather_owned(self, table: _Table, tensor: torch.Tensor, label: str) -> None:
        """Every rank's copy of `tensor` (shaped like `table`'s weight) made whole: each
        owner's rows gathered by all (one all-gather)."""
        with torch.no_grad():
            owned = [table.rows.owned(k, tensor.device) for k in range(self.comm.size)]
            row_elements = tensor[0].numel() if len(tensor) else 0
            gathered = tensor.new_empty(tensor.shape)
            self.comm.allgatherv_(tensor.detach()[owned[self.comm.rank]].contiguous(),
                                  gathered, [len(o) * row_elements for o in owned], label=label)
            tensor[torch.cat(owned)] = gathered

    def report(self) -> dict[str, dict[str, Any]]:
        """Per table: the last step's mode, rows and density; the steps spent in each mode."""
        return {t.name: {**t.last, "steps_by_mode": dict(t.modes)} for t in self.tables}
