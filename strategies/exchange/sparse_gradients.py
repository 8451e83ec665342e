"""The gradient exchange of embedding tables whose gradients are row-sparse (`strategy.sparse`).

An `nn.Embedding`/`nn.EmbeddingBag` built with `sparse=True` gets a gradient that holds only the
rows its batch touched. Per table, after backward, one of (docs/design.md, "Sparse exchange"):

- `dense`: the rows scattered into a zero table and all-reduced (what a dense model would do);
- `allgather`: every rank's (indices, rows) gathered by all, duplicates summed; the optimizer
  then updates only the touched rows, on every rank alike;
- `sharded` (Parallax's sparse variables, Kim et al., EuroSys 2019): the table lives on its
  owners only. The rows are cut into K contiguous blocks (`BlockRows`), and rank k < K keeps
  block k as the module's parameter, shape (owned rows, dim), so the optimizer's state is only
  those rows too. A forward looks every id of the batch up in a per-step working buffer of the
  batch's distinct rows: owned rows read locally, the H replicated hot rows (below) from their
  own parameter, the others pulled from their owners. After backward the buffer's gradient
  rows are pushed to their owners, which hand their parameter a row-sparse gradient (nothing
  densifies); the hot rows' gradient is all-reduced (H rows), so every rank updates its
  replica exactly as one process would. Per-rank traffic does not grow with P.
- `auto`: per table, once, from the cost model and the rows a batch is expected to touch: the
  owners-only `sharded` when it is cheapest (a table that lives on its owners cannot switch
  back to a full copy from one step to the next); otherwise, per step, every rank's number of
  touched rows is all-gathered and the cheaper of `dense` and `allgather` is taken (α–β
  communication plus local work: `choose_sparse_mode`, a function of values every rank holds
  alike, so all ranks choose the same, and the collectives that follow match).

Hot rows (`strategy.sparse_hot_rows` = H): at the first forward every rank's distinct ids are
all-gathered, and the rows read by the most ranks are replicated, as many as the cost model
finds worth an all-reduce (`choose_hot_rows`), at most H. Their values come from their owners
once; the owners' copies of them then go stale and are written back before a checkpoint
(`refresh`, `refresh_states`). The choice (`hot_ids`) and the replicas (`hot_weight`) are a
buffer and a parameter of the table's module, so a checkpoint keeps them and a resume on any
grid continues with the same hot rows.

The optimizer receives the summed gradient (scaled like the dense buckets) as a sparse tensor
from the sparse modes, so plain SGD updates only those rows (and a dense one when `auto` chose
dense: then nearly every row was touched anyway). With momentum or weight decay, which move
every row every step, `sgd` applies it densely (`runner/optim/sync.py`): the exchange still moves
only rows, the update is what the rule demands.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm
from runner.core import placement as placements
from runner.core.row_sparse import (
    BlockRows,
    NodeRoutes,
    allgather_sum_rows,
    coalesce_rows,
    gather_counts,
    pull_rows,
    push_rows,
    push_rows_by_node,
)
from runner.cost.collectives import (
    SPARSE_MODES,
    MachineCosts,
    SparseMode,
    choose_hot_rows,
    choose_sparse_mode,
)

# `strategy.sparse`: a mode for every step, or `auto`, the cheapest mode chosen per step.
SparseChoice = Literal["auto", SparseMode]
SPARSE_CHOICES: tuple[SparseChoice, ...] = ("auto", *SPARSE_MODES)
PER_STEP_MODES: tuple[SparseMode, ...] = ("dense", "allgather")  # tables every rank holds whole

EmbeddingTable = nn.Embedding | nn.EmbeddingBag

# What an owners-only table adds to its module: the replicated hot rows and which rows they are
# (−1: a slot left empty; −2 everywhere: not chosen yet). Not in the sequential model: a
# checkpoint keeps them for a resume under the same exchange, one process ignores them.
HOT_WEIGHT, HOT_IDS = "hot_weight", "hot_ids"
_NOT_CHOSEN = -2


def is_hot_row_tensor(name: str) -> bool:
    """`name` (a `state_dict` name) is a table's hot-row replica or its ids."""
    return name.rsplit(".", 1)[-1] in (HOT_WEIGHT, HOT_IDS)


