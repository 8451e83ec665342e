"""Bucketed gradient all-reduce, overlapped with backward (the communication of every strategy).

Each parameter's `.grad` is a view into a flat bucket buffer, so autograd accumulates straight
into the buffer and nothing is copied. A post-accumulate-grad hook counts the gradients that are
ready; when a bucket is complete its non-blocking all-reduce is started while backward goes on
computing earlier layers. Buckets are started strictly in index order on every rank, because MPI
requires all ranks to issue collectives on a communicator in the same order, and backward may
finish parameters in a different order than their buckets were laid out.

Buckets are filled in reverse registration order (roughly the order backward produces
gradients); the first bucket is kept small so the first all-reduce starts early (as in DDP).
A bucket lives on the device of its parameters (a bucket never mixes dtypes or devices).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.core import CountedComm, PendingOp
from runner.core.comm import GridGroup
from runner.cost.collectives import CommOp


def _ignore(param: torch.Tensor) -> None:
    """The hook of buckets that no longer exist."""


@dataclass
class _Bucket:
    buffer: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    ready: int = 0
    op: PendingOp | None = None


class GradientBuckets:
    """Sums the gradients of `params` over `comm` with bucketed, overlapped all-reduces, then
    multiplies them by `scale` (1/P for the mean over all P ranks' losses). On a group of one
    only the scaling is left."""

    def __init__(self, params: list[nn.Parameter], comm: CountedComm, scale: float,
                 bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None,
                 label: str = "grad") -> None:
        self.comm = comm
        self.scale = scale
        self.label = label
        self.buckets: list[_Bucket] = []
        self._slot_of: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        self._next_launch = 0
        # Set for the micro-batches before a step's last: their gradients only accumulate into
        # the buckets, and the exchange starts from the last micro-batch's backward.
        self.deferred = False
        trainable = [p for p in params if p.requires_grad]
        caps = [first_bucket_cap_bytes or bucket_cap_bytes, bucket_cap_bytes]
        ordered = list(reversed(trainable))
        # A bucket holds one dtype on one device: both start a new bucket when they change.
        items = [(p.numel() * p.element_size(), (p.dtype, p.device)) for p in ordered]
        for group in group_by_size(items, caps):
            self._add_bucket([ordered[i] for i in group])
        # The hook lives on the tensor, outside the garbage collector's sight: a strong
        # reference to self would keep these buckets (and a model's worth of gradient memory)
        # alive as long as the parameters, after the parallel model is gone.
        on_ready = weakref.WeakMethod(self._on_grad_ready)
        for p in trainable:
            p.register_post_accumulate_grad_hook(
                lambda param, on_ready=on_ready: (on_ready() or _ignore)(param))

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        dtype, device = params[0].dtype, params[0].device
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            view = buffer[offset:offset + p.numel()].view_as(p)
            p.grad = view
            self._slot_of[id(p)] = (len(self.buckets), len(views))
            views.append(view)
            offset += p.numel()
        self.buckets.append(_Bucket(buffer, params, views))

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket_index, index = self._slot_of[id(param)]
        bucket = self.buckets[bucket_index]
        grad = param.grad
        assert grad is not None, "the hook runs once the gradient is accumulated into .grad"
        if grad is not bucket.views[index]:
            # Someone replaced .grad (e.g. set it to None and autograd made a new one): put it
            # back into the bucket so the exchange sees it.
            bucket.views[index].copy_(grad)
            param.grad = bucket.views[index]
        if self.deferred:
            return
        bucket.ready += 1
        self._launch_ready()
        # MPI progresses non-blocking collectives only inside MPI calls: poke the ones in flight.
        for b in self.buckets[: self._next_launch]:
            if b.op is not None and not b.op.done:
                b.op.test()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.op = self.comm.iallreduce_(bucket.buffer, label=self.label)
        self._next_launch += 1

    def finish(self) -> None:
        """Start what backward left unstarted (unused parameters), wait for all, scale."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for bucket in self.buckets:
            assert bucket.op is not None
            bucket.op.wait()
            if self.scale != 1.0:
                bucket.buffer.mul_(self.scale)
            bucket.ready = 0
            bucket.op = None
        self._next_launch = 0

    def zero_(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def refresh(self) -> None:
        """Every rank's copy is current after each step: nothing to do."""

    def report(self) -> dict[str, dict[str, Any]]:
        return {}


def group_by_size(items: Sequence[tuple[int, Hashable]], caps: list[int]) -> list[list[int]]:
    """Indices of consecutive items (bytes, kind) of the same kind (a dtype, or a dtype and a
    device) grouped into buckets; bucket k holds at most caps[min(k, -1)] bytes (an item larger
    than the cap gets a bucket of its own)."""
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index, (nbytes, kind) in enumerate(items):
        cap = caps[min(len(groups), len(caps) - 1)]
        if current and (current_bytes + nbytes > cap or kind != items[current[0]][1]):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += nbytes
    if current:
        groups.append(current)
    return groups


def predict_gradient_ops(layers: list[tuple[str, list[tuple[int, torch.dtype]]]],
                         group: GridGroup, group_size: int, bucket_cap_bytes: int,
                         first_bucket_bytes: int) -> list[CommOp]:
    """The bucket all-reduces `GradientBuckets` issues for parameters given as (layer label,
    [(bytes, dtype) per parameter]) in registration order, on a group of `group_size`."""
    if group_size == 1:
        return []
    flat = [(label, item) for label, items in layers for item in items]
    ordered = list(reversed(flat))
    ops: list[CommOp] = []
    for bucket in group_by_size([item for _, item in ordered],
                                [first_bucket_bytes or bucket_cap_bytes, bucket_cap_bytes]):
        labels = sorted({ordered[i][0] for i in bucket})
        ops.append(CommOp("iallreduce", group, group_size,
                          sum(ordered[i][1][0] for i in bucket), "grad " + ",".join(labels)))
    return ops
