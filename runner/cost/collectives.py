"""The α–β cost of the collectives a training step issues.

A message of n bytes costs α + β·n (α: latency, seconds per message; β: seconds per byte). For a
collective on p ranks with payload n (the `n` the counted communicator records):

    all-gather, reduce-scatter (Bruck / recursive halving)   α⌈log₂ p⌉ + β (p−1)/p · n
    all-reduce (reduce-scatter + all-gather)                2 (α⌈log₂ p⌉ + β (p−1)/p · n)
    broadcast, reduce (binomial tree)                        ⌈log₂ p⌉ (α + β n)
    all-to-all (pairwise), n = this rank's input             (p−1) (α + β n/p)
    all-to-all-v (sparse), n = the bytes this rank sends     (p−1) α + β n
    point-to-point exchange of m messages, n bytes in all    m α + β n

A group of one costs nothing. These are the formulas of docs/design.md, "Planner"; the
strategies predict which operations a step issues (`CommOp`), and this module prices them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from runner.core.comm import CollectiveOp, GridGroup

# Used until `python -m runner.plan plan.calibrate=true` has run: a typical shared-memory MPI;
# and the runner's own cost per collective call (Python, counting, buffers: 8 to 40 µs by kind
# on a 2-core x86 machine).
DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_CALL = 5e-6, 2.5e-10, 2e-5
# What a collective waits for a descheduled peer when ranks share cores two to a core (~0.2 ms
# measured on a 2-core x86 machine: the scheduler's time slices).
DEFAULT_OVERSUBSCRIBED_SYNC = 2e-4


@dataclass(frozen=True)
class CommOp:
    """One collective rank 0 issues in a training step, as the counted communicator records it."""

    op: CollectiveOp
    group: GridGroup
    group_size: int
    nbytes: int
    layer: str = ""  # what the planner's per-layer breakdown files it under
    messages: int = 1  # point-to-point messages of an exchange

    @property
    def key(self) -> tuple[CollectiveOp, GridGroup, int, int]:
        """What a measured record must match."""
        return (self.op, self.group, self.group_size, self.nbytes)


def log2_ceil(p: int) -> int:
    return 0 if p <= 1 else math.ceil(math.log2(p))


def op_time(op: CommOp, alpha: float, beta: float) -> float:
    """Seconds for `op` under the α–β model."""
    p, n = op.group_size, op.nbytes
    if p <= 1:
        return 0.0
    if op.op in ("allgather", "reduce_scatter"):
        return alpha * log2_ceil(p) + beta * (p - 1) / p * n
    if op.op in ("allreduce", "iallreduce"):
        return 2 * (alpha * log2_ceil(p) + beta * (p - 1) / p * n)
    if op.op in ("bcast", "reduce"):
        return log2_ceil(p) * (alpha + beta * n)
    if op.op == "alltoall":
        return (p - 1) * (alpha + beta * n / p)
    if op.op == "alltoallv":
        return (p - 1) * alpha + beta * n
    if op.op == "exchange":
        return op.messages * alpha + beta * n
    raise ValueError(f"no cost model for operation '{op.op}'")


def step_time(ops: list[CommOp], alpha: float, beta: float) -> float:
    """Seconds of `ops` under the α–β model alone."""
    return sum(op_time(op, alpha, beta) for op in ops)


def wait_seconds(ops: list[CommOp], costs: MachineCosts, slowdown: float) -> float:
    """What `ops` wait for peers that share cores (`slowdown`: ranks per core, 1 when each
    has its own): every operation on a group of more than one rank synchronises it."""
    if slowdown <= 1:
        return 0.0
    syncs = sum(1 for op in ops if op.group_size > 1)
    return syncs * (slowdown - 1) * costs.oversubscribed_sync


def comm_seconds(ops: list[CommOp], costs: MachineCosts) -> float:
    """Seconds of `ops` on a machine of `costs`: α–β, and for every operation on a group of
    more than one rank what issuing it costs the runner itself (`MachineCosts.call_seconds`)."""
    return sum(op_time(op, costs.alpha, costs.beta)
               + (costs.call_seconds(op.op) if op.group_size > 1 else 0.0) for op in ops)


def step_bytes(ops: list[CommOp]) -> int:
    return sum(op.nbytes for op in ops)


def loss_op(world_size: int, itemsize: int, overflow_flag: bool = False) -> list[CommOp]:
    """The all-reduce every training step adds after the strategy's own collectives: the loss
    and the stop flag, two values of the loss's dtype (three under fp16: and whether any rank's
    gradients overflowed)."""
    values = 3 if overflow_flag else 2
    return [CommOp("allreduce", "world", world_size, values * itemsize, "loss")] \
        if world_size > 1 else []


# -- the sparse exchange of an embedding table's gradient (docs/design.md, "Sparse exchange") ---

SparseMode = Literal["dense", "allgather", "sharded"]
SPARSE_MODES: tuple[SparseMode, ...] = get_args(SparseMode)  # in this order: ties go to the first
INDEX_BYTES = 8  # int64 row ids


@dataclass(frozen=True)
class TableRows:
    """An embedding table's gradient rows as a sparse exchange moves them: `num_rows` rows of
    `row_bytes` each, of which this rank touched `own_rows` and all ranks together `all_rows`
    (counted per rank, so rows touched by two ranks count twice). Row counts may be expectations
    (floats): bytes are rounded."""

    num_rows: int
    row_bytes: int
    own_rows: float
    all_rows: float


@dataclass(frozen=True)
class RowOwners:
    """Who owns a table's rows under the owners-only exchange ("sharded"): `parts` owners (K,
    p when None; rank 0 is an owner) and `hot_rows` H rows replicated on every rank. With
    `node_ranks` > 1 ranks per node the push takes two steps (`push_rows_by_node`), of the
    node's `node_rows` distinct rows across the nodes."""

    parts: int | None = None
    hot_rows: int = 0
    node_ranks: int = 1
    node_rows: float = 0.0


