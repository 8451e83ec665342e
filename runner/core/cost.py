"""The α–β cost of the collectives a training step issues.

A message of n bytes costs α + β·n (α: latency, seconds per message; β: seconds per byte). For a
collective on p ranks with payload n (the `n` the counted communicator records):

    all-gather, reduce-scatter (Bruck / recursive halving)   α⌈log₂ p⌉ + β (p−1)/p · n
    all-reduce (reduce-scatter + all-gather)                2 (α⌈log₂ p⌉ + β (p−1)/p · n)
    broadcast, reduce (binomial tree)                        ⌈log₂ p⌉ (α + β n)
    all-to-all (pairwise), n = this rank's input             (p−1) (α + β n/p)
    all-to-all-v (sparse), n = the bytes this rank sends     (p−1) α + β n
    point-to-point exchange of m messages, n bytes in all    m α + β n

A group of one costs nothing. These are the formulas of DESIGN.md's "Planner"; the strategies
predict which operations a step issues (`CommOp`), and this module prices them.
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


# -- the sparse exchange of an embedding table's gradient (DESIGN.md, "Sparse exchange") ----------

SparseMode = Literal["dense", "allgather", "sharded"]
SPARSE_MODES: tuple[SparseMode, ...] = get_args(SparseMode)  # in this order: ties go to the first
INDEX_BYTES = 8  # int64 row ids


def sparse_exchange_ops(mode: SparseMode, group: GridGroup, p: int, num_rows: int, row_bytes: int,
                        own_rows: float, all_rows: float, label: str = "",
                        counts_first: bool = False) -> list[CommOp]:
    """The operations one rank issues to exchange the gradient of a (num_rows × row) table of
    which it touched `own_rows` rows and all ranks together `all_rows` (counted per rank, so
    rows touched by two ranks count twice), in `mode`:

    - dense: one all-reduce of the whole table;
    - allgather: all-gather of the indices and of the rows (every rank gets everyone's rows);
    - sharded: push to the row owners (counts, indices, rows: three all-to-all-v) and the pull
      of the rows the next batch needs (the same three), each rank sending the fraction
      (p−1)/p of its rows that others own.

    `counts_first`: the all-gather of every rank's row count that precedes an `auto` choice
    (and that `allgather` needs anyway). Row counts may be expectations (floats): bytes are
    rounded.
    """
    if p <= 1:
        return []
    ops: list[CommOp] = []
    if counts_first or mode == "allgather":
        ops.append(CommOp("allgather", group, p, INDEX_BYTES * p, label + " counts"))
    if mode == "dense":
        ops.append(CommOp("allreduce", group, p, num_rows * row_bytes, label))
    elif mode == "allgather":
        ops += [CommOp("allgather", group, p, round(all_rows * INDEX_BYTES), label + " indices"),
                CommOp("allgather", group, p, round(all_rows * row_bytes), label + " rows")]
    elif mode == "sharded":
        sent = own_rows * (p - 1) / p
        for phase in ("push", "pull"):
            ops += [CommOp("alltoallv", group, p, INDEX_BYTES * p, f"{label} {phase} counts"),
                    CommOp("alltoallv", group, p, round(sent * INDEX_BYTES),
                           f"{label} {phase} indices"),
                    CommOp("alltoallv", group, p, round(sent * row_bytes),
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


def sparse_local_time(mode: SparseMode, num_rows: int, row_bytes: int, own_rows: float,
                      all_rows: float, table_pass: float, sparse_row: float) -> float:
    """Seconds of local work per step: dense passes over the whole table; allgather handles
    every rank's rows (coalesce, update); sharded its own rows twice (coalesce and update at
    the owner, then the pull's gather and write)."""
    if mode == "dense":
        return table_pass * num_rows * row_bytes
    if mode == "allgather":
        return sparse_row * all_rows * row_bytes
    return sparse_row * 2 * own_rows * row_bytes


def choose_sparse_mode(p: int, num_rows: int, row_bytes: int, counts: Sequence[float],
                       costs: MachineCosts) -> SparseMode:
    """The mode with the least time for the busiest rank — communication (α–β and the calls'
    cost) plus local work
    (`sparse_local_time`) — given every rank's row count. A pure function of values every rank
    holds alike, so every rank chooses the same mode (ties go to the earlier mode in
    SPARSE_MODES: dense first)."""
    own, total = max(counts), sum(counts)

    def cost(mode: SparseMode) -> float:
        ops = sparse_exchange_ops(mode, "world", p, num_rows, row_bytes, own, total)
        return comm_seconds(ops, costs) + sparse_local_time(
            mode, num_rows, row_bytes, own, total, costs.table_pass, costs.sparse_row)

    return min(SPARSE_MODES, key=cost)
