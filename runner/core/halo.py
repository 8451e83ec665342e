"""Halo exchange along one dimension of a sliding-window operation (convolution, pooling).

A tensor split along `dim` over a group in balanced slabs feeds a window operation (kernel k,
stride s, padding p, dilation d) whose *output* is split in balanced slabs too. Each rank's
output rows need a contiguous range of input rows; the `HaloPlan` says which of those rows live
on which rank. Rows are found wherever they are, so a slab thinner than the halo is no special
case: its rows just come from further away.

`halo_exchange_op` builds this rank's window (the needed input rows, in order, padding excluded);
its adjoint `halo_accumulate_op` sends each window row's gradient back to the rank that owns the
row and adds it there. The exchange is posted non-blocking (`start_halo_exchange`) so the part of
the operation that needs only the rank's own rows can run while the halos travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function

from runner.core.comm import CountedComm, PendingOp
from runner.core.partition import Partition


@dataclass(frozen=True)
class Window:
    """A sliding window along one dimension, with PyTorch's conv/pool semantics."""

    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1

    def out_size(self, n_in: int) -> int:
        return (n_in + 2 * self.padding - self.dilation * (self.kernel - 1) - 1) // self.stride + 1

    def inputs(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Input rows [lo, hi) that outputs [out_start, out_stop) read, in unpadded coordinates
        (lo < 0 or hi > n_in reach into the padding)."""
        lo = out_start * self.stride - self.padding
        hi = (out_stop - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1
        return lo, hi


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class HaloPlan:
    """Who sends which rows to whom, for one window operation over a group."""

    def __init__(self, n_in: int, window: Window, group_size: int, rank: int) -> None:
        self.n_in, self.window, self.size, self.rank = n_in, window, group_size, rank
        self.n_out = window.out_size(n_in)
        self.in_part = Partition(n_in, group_size)
        self.out_part = Partition(self.n_out, group_size)
        needed = [self._needed(q) for q in range(group_size)]
        own = (self.in_part.offsets[rank], self.in_part.offsets[rank] + self.in_part.sizes[rank])
        self.own_rows = own
        lo, hi = needed[rank]
        # padding rows before/after the window (outside 0..n_in), for the layer to add
        self.pad_before, self.pad_after = max(0, -lo), max(0, hi - n_in)
        self.window_rows = (max(lo, 0), min(hi, n_in)) if lo < hi else (0, 0)
        # pieces of the window, in row order: (source rank, [lo, hi) in global rows)
        self.pieces: list[tuple[int, tuple[int, int]]] = []
        for q in range(group_size):
            q_rows = (self.in_part.offsets[q], self.in_part.offsets[q] + self.in_part.sizes[q])
            piece = _overlap(self.window_rows, q_rows)
            if piece:
                self.pieces.append((q, piece))
        # what this rank's slab contributes to every other rank's window
        self.sends: list[tuple[int, tuple[int, int]]] = []
        for q in range(group_size):
            if q != rank and needed[q][0] < needed[q][1]:
                q_window = (max(needed[q][0], 0), min(needed[q][1], n_in))
                piece = _overlap(q_window, own)
                if piece:
                    self.sends.append((q, piece))

    def _needed(self, q: int) -> tuple[int, int]:
        start = self.out_part.offsets[q]
        stop = start + self.out_part.sizes[q]
        return self.window.inputs(start, stop) if stop > start else (0, 0)

    @property
    def recv_rows(self) -> int:
        return sum(hi - lo for q, (lo, hi) in self.pieces if q != self.rank)

    @property
    def send_rows(self) -> int:
        return sum(hi - lo for _, (lo, hi) in self.sends)

    def interior(self) -> tuple[int, int]:
        """This rank's output rows [a, b) that read only its own rows (no halo, no padding)."""
        start = self.out_part.offsets[self.rank]
        stop = start + self.out_part.sizes[self.rank]
        a = start
        while a < stop and not self._inside(a):
            a += 1
        b = stop
        while b > a and not self._inside(b - 1):
            b -= 1
        return a, b

    def _inside(self, out_row: int) -> bool:
        lo, hi = self.window.inputs(out_row, out_row + 1)
        return self.own_rows[0] <= lo and hi <= self.own_rows[1]


def _local(x: torch.Tensor, dim: int, plan: HaloPlan, rows: tuple[int, int]) -> torch.Tensor:
    """Global rows `rows` of this rank's slab."""
    return x.narrow(dim, rows[0] - plan.own_rows[0], rows[1] - rows[0])


class PendingHalo:
    """A halo exchange in flight; `window()` waits and assembles this rank's window."""

    def __init__(self, x: torch.Tensor, dim: int, plan: HaloPlan, op: PendingOp,
                 received: dict[int, torch.Tensor]) -> None:
        self.x, self.dim, self.plan, self.op, self.received = x, dim, plan, op, received

    def window(self) -> torch.Tensor:
        self.op.wait()
        parts = [self.received[q] if q != self.plan.rank else _local(self.x, self.dim,
                                                                      self.plan, rows)
                 for q, rows in self.plan.pieces]
        if not parts:
            shape = list(self.x.shape)
            shape[self.dim] = 0
            return self.x.new_empty(shape)
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def _shaped(x: torch.Tensor, dim: int, rows: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = rows
    return shape


def start_halo_exchange(x: torch.Tensor, comm: CountedComm, dim: int, plan: HaloPlan,
                        label: str = "halo") -> PendingHalo:
    """Post the sends of this rank's rows that others need and the receives of its halos."""
    x = x.detach()
    sends = [(_local(x, dim, plan, rows).contiguous(), q) for q, rows in plan.sends]
    received = {q: torch.empty(_shaped(x, dim, rows[1] - rows[0]), dtype=x.dtype, device=x.device)
                for q, rows in plan.pieces if q != plan.rank}
    op = comm.exchange(sends, [(buf, q) for q, buf in received.items()], label)
    return PendingHalo(x, dim, plan, op, received)


def halo_exchange_op(x: torch.Tensor, comm: CountedComm, dim: int, plan: HaloPlan,
                     label: str = "halo") -> torch.Tensor:
    """This rank's window: the input rows its outputs read, gathered from their owners."""
    return start_halo_exchange(x, comm, dim, plan, label).window()


def halo_accumulate_op(grad: torch.Tensor, comm: CountedComm, dim: int, plan: HaloPlan,
                       label: str = "halo") -> torch.Tensor:
    """Adjoint of the exchange: each window row's gradient goes back to (and is added on) the
    rank that owns the row."""
    grad = grad.detach()
    slab = torch.zeros(_shaped(grad, dim, plan.own_rows[1] - plan.own_rows[0]), dtype=grad.dtype,
                       device=grad.device)
    offset = plan.window_rows[0]
    sends, own = [], None
    for q, (lo, hi) in plan.pieces:
        piece = grad.narrow(dim, lo - offset, hi - lo)
        if q == plan.rank:
            own = (piece, (lo, hi))
        else:
            sends.append((piece.contiguous(), q))
    received = [(torch.empty(_shaped(grad, dim, hi - lo), dtype=grad.dtype, device=grad.device),
                 q, (lo, hi)) for q, (lo, hi) in plan.sends]
    comm.exchange(sends, [(buf, q) for buf, q, _ in received], label, tag=1).wait()
    if own is not None:
        _local(slab, dim, plan, own[1]).add_(own[0])
    for buf, _, rows in received:
        _local(slab, dim, plan, rows).add_(buf)
    return slab


class _HaloWindow(Function):
    """Forward: finish an exchange started on x's values (x itself is the differentiable input);
    backward: the adjoint, accumulating halo gradients into their owners' rows."""

    # `ctx` is autograd's context object, which holds whatever attributes forward gives it.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: PendingHalo, comm: CountedComm,
                label: str) -> torch.Tensor:
        ctx.args = (comm, pending.dim, pending.plan, label)
        return pending.window()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        comm, dim, plan, label = ctx.args
        return halo_accumulate_op(grad, comm, dim, plan, label), None, None, None


def halo_window(x: torch.Tensor, pending: PendingHalo, comm: CountedComm,
                label: str = "halo") -> torch.Tensor:
    """The window of an exchange started with `start_halo_exchange(x, ...)`, differentiable in x."""
    window: torch.Tensor = _HaloWindow.apply(x, pending, comm, label)
    return window


def halo_exchange(x: torch.Tensor, comm: CountedComm, dim: int, plan: HaloPlan,
                  label: str = "halo") -> torch.Tensor:
    """Differentiable halo exchange, start to finish."""
    return halo_window(x, start_halo_exchange(x, comm, dim, plan, label), comm, label)