def sparse_exchange_ops(mode: SparseMode, group: GridGroup, p: int, rows: TableRows,
                        label: str = "", counts_first: bool = False,
                        owners: RowOwners = RowOwners()) -> list[CommOp]:
    """The operations one rank issues to exchange the gradient `rows` of a table in `mode`:

    - dense: one all-reduce of the whole table;
    - allgather: all-gather of the indices and of the rows (every rank gets everyone's rows);
    - sharded: push to the row owners (counts, indices, rows: three all-to-all-v) and the pull
      of the rows the next batch needs (the same three), each rank sending the fraction
      (K−1)/K of its rows that others own (K `owners.parts`); with H hot rows, one all-reduce of
      their H rows as well (their rows are not pushed or pulled: `own_rows` then counts the
      others). With `owners.node_ranks` > 1 the push takes two steps: (P−N)/P of a rank's rows
      to the ranks of its node (N nodes), then a delegate's share, (N−1)/P, of the node's
      `node_rows` distinct rows across the nodes.

    `counts_first`: the all-gather of every rank's row count that precedes an `auto` choice
    (and that `allgather` needs anyway).
    """
    if p <= 1:
        return []
    ops: list[CommOp] = []
    if counts_first or mode == "allgather":
        ops.append(CommOp("allgather", group, p, INDEX_BYTES * p, label + " counts"))
    if mode == "dense":
        ops.append(CommOp("allreduce", group, p, rows.num_rows * rows.row_bytes, label))
    elif mode == "allgather":
        ops += [CommOp("allgather", group, p, round(rows.all_rows * INDEX_BYTES),
                       label + " indices"),
                CommOp("allgather", group, p, round(rows.all_rows * rows.row_bytes),
                       label + " rows")]
    elif mode == "sharded":
        parts = p if owners.parts is None else owners.parts
        sent = rows.own_rows * (parts - 1) / parts  # its rows other owners own (push, requests)
        answered = rows.own_rows * (p - 1) / parts  # the rows of its block others ask for
        if owners.hot_rows:
            ops.append(CommOp("allreduce", group, p, owners.hot_rows * rows.row_bytes,
                              label + " hot"))
        phases = [("push", sent, sent), ("pull", sent, answered)]
        if owners.node_ranks > 1:  # the push in two steps: inside the node, then across
            nodes = p / owners.node_ranks
            inside = rows.own_rows * (p - nodes) / p
            across = owners.node_rows * (nodes - 1) / p
            phases[:1] = [("push node", inside, inside), ("push", across, across)]
        for phase, ids_sent, rows_sent in phases:
            ops += [CommOp("alltoallv", group, p, INDEX_BYTES * p, f"{label} {phase} counts"),
                    CommOp("alltoallv", group, p, round(ids_sent * INDEX_BYTES),
                           f"{label} {phase} indices"),
                    CommOp("alltoallv", group, p, round(rows_sent * rows.row_bytes),
                           f"{label} {phase} rows")]
    else:
        raise ValueError(f"unknown sparse exchange mode '{mode}'; known: {', '.join(SPARSE_MODES)}")
    return ops