def sparse_tables(model: nn.Module) -> list[tuple[str, EmbeddingTable]]:
    """The embedding modules of `model` whose weight gets a row-sparse gradient."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse]


@dataclass
class _Step:
    """An owners-only table's working buffer of one forward: the batch's distinct ids, their
    rows (a leaf: its gradient is the batch's gradient rows) and where each came from."""

    ids: torch.Tensor
    rows: torch.Tensor
    hot: torch.Tensor  # mask: a replicated hot row
    hot_slots: torch.Tensor  # their slots in `hot_weight`


@dataclass
class _Table:
    name: str
    module: EmbeddingTable
    num_rows: int
    owners: BlockRows | None = None  # set: the table lives on its owners only
    hot_limit: int = 0
    steps: list[_Step] = field(default_factory=list)  # forwards since the last exchange
    most_pulled: int = 0  # the largest working set pulled from other ranks
    dense_buffer: torch.Tensor | None = None
    modes: dict[SparseMode, int] = field(default_factory=dict)  # steps exchanged in each mode
    last: dict[str, float | str] = field(default_factory=dict)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def row_bytes(self) -> int:
        weight = self.weight
        return int(weight[0].numel() if len(weight) else weight.shape[1:].numel()) \
            * weight.element_size()

    @property
    def hot_weight(self) -> nn.Parameter | None:
        hot = getattr(self.module, HOT_WEIGHT, None)
        return hot if isinstance(hot, nn.Parameter) else None

    def hot_ids(self) -> torch.Tensor:
        """The chosen hot rows, ascending (their slots in `hot_weight`, in order)."""
        ids: torch.Tensor | None = getattr(self.module, HOT_IDS, None)
        return (torch.empty(0, dtype=torch.long, device=self.weight.device) if ids is None
                else ids[ids >= 0])

    def hot_chosen(self) -> bool:
        ids: torch.Tensor | None = getattr(self.module, HOT_IDS, None)
        return ids is None or bool((ids != _NOT_CHOSEN).any())


class UnevenState(RuntimeError):
    """A hot-row replica's optimizer state without the owned rows' state to write it back into
    (or the other way round): the checkpoint would keep stale rows. Raised on every rank alike:
    synchronous training gives every parameter a gradient every step."""


class SparseGradientExchange:
    """Exchanges the gradients of `tables` over `comm` in `mode` and scales them by `scale`,
    like `GradientBuckets` does for the dense parameters (same `finish`/`zero_` protocol).

    `owners_only`: under `auto`, the tables (by name) that live on their owners (`sharded`);
    under `sharded`, every table does. `parts`: per table, how many ranks own its rows (the
    first K; P when absent). `hot_rows`: the most rows replicated on every rank (0: none).
    `node_routes`: per table, the ranks' nodes when its push sums a node's rows first
    (`push_rows_by_node`). Building it replaces each owners-only table's weight by this rank's
    block of rows."""

    def __init__(self, tables: list[tuple[str, EmbeddingTable]], comm: CountedComm, scale: float,
                 mode: SparseChoice, costs: MachineCosts, *, owners_only: Collection[str] = (),
                 parts: Mapping[str, int] | None = None, hot_rows: int = 0,
                 node_routes: Mapping[str, NodeRoutes] | None = None) -> None:
        if mode not in SPARSE_CHOICES:  # a string from a config is not checked against the type
            raise ValueError(f"strategy.sparse must be one of {', '.join(SPARSE_CHOICES)}, "
                             f"got '{mode}'")
        self.comm, self.scale, self.mode = comm, scale, mode
        self.costs = costs
        self.tables = [_Table(name, module, module.weight.shape[0]) for name, module in tables]
        self.node_routes = dict(node_routes or {})
        for table in self.tables:
            if comm.size > 1 and (mode == "sharded"
                                  or (mode == "auto" and table.name in owners_only)):
                self._keep_owned_rows(table, (parts or {}).get(table.name, comm.size), hot_rows)

    # -- owners-only storage ------------------------------------------------------------------

    def _keep_owned_rows(self, table: _Table, parts: int, hot_rows: int) -> None:
        module = table.module
        if module.max_norm is not None:  # renormalises the rows it reads in place
            raise ValueError(f"table {table.name}: max_norm is not supported by "
                             f"strategy.sparse=sharded (rows live on their owners)")
        if not 1 <= parts <= self.comm.size:
            raise ValueError(f"table {table.name}: {parts} owners for {self.comm.size} ranks")
        full = module.weight
        table.owners = BlockRows(table.num_rows, parts)
        block = table.owners.block(self.comm.rank)
        owned = nn.Parameter(full.detach()[block].clone(), requires_grad=full.requires_grad)
        placements.place_rows(owned, full, block)
        module.weight = owned
        prefix = f"{table.name}." if table.name else ""
        table.hot_limit = min(hot_rows, table.num_rows)
        if table.hot_limit:
            hot = nn.Parameter(full.detach().new_zeros((table.hot_limit, *full.shape[1:])),
                               requires_grad=full.requires_grad)
            ids = torch.full((table.hot_limit,), _NOT_CHOSEN, dtype=torch.long,
                             device=full.device)
            if placements.placement_of(full) is not None:
                placements.place_whole_tensor(hot, prefix + HOT_WEIGHT)
                placements.place_whole_tensor(ids, prefix + HOT_IDS)
            module.register_parameter(HOT_WEIGHT, hot)
            module.register_buffer(HOT_IDS, ids)
        module.forward = self._owned_rows_forward(table)  # type: ignore[method-assign]

    def _owned_rows_forward(self, table: _Table) -> Callable[..., torch.Tensor]:
        module = table.module

        def forward(input: torch.Tensor, offsets: torch.Tensor | None = None,
                    per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
            ids, local = torch.unique(input, sorted=True, return_inverse=True)
            rows = self._working_rows(table, ids)
            padding = None
            if module.padding_idx is not None:  # the padding row's place in the buffer, if read
                at = int(torch.searchsorted(ids, module.padding_idx))
                padding = at if at < len(ids) and int(ids[at]) == module.padding_idx else None
            if isinstance(module, nn.EmbeddingBag):
                return F.embedding_bag(local, rows.rows, offsets, None, module.norm_type,
                                       module.scale_grad_by_freq, module.mode, False,
                                       per_sample_weights, module.include_last_offset, padding)
            return F.embedding(local, rows.rows, padding, None, module.norm_type,
                               module.scale_grad_by_freq, False)
        return forward

    def _working_rows(self, table: _Table, ids: torch.Tensor) -> _Step:
        """Collective: the rows `ids` (distinct, ascending) of the table, from this rank's
        block, the hot replicas and, for the rest, their owners (the pull)."""
        assert table.owners is not None
        if not table.hot_chosen():
            self._choose_hot_rows(table, ids)
        weight, hot_weight = table.weight, table.hot_weight
        hot_ids = table.hot_ids().to(ids.device)
        slots = torch.searchsorted(hot_ids, ids).clamp_(max=max(len(hot_ids) - 1, 0))
        hot = (hot_ids[slots] == ids) if len(hot_ids) else torch.zeros_like(ids, dtype=torch.bool)
        with torch.no_grad():
            rows = weight.new_empty((len(ids), *weight.shape[1:]))
            if hot_weight is not None:
                rows[hot] = hot_weight[slots[hot]]
            elsewhere = torch.nonzero(~hot).flatten()
            rows[elsewhere] = pull_rows(self.comm, table.owners, ids[elsewhere], weight.detach(),
                                        label=f"{table.name} pull")
        mine = int((table.owners.owner(ids[elsewhere]) == self.comm.rank).sum())
        table.most_pulled = max(table.most_pulled, len(elsewhere) - mine)
        if torch.is_grad_enabled() and weight.requires_grad:
            rows.requires_grad_(True)
            table.steps.append(_Step(ids, rows, hot, slots[hot]))
        return _Step(ids, rows, hot, slots[hot])

    def _choose_hot_rows(self, table: _Table, ids: torch.Tensor) -> None:
        """Collective, once: the rows most ranks read at this first forward, as many as the
        cost model finds worth replicating; their values from their owners."""
        assert table.owners is not None and table.hot_weight is not None
        counts = gather_counts(self.comm, len(ids), f"{table.name} hot counts")
        every = ids.new_empty(sum(counts))
        self.comm.allgatherv_(ids.contiguous(), every, counts, label=f"{table.name} hot ids")
        rows, readers = torch.unique(every, return_counts=True)
        chosen = choose_hot_rows(rows.tolist(), readers.tolist(), table.hot_limit,
                                 self.comm.size, table.row_bytes, self.costs)
        hot_ids: torch.Tensor = getattr(table.module, HOT_IDS)
        hot_ids.fill_(-1)
        hot_ids[:len(chosen)] = torch.tensor(chosen, dtype=torch.long, device=hot_ids.device)
        with torch.no_grad():
            table.hot_weight[:len(chosen)] = pull_rows(
                self.comm, table.owners, hot_ids[:len(chosen)], table.weight.detach(),
                label=f"{table.name} hot pull")

    # -- the exchange, after backward ---------------------------------------------------------

    def finish(self) -> None:
        for table in self.tables:
            if table.owners is not None:
                self._exchange_owned(table)
            else:
                self._exchange(table)

    def _local_rows(self, table: _Table) -> tuple[torch.Tensor, torch.Tensor]:
        weight, grad = table.weight, table.weight.grad
        if grad is None:  # this rank's batch did not use the table at all
            return (torch.empty(0, dtype=torch.long, device=weight.device),
                    weight.new_empty((0, *weight.shape[1:])))
        return coalesce_rows(grad._indices()[0], grad._values())  # zero_() left it sparse

    def _exchange_owned(self, table: _Table) -> None:
        """Push the working buffer's gradient rows to their owners; all-reduce the hot rows'."""
        assert table.owners is not None
        weight = table.weight
        # every forward since the last exchange whose rows got a gradient (none: this rank's
        # batch did not use the table); duplicates are summed below
        used = [step for step in table.steps if step.rows.grad is not None]
        table.steps = []
        ids = torch.cat([torch.empty(0, dtype=torch.long, device=weight.device),
                         *(step.ids for step in used)])
        grads = torch.cat([weight.new_empty((0, *weight.shape[1:])),
                           *(step.rows.grad for step in used if step.rows.grad is not None)])
        hot = torch.cat([torch.zeros(0, dtype=torch.bool, device=weight.device),
                         *(step.hot for step in used)])
        slots = torch.cat([torch.empty(0, dtype=torch.long, device=weight.device),
                           *(step.hot_slots for step in used)])
        hot_weight = table.hot_weight
        chosen = len(table.hot_ids())
        if hot_weight is not None and chosen:
            summed = hot_weight.new_zeros((chosen, *hot_weight.shape[1:]))
            summed.index_add_(0, slots, grads[hot])
            self.comm.allreduce_(summed, label=f"{table.name} hot")
            hot_grad = torch.zeros_like(hot_weight)
            hot_grad[:chosen] = summed.mul_(self.scale)
            hot_weight.grad = hot_grad
        routes = self.node_routes.get(table.name)
        if routes is None:
            indices, values = push_rows(self.comm, table.owners, ids[~hot], grads[~hot],
                                        label=f"{table.name} push")
        else:
            indices, values = push_rows_by_node(self.comm, table.owners, routes, ids[~hot],
                                                grads[~hot], label=f"{table.name} push")
        block = table.owners.block(self.comm.rank)
        weight.grad = torch.sparse_coo_tensor((indices - block.start).unsqueeze(0),
                                              values.mul_(self.scale), weight.shape,
                                              is_coalesced=True, check_invariants=False)
        table.modes["sharded"] = table.modes.get("sharded", 0) + 1
        table.last = {"mode": "sharded", "rows": len(ids), "density": len(ids) / table.num_rows}

    def _exchange(self, table: _Table) -> None:
        weight = table.weight
        num_rows, row_bytes = weight.shape[0], table.row_bytes
        indices, values = self._local_rows(table)
        touched = len(indices)
        counts = None
        if self.comm.size > 1 and self.mode in ("auto", "allgather"):
            counts = gather_counts(self.comm, touched, f"{table.name} counts")
        mode: SparseMode
        if self.mode == "auto":
            # no counts: a group of one, where nothing moves and dense is the plain update
            mode = ("dense" if counts is None else
                    choose_sparse_mode(self.comm.size, num_rows, row_bytes, counts, self.costs,
                                       PER_STEP_MODES))
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
        else:  # allgather (a group of one under `sharded`: its own rows)
            indices, values = allgather_sum_rows(self.comm, indices, values, counts,
                                                 label=table.name)
            weight.grad = torch.sparse_coo_tensor(indices.unsqueeze(0),
                                                  values.mul_(self.scale), weight.shape,
                                                  is_coalesced=True, check_invariants=False)
        table.modes[mode] = table.modes.get(mode, 0) + 1
        # this rank's batch: what the choice was made from
        table.last = {"mode": mode, "rows": touched, "density": touched / num_rows}

    def zero_(self) -> None:
        for table in self.tables:
            table.weight.grad = None  # a sparse gradient is replaced every step, never reused
            table.steps = []
            if table.hot_weight is not None:
                table.hot_weight.grad = None

    # -- checkpoints and the end of training --------------------------------------------------

    def _hot_owned_here(self, table: _Table) -> tuple[torch.Tensor, torch.Tensor]:
        """The hot slots whose rows this rank owns, and those rows' places in its block."""
        assert table.owners is not None
        hot_ids = table.hot_ids().to(table.weight.device)
        mine = torch.nonzero(table.owners.owner(hot_ids) == self.comm.rank).flatten()
        return mine, table.owners.local(hot_ids[mine])

    def refresh(self) -> None:
        """Make every owner's rows true again: the hot replicas, which took the steps, written
        back into their owners' blocks (local: every rank holds the replicas). Called before
        a checkpoint and when training ends."""
        for table in self.tables:
            if table.owners is not None and table.hot_weight is not None:
                slots, local = self._hot_owned_here(table)
                with torch.no_grad():
                    table.weight[local] = table.hot_weight[slots]

    def refresh_states(self, states: Mapping[str, Mapping[int, torch.Tensor | None]]) -> None:
        """What `refresh` does for the weights, for the optimizer's state of each table (per
        kind, tensors by `id` of their parameter; None: no state yet; a tensor not shaped like
        its parameter, Adam's step, is left alone): the hot replicas' momentum or moments
        written into their owners' rows, in place, so that a checkpoint keeps every row's true
        state on its owner. Local: nothing moves."""
        for table in self.tables:
            hot_weight = table.hot_weight
            if table.owners is None or hot_weight is None:
                continue
            slots, local = self._hot_owned_here(table)
            for kind, held in states.items():
                hot_state, owned_state = held.get(id(hot_weight)), held.get(id(table.weight))
                hot_shaped = hot_state is not None and hot_state.shape == hot_weight.shape
                owned_shaped = (owned_state is not None
                                and owned_state.shape == table.weight.shape)
                if hot_shaped != owned_shaped:
                    raise UnevenState(f"optimizer state '{kind}' of table {table.name} is held "
                                      f"for {'its hot rows' if hot_shaped else 'its own rows'} "
                                      f"only: the hot rows' state cannot be written back")
                if hot_shaped and owned_shaped:
                    assert hot_state is not None and owned_state is not None
                    with torch.no_grad():
                        owned_state[local] = hot_state[slots]

    def whole_table(self, name: str) -> torch.Tensor:
        """Collective: the whole (num_rows × dim) table `name` on every rank (its blocks
        gathered from their owners, hot rows from the replicas): for tests and benchmarks."""
        table = next(t for t in self.tables if t.name == name)
        if table.owners is None:
            return table.weight.detach().clone()
        self.refresh()
        weight = table.weight.detach()
        whole = weight.new_empty((table.num_rows, *weight.shape[1:]))
        row_elements = int(torch.Size(weight.shape[1:]).numel())
        sizes = [len(table.owners.owned(k)) * row_elements for k in range(self.comm.size)]
        self.comm.allgatherv_(weight.contiguous(), whole, sizes, label=f"{name} whole")
        return whole

    def report(self) -> dict[str, dict[str, Any]]:
        """Per table: the last step's mode, rows and density; the steps spent in each mode;
        and the rows this rank holds (`held_rows`: its own rows and the hot replicas, the
        parameters, plus the largest pulled working set; `held_bytes` likewise;
        `param_rows`: the parameters alone)."""
        out: dict[str, dict[str, Any]] = {}
        for t in self.tables:
            params = len(t.weight) + (0 if t.hot_weight is None else len(t.hot_weight))
            held = params + t.most_pulled
            extra: dict[str, Any] = {"held_rows": held, "held_bytes": held * t.row_bytes,
                                     "param_rows": params}
            if t.owners is not None:
                extra |= {"owners": t.owners.parts, "owned_rows": len(t.weight),
                          "node_push": t.name in self.node_routes,
                          "hot_rows": len(t.hot_ids()), "pulled_rows_max": t.most_pulled}
            out[t.name] = {**t.last, "steps_by_mode": dict(t.modes), **extra}
        return out


def whole_parameters(model: nn.Module, reducers: Iterable[object]) -> list[torch.Tensor]:
    """Collective: `model`'s parameters as one process holds them, detached, each owners-only
    table gathered whole from its owners (its hot replicas, not the sequential model's, left
    out). `reducers`: the parallel model's gradient exchanges. For tests and benchmarks."""
    exchanges = [r for r in reducers if isinstance(r, SparseGradientExchange)]
    tables = {id(t.weight): (e, t.name) for e in exchanges for t in e.tables}
    out = []
    for name, param in model.named_parameters():
        if is_hot_row_tensor(name):
            continue
        exchange, table = tables.get(id(param), (None, ""))
        out.append(param.detach() if exchange is None else exchange.whole_table(table))
    return out
