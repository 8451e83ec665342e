"""Parallel data movement as linear operators with hand-written adjoints (DistDL's approach).

Convention: every rank holds its own tensor, and the inner product of two distributed tensors is
the sum over ranks of the local inner products. Under it each primitive's adjoint is another
primitive, and that adjoint is its backward:

    broadcast   (root's x to every rank)       ↔  sum-reduce (every x summed onto root)
    all-sum-reduce                             ↔  itself
    all-gather  (pieces along a dim → whole)   ↔  reduce-scatter (sum, then each its piece)
    repartition (split along a → split along b) ↔ repartition (split along b → split along a)
    exchange rows (send_counts[k] rows of x to ↔  exchange rows with the counts swapped (each
                 rank k; receive recv_counts[k]     row back to the rank it came from, in its
                 from each: an all-to-all of        place: a mixture of experts' tokens sent to
                 uneven counts)                     their experts and back)
    redistribute (Cartesian partition → another) ↔ its scatter-add: each block back to the rank
                                                   it was read from, summed there
                                                   (`runner.core.cartesian`)
    ring shift  (y_k = x_{k−s}: each rank's x  ↔  the opposite shift (y_k = x_{k+s}: each rank's
                 to the rank s places on)          y back s places, to the rank its x came from)
    take piece  (this rank's piece of its      ↔  place piece (the piece put into zeros of the
                 whole x along a dim)              whole: no communication; a replicated x's
                                                   gradient is then partial on each rank, the
                                                   true one their sum)

The all-gather also comes in two halves, for overlapping it with computation:
`all_gather_start` issues it without waiting (`GatherInFlight`), and `all_gather_wait` ends it as
`all_gather`'s forward, with the same adjoint (the reduce-scatter) as its backward.

Pieces may be uneven: a `Partition` says how long each rank's piece is along the split dim.
Every call goes through the counted communicator. Outputs are new tensors (autograd keeps them)
on the input's device, so that both ends of every operation lie on the same device; the scratch
copies a non-contiguous layout needs are reused across calls (on the host, the communicator's;
on an accelerator, its caching allocator's).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.autograd import Function

from runner.core.comm import CountedComm, PendingOp, has_c_strides
from runner.core.partition import Partition

# -- the operators and their adjoints, without autograd ------------------------------------------


def _dense(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x if has_c_strides(x) else x.contiguous()


def _scratch(comm: CountedComm, tag: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """A scratch buffer on `device` for one blocking operation: the communicator's reused one
    on the host; a fresh one elsewhere (the device's caching allocator reuses the memory)."""
    if device.type == "cpu":
        return comm.staging(tag, shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def broadcast_op(x: torch.Tensor, comm: CountedComm, root: int = 0,
                 label: str = "") -> torch.Tensor:
    """y_k = x_root on every rank k (other ranks' x is ignored; only its shape is used).
    On root the output shares x's storage: nothing needs copying there."""
    out = (_dense(x) if comm.rank == root
           else torch.empty(x.shape, dtype=x.dtype, device=x.device))
    return comm.bcast_(out, root, label)


def sum_reduce_op(x: torch.Tensor, comm: CountedComm, root: int = 0,
                  label: str = "") -> torch.Tensor:
    """y_root = Σ_k x_k; y is zero on every other rank."""
    if comm.rank == root:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        comm.reduce(_dense(x), out, root, label)
        return out
    comm.reduce(_dense(x), None, root, label)
    return torch.zeros(x.shape, dtype=x.dtype, device=x.device)


def all_sum_reduce_op(x: torch.Tensor, comm: CountedComm, label: str = "") -> torch.Tensor:
    """y_k = Σ_j x_j on every rank k."""
    return comm.allreduce(_dense(x), torch.empty(x.shape, dtype=x.dtype, device=x.device),
                          label)


def _front(x: torch.Tensor, dim: int, comm: CountedComm, tag: str) -> torch.Tensor:
    """`x` with `dim` moved to the front, contiguous (a reused scratch copy when needed)."""
    moved = x.detach() if dim == 0 else x.detach().movedim(dim, 0)
    if has_c_strides(moved):
        return moved
    scratch = _scratch(comm, tag, tuple(moved.shape), moved.dtype, moved.device)
    return scratch.copy_(moved)


def all_gather_op(x: torch.Tensor, comm: CountedComm, dim: int, part: Partition,
                  label: str = "") -> torch.Tensor:
    """Concatenate the ranks' pieces along `dim`; rank k's piece is `part.sizes[k]` long."""
    _check_piece(x, dim, part, comm)
    if comm.size == 1:
        return x.detach().clone()
    piece = _front(x, dim, comm, "gather.send")
    inner = math.prod(piece.shape[1:])
    out = torch.empty((part.total, *piece.shape[1:]), dtype=x.dtype, device=x.device)
    comm.allgatherv_(piece, out, part.counts(inner), label)
    return out if dim == 0 else out.movedim(0, dim)


class GatherInFlight:
    """An all-gather issued and not yet waited for (`all_gather_start`). `wait()` completes it
    (once; later calls return the same tensor) and returns what `all_gather_op` would have."""

    def __init__(self, pending: PendingOp | None, result: torch.Tensor, comm: CountedComm,
                 dim: int, part: Partition, label: str) -> None:
        self._pending = pending
        self._result = result  # filled once `pending` completes
        self.adjoint_args = (comm, dim, part, label)  # reduce_scatter_op's, after the gradient

    @property
    def done(self) -> bool:
        return self._pending is None

    def wait(self) -> torch.Tensor:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        return self._result


def all_gather_start(x: torch.Tensor, comm: CountedComm, dim: int, part: Partition,
                     label: str = "") -> GatherInFlight:
    """`all_gather_op(x, comm, dim, part, label)` issued without waiting for it: x's values are
    read while it is in flight (x itself where its layout allows: it must not change until the
    gather completes; else a copy of its own). Counted when it completes, as the blocking one."""
    _check_piece(x, dim, part, comm)
    if comm.size == 1:
        return GatherInFlight(None, x.detach().clone(), comm, dim, part, label)
    moved = x.detach() if dim == 0 else x.detach().movedim(dim, 0)
    piece = (moved if has_c_strides(moved)
             else torch.empty(moved.shape, dtype=moved.dtype, device=moved.device).copy_(moved))
    inner = math.prod(piece.shape[1:])
    out = torch.empty((part.total, *piece.shape[1:]), dtype=x.dtype, device=x.device)
    pending = comm.iallgatherv_(piece, out, part.counts(inner), label)
    return GatherInFlight(pending, out if dim == 0 else out.movedim(0, dim), comm, dim, part,
                          label)


def reduce_scatter_op(x: torch.Tensor, comm: CountedComm, dim: int, part: Partition,
                      label: str = "") -> torch.Tensor:
    """Sum the ranks' whole tensors, then keep this rank's piece along `dim`."""
    if x.shape[dim] != part.total:
        raise ValueError(f"reduce-scatter along dim {dim}: expected {part.total}, got "
                         f"{x.shape[dim]}")
    if comm.size == 1:
        return x.detach().clone()
    full = _front(x, dim, comm, "scatter.send")
    inner = math.prod(full.shape[1:])
    out = torch.empty((part.sizes[comm.rank], *full.shape[1:]), dtype=x.dtype,
                      device=x.device)
    comm.reduce_scatter_(full, out, part.counts(inner), label)
    return out if dim == 0 else out.movedim(0, dim)


def repartition_op(x: torch.Tensor, comm: CountedComm, split_dim: int, split: Partition,
                   new_split_dim: int, new_split: Partition, label: str = "") -> torch.Tensor:
    """From pieces along `split_dim` (whole along `new_split_dim`) to pieces along
    `new_split_dim` (whole along `split_dim`): an all-to-all."""
    if split_dim == new_split_dim:
        raise ValueError("repartition needs two different dims")
    _check_piece(x, split_dim, split, comm)
    if x.shape[new_split_dim] != new_split.total:
        raise ValueError(f"repartition: dim {new_split_dim} must be whole ({new_split.total}), "
                         f"got {x.shape[new_split_dim]}")
    if comm.size == 1:
        return x.detach().clone()
    me = comm.rank
    blocks = [x.detach().narrow(new_split_dim, new_split.offsets[k], new_split.sizes[k])
              for k in range(comm.size)]
    send_counts = [b.numel() for b in blocks]
    send = _scratch(comm, "alltoall.send", (sum(send_counts),), x.dtype, x.device)
    offset = 0
    for block, count in zip(blocks, send_counts, strict=True):
        send[offset:offset + count].view(block.shape).copy_(block)
        offset += count
    shapes = []
    for k in range(comm.size):
        shape = list(x.shape)
        shape[split_dim], shape[new_split_dim] = split.sizes[k], new_split.sizes[me]
        shapes.append(shape)
    recv_counts = [math.prod(s) for s in shapes]
    recv = _scratch(comm, "alltoall.recv", (sum(recv_counts),), x.dtype, x.device)
    comm.alltoallv_(send, send_counts, recv, recv_counts, label)
    pieces, offset = [], 0
    for shape, count in zip(shapes, recv_counts, strict=True):
        pieces.append(recv[offset:offset + count].view(shape))
        offset += count
    return torch.cat(pieces, dim=split_dim)


def exchange_rows_op(x: torch.Tensor, comm: CountedComm, send_counts: tuple[int, ...],
                     recv_counts: tuple[int, ...], label: str = "") -> torch.Tensor:
    """Rows of `x` (dim 0), grouped by destination in rank order, `send_counts[k]` of them to
    rank k (this rank's own kept in place), and the rows every rank sends here, `recv_counts[k]`
    from rank k, in rank order: an all-to-all of uneven counts (the tokens of a mixture of
    experts sent to the ranks holding their experts, or sent back)."""
    if len(send_counts) != comm.size or len(recv_counts) != comm.size:
        raise ValueError(f"exchange rows: {len(send_counts)} send and {len(recv_counts)} "
                         f"receive counts for a group of {comm.size}")
    if x.shape[0] != sum(send_counts) or min((*send_counts, *recv_counts), default=0) < 0:
        raise ValueError(f"exchange rows: rank {comm.rank} holds {x.shape[0]} rows, its send "
                         f"counts {list(send_counts)} sum to {sum(send_counts)}")
    row = math.prod(x.shape[1:])
    out = torch.empty(sum(recv_counts) * row, dtype=x.dtype, device=x.device)
    if comm.size == 1:
        return out.copy_(x.detach().reshape(-1)).view(sum(recv_counts), *x.shape[1:])
    # counted as an all-to-all whose payload is this rank's whole input, its own rows included
    comm.alltoallv_(_dense(x.detach()).reshape(-1), [n * row for n in send_counts], out,
                    [n * row for n in recv_counts], label)
    return out.view(sum(recv_counts), *x.shape[1:])


def ring_shift_op(x: torch.Tensor, comm: CountedComm, dim: int, sizes: tuple[int, ...],
                  offset: int = 1, label: str = "") -> torch.Tensor:
    """y_k = x_{(k − offset) mod P}: every rank sends its tensor `offset` places on around the
    ring and receives the one from `offset` places back (a send and a receive, waited on).
    `sizes[k]` is x's length along `dim` on rank k; every other dim is the same on every rank.
    The ring attention of a split sequence passes key/value blocks this way."""
    if len(sizes) != comm.size:
        raise ValueError(f"ring shift: {len(sizes)} lengths for a group of {comm.size}")
    if x.shape[dim] != sizes[comm.rank]:
        raise ValueError(f"ring shift: rank {comm.rank} holds {x.shape[dim]} along dim {dim}, "
                         f"its length is {sizes[comm.rank]}")
    if comm.size == 1 or offset % comm.size == 0:
        return x.detach().clone()
    source, destination = (comm.rank - offset) % comm.size, (comm.rank + offset) % comm.size
    shape = list(x.shape)
    shape[dim] = sizes[source]
    # flat buffers: an empty tensor's strides need not be row-major's, which MPI checks
    out = torch.empty(math.prod(shape), dtype=x.dtype, device=x.device)
    comm.exchange([(_dense(x).reshape(-1), destination)], [(out, source)], label).wait()
    return out.view(shape)


def ring_shift_adjoint_op(y: torch.Tensor, comm: CountedComm, dim: int,
                          sizes: tuple[int, ...], offset: int = 1,
                          label: str = "") -> torch.Tensor:
    """The adjoint of `ring_shift_op(·, comm, dim, sizes, offset)`: the shift by −offset of
    tensors whose lengths are the forward's outputs' (rank k's: `sizes[k − offset]`)."""
    p = comm.size
    moved = tuple(sizes[(k - offset) % p] for k in range(p))
    return ring_shift_op(y, comm, dim, moved, -offset, label)


def take_piece_op(x: torch.Tensor, comm: CountedComm, dim: int, part: Partition,
                  label: str = "") -> torch.Tensor:
    """This rank's piece along `dim` of the whole `x` (`part.slice(rank)`), no communication."""
    if x.shape[dim] != part.total:
        raise ValueError(f"take piece along dim {dim}: expected {part.total}, got {x.shape[dim]}")
    return x.detach().narrow(dim, part.offsets[comm.rank], part.sizes[comm.rank]).clone()


def place_piece_op(x: torch.Tensor, comm: CountedComm, dim: int, part: Partition,
                   label: str = "") -> torch.Tensor:
    """This rank's piece `x` put at its place along `dim` in zeros of the whole."""
    _check_piece(x, dim, part, comm)
    shape = list(x.shape)
    shape[dim] = part.total
    out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    out.narrow(dim, part.offsets[comm.rank], part.sizes[comm.rank]).copy_(x.detach())
    return out


def _check_piece(x: torch.Tensor, dim: int, part: Partition, comm: CountedComm) -> None:
    if part.parts != comm.size:
        raise ValueError(f"partition into {part.parts} pieces on a group of {comm.size}")
    if x.shape[dim] != part.sizes[comm.rank]:
        raise ValueError(f"rank {comm.rank} holds {x.shape[dim]} along dim {dim}, its piece of "
                         f"{part} is {part.sizes[comm.rank]}")


# -- autograd: forward is the operator, backward its adjoint ---------------------------------------


def _operator(name: str, forward: Callable[..., torch.Tensor],
              adjoint: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An autograd function computing `forward(x, *args)` whose backward is `adjoint(g, *args)`.

    Only `x` is differentiable: the other arguments describe the data movement."""

    # `ctx` is autograd's context object, which holds whatever attributes forward gives it.
    def fwd(ctx: Any, x: torch.Tensor, *args: object) -> torch.Tensor:
        ctx.args = args
        return forward(x, *args)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (adjoint(grad, *ctx.args), *(None for _ in ctx.args))

    # Made by `type` rather than a class statement: autograd names the backward node after the
    # class (`BroadcastBackward`, ...), and a class statement's name is fixed.
    function = cast(type[Function], type(name, (Function,), {"forward": staticmethod(fwd),
                                                             "backward": staticmethod(bwd)}))
    signature = inspect.signature(forward)

    def call(*args: object, **kwargs: object) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)  # Function.apply takes positions only
        bound.apply_defaults()
        out: torch.Tensor = function.apply(*bound.args)
        return out

    call.__name__, call.__doc__ = name, forward.__doc__
    return call


class AllGatherWait(Function):
    """`all_gather`'s forward completed by waiting for a gather already in flight: forward
    returns what `started` gathered from `x`'s values (`x` must hold the values it sent);
    backward is `all_gather`'s, the adjoint reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, started: GatherInFlight) -> torch.Tensor:
        ctx.args = started.adjoint_args
        comm, dim, part, _ = ctx.args
        _check_piece(x, dim, part, comm)
        return started.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reduce_scatter_op(grad, *ctx.args), None


def all_gather_wait(x: torch.Tensor, started: GatherInFlight) -> torch.Tensor:
    """The differentiable end of `all_gather_start(x, ...)`: `all_gather(x, ...)`'s result and
    backward, the communication issued earlier. `x` is the tensor autograd differentiates
    with respect to: the one whose values were sent (or an equal one, made later)."""
    out: torch.Tensor = AllGatherWait.apply(x, started)
    return out


broadcast: Callable[..., torch.Tensor] = _operator(
    "Broadcast", broadcast_op, sum_reduce_op)
sum_reduce: Callable[..., torch.Tensor] = _operator(
    "SumReduce", sum_reduce_op, broadcast_op)
all_sum_reduce: Callable[..., torch.Tensor] = _operator(
    "AllSumReduce", all_sum_reduce_op, all_sum_reduce_op)
all_gather: Callable[..., torch.Tensor] = _operator(
    "AllGather", all_gather_op, reduce_scatter_op)
reduce_scatter: Callable[..., torch.Tensor] = _operator(
    "ReduceScatter", reduce_scatter_op, all_gather_op)
repartition: Callable[..., torch.Tensor] = _operator(
    "Repartition", repartition_op,
    lambda g, comm, split_dim, split, new_dim, new_split, label="": repartition_op(
        g, comm, new_dim, new_split, split_dim, split, label))
exchange_rows: Callable[..., torch.Tensor] = _operator(
    "ExchangeRows", exchange_rows_op,
    lambda g, comm, send_counts, recv_counts, label="": exchange_rows_op(
        g, comm, recv_counts, send_counts, label))
ring_shift: Callable[..., torch.Tensor] = _operator(
    "RingShift", ring_shift_op, ring_shift_adjoint_op)
take_piece: Callable[..., torch.Tensor] = _operator(
    "TakePiece", take_piece_op, place_piece_op)
place_piece: Callable[..., torch.Tensor] = _operator(
    "PlacePiece", place_piece_op, take_piece_op)