# Local work per byte, besides communication (measured on a 2-core x86 machine with one torch
# thread; `python -m runner.plan plan.calibrate=true` measures them where it runs):
# a dense update's passes over a table (zero the gradient, add it to the weights), and a row
# that the sparse path sorts, sums into place and updates (random access: ~15x dearer a byte).
DEFAULT_TABLE_PASS, DEFAULT_SPARSE_ROW = 1e-10, 1.5e-9


@dataclass(frozen=True)
class MachineCosts:
    """What this machine charges, for choices made from the cost model: α (seconds per
    message), β (seconds per byte), and local work per byte (`table_pass`: a dense pass over a
    table; `sparse_row`: a row the sparse path sorts, sums and updates). `source` says where
    the numbers come from (defaults, a calibration file, given on the command line)."""

    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    table_pass: float = DEFAULT_TABLE_PASS
    sparse_row: float = DEFAULT_SPARSE_ROW
    source: str = "default"
    oversubscribed_sync: float = DEFAULT_OVERSUBSCRIBED_SYNC
    """Seconds a synchronising operation waits for a descheduled peer when two ranks share a
    core (measured by the calibration; scaled by ranks per core − 1)."""
    calls: tuple[tuple[str, float], ...] = ()
    """Seconds the runner spends issuing one operation of a kind (Python, counting, buffers,
    counts): measured by the calibration; a kind it has not measured costs DEFAULT_CALL."""

    def call_seconds(self, op: str) -> float:
        return dict(self.calls).get(op, DEFAULT_CALL)


DEFAULT_COSTS = MachineCosts()


def sparse_local_time(mode: SparseMode, rows: TableRows, costs: MachineCosts) -> float:
    """Seconds of local work per step: dense passes over the whole table; allgather handles
    every rank's rows (coalesce, update); sharded its own rows twice (coalesce and update at
    the owner, then the pull's gather and write)."""
    if mode == "dense":
        return costs.table_pass * rows.num_rows * rows.row_bytes
    if mode == "allgather":
        return costs.sparse_row * rows.all_rows * rows.row_bytes
    return costs.sparse_row * 2 * rows.own_rows * rows.row_bytes


def choose_sparse_mode(p: int, num_rows: int, row_bytes: int, counts: Sequence[float],
                       costs: MachineCosts,
                       modes: Sequence[SparseMode] = SPARSE_MODES) -> SparseMode:
    """The mode with the least time for the busiest rank — communication (α–β and the calls'
    cost) plus local work (`sparse_local_time`) — given every rank's row count. A pure function
    of values every rank holds alike, so every rank chooses the same mode (ties go to the
    earlier mode in SPARSE_MODES: dense first)."""
    rows = TableRows(num_rows, row_bytes, max(counts), sum(counts))

    def cost(mode: SparseMode) -> float:
        ops = sparse_exchange_ops(mode, "world", p, rows)
        return comm_seconds(ops, costs) + sparse_local_time(mode, rows, costs)

    return min(modes, key=cost)


# -- owners-only tables (`strategy.sparse=sharded`): hot rows, partitions, memory -----------------

def hot_row_gain(ranks_touching: float, p: int, row_bytes: int, costs: MachineCosts) -> float:
    """Seconds per step saved by replicating one row that `ranks_touching` of the p ranks read
    every step: each of them would otherwise push its gradient row and pull the row (index and
    row, both ways, from an owner that is another rank (p−1)/p of the time) and sort, sum and
    scatter it twice; replicated, every rank all-reduces the row and updates it densely
    (averaged over the ranks: the all-reduce's cost is every rank's)."""
    sharded = (ranks_touching / p) * (
        2 * (p - 1) / p * (row_bytes + INDEX_BYTES) * costs.beta
        + 2 * row_bytes * costs.sparse_row)
    replicated = 2 * (p - 1) / p * row_bytes * costs.beta + row_bytes * costs.table_pass
    return sharded - replicated


