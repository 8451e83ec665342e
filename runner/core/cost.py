"""The α–β cost of the collectives a training step issues.

A message of n bytes costs α + β·n (α: latency, seconds per message; β: seconds per byte). For a
collective on p ranks with payload n (the `n` the counted communicator records):

    all-gather, reduce-scatter (Bruck / recursive halving)   α⌈log₂ p⌉ + β (p−1)/p · n
    all-reduce (reduce-scatter + all-gather)                2 (α⌈log₂ p⌉ + β (p−1)/p · n)
    broadcast, reduce (binomial tree)                        ⌈log₂ p⌉ (α + β n)
    all-to-all (pairwise), n = this rank's input             (p−1) (α + β n/p)
    point-to-point exchange of m messages, n bytes in all    m α + β n

A group of one costs nothing. These are the formulas of DESIGN.md's "Planner"; the strategies
predict which operations a step issues (`CommOp`), and this module prices them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CommOp:
    """One collective rank 0 issues in a training step, as the counted communicator records it."""

    op: str  # allreduce | iallreduce | allgather | reduce_scatter | alltoall | exchange | ...
    group: str  # world | model | batch
    group_size: int
    nbytes: int
    layer: str = ""  # what the planner's per-layer breakdown files it under
    messages: int = 1  # point-to-point messages of an exchange

    @property
    def key(self) -> tuple[str, str, int, int]:
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
    if op.op == "exchange":
        return op.messages * alpha + beta * n
    raise ValueError(f"no cost model for operation '{op.op}'")


def step_time(ops: list[CommOp], alpha: float, beta: float) -> float:
    return sum(op_time(op, alpha, beta) for op in ops)


def step_bytes(ops: list[CommOp]) -> int:
    return sum(op.nbytes for op in ops)