def choose_hot_rows(ids: Sequence[int], ranks_touching: Sequence[int], limit: int, p: int,
                    row_bytes: int, costs: MachineCosts) -> list[int]:
    """The rows to replicate, ascending: of the rows `ids` read by `ranks_touching` ranks each,
    the most widely read (ties: the lower id) whose replication saves time (`hot_row_gain`),
    at most `limit`. A pure function of gathered values: every rank chooses alike."""
    ranked = sorted(zip(ranks_touching, ids, strict=True), key=lambda kr: (-kr[0], kr[1]))
    chosen = [row for k, row in ranked[:limit] if hot_row_gain(k, p, row_bytes, costs) > 0]
    return sorted(chosen)


def partition_seconds(parts: int, p: int, row_bytes: int, rows_per_rank: float,
                      costs: MachineCosts) -> float:
    """Seconds per step of the owners-only exchange for the busiest rank, an owner, when a
    table's rows are cut into `parts` blocks on as many ranks and each rank touches
    `rows_per_rank` rows: every rank sends its index and row messages (push, pull) to the
    owners, one each (fewer owners: fewer messages); an owner sends the rows others own and
    takes in, sums and answers the rows of its block all others touch, (p−1)/parts of a
    rank's rows each (fewer owners: more bytes and work on each)."""
    theirs = rows_per_rank * (parts - 1) / parts
    asked = rows_per_rank * (p - 1) / parts
    moved = 2 * (theirs + asked) * (row_bytes + INDEX_BYTES)
    work = 2 * (rows_per_rank + asked) * row_bytes
    return 4 * parts * costs.alpha + moved * costs.beta + work * costs.sparse_row


def choose_partitions(p: int, num_rows: int, row_bytes: int, rows_per_rank: float,
                      costs: MachineCosts, memory_bytes: float | None = None) -> int:
    """How many ranks own a table's rows (K ≤ p): the least `partition_seconds`, among the K
    whose block (⌈rows / K⌉ rows) fits `memory_bytes` when given (p always qualifies: it is
    the least memory); ties go to the larger K, which holds less per rank."""
    fits = [k for k in range(1, p + 1)
            if memory_bytes is None or -(-num_rows // k) * row_bytes <= memory_bytes] or [p]
    return min(reversed(fits),
               key=lambda k: partition_seconds(k, p, row_bytes, rows_per_rank, costs))


# Shared memory inside a node against the network between nodes: α and β this many times smaller
# (an assumption, not measured here: on one machine every rank shares memory).
DEFAULT_NODE_SPEEDUP = 4.0


def node_push_seconds(p: int, ranks_per_node: int, row_bytes: int, rows_per_rank: float,
                      rows_per_node: float | None, costs: MachineCosts,
                      node_speedup: float = DEFAULT_NODE_SPEEDUP) -> tuple[float, float]:
    """Seconds of the owners-only push for one rank (an owner), (direct, through the node), n
    ranks a node, N = p/n nodes, u rows a rank, each owner's share 1/p of them. Direct: a rank
    sends u (p−1)/p rows, (n−1)/p of u inside its node (α and β `node_speedup` times smaller)
    and (p−n)/p across; the owner sums the u (p−1)/p rows it receives. Through the node: a rank
    sends u (p−N)/p rows inside its node; the delegate sums what its node sent for its N−1
    owners elsewhere and for itself (u N/p from each of n−1 ranks) and pushes its share
    (N−1)/p of the node's distinct rows (`rows_per_node`; None: n u, no row shared) to N−1
    ranks across, which sum (N−1)/p of a node's rows; three operations more."""
    n = ranks_per_node
    nodes = p / n
    node_rows = n * rows_per_rank if rows_per_node is None else rows_per_node
    row = row_bytes + INDEX_BYTES
    alpha_in, beta_in = costs.alpha / node_speedup, costs.beta / node_speedup
    u = rows_per_rank
    direct = ((p - 1) * costs.alpha + costs.beta * u * (p - n) / p * row
              + beta_in * u * (n - 1) / p * row
              + costs.sparse_row * u * (p - 1) / p * row_bytes)
    inside = u * (p - nodes) / p
    across = node_rows * (nodes - 1) / p
    through = ((n - 1) * alpha_in + beta_in * inside * row
               + (nodes - 1) * costs.alpha + costs.beta * across * row
               + costs.sparse_row * ((n - 1) * u * nodes / p + across) * row_bytes
               + 3 * costs.call_seconds("alltoallv"))
    return direct, through


def sharded_rows_per_rank(num_rows: int, parts: int, hot_rows: int) -> int:
    """Rows of a table that rank 0 holds as parameters under the owners-only exchange: its block
    (the first, so the largest of the balanced blocks) and the replicated hot rows."""
    return -(-num_rows // parts) + hot_rows
