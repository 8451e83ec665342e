"""Device tensors through a transport that moves host memory only: staged in host buffers.

An MPI without CUDA support cannot read GPU memory (the `mpich` wheel's Allreduce on CUDA
tensors segfaults), and gloo moves host tensors. `StagedTransport` wraps such a transport: an
operation on device tensors copies its inputs into host buffers, runs the inner transport on
those, and copies the results back into the device tensors; host tensors pass straight through.
The buffers are page-locked when the device is a GPU (a copy from pinned memory runs at the
link's full rate and needs no bounce buffer of the driver's) and come from a pool by (elements,
dtype), so a step reuses the previous step's buffers.

Ordering: the copy to the host is synchronous (the inner transport reads the buffer as soon as
it is called, and the device tensor may still be being written by a kernel in flight); the copy
back is synchronous too, so a buffer returned to the pool is never still being read by the
device. A non-blocking operation (`iallreduce_`, `iallgatherv_`, `exchange`) copies its inputs
when it is issued and its results when it completes (`_StagedRequest`): the transfer of a
gradient bucket, or of a prefetched unit, overlaps the computation, the copies do not.

What the counted communicator records is unchanged (the operation's logical payload, as for
any transport); the copies are the price of the path and are timed as part of the operation.

`force=True` stages host tensors too (`debug.stage_host_tensors`): the path a GPU run takes,
exercised on a machine without one.
"""

from __future__ import annotations

from typing import Any

import torch

from runner.core.comm import Backend, Request, Transport


class HostBufferPool:
    """Host buffers by (elements, dtype), taken for the length of one operation."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.allocated_bytes = 0

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like `like` (contents undefined)."""
        free = self._free.get((like.numel(), like.dtype))
        if free:
            flat = free.pop()
        else:
            flat = torch.empty(like.numel(), dtype=like.dtype, pin_memory=self.pinned)
            self.allocated_bytes += flat.numel() * flat.element_size()
        return flat.view(like.shape)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer.view(-1))


class _StagedRequest:
    """An inner request whose results are copied back to the device when it completes."""

    def __init__(self, inner: Request, copy_back: list[tuple[torch.Tensor, torch.Tensor]],
                 pool: HostBufferPool, held: list[torch.Tensor]) -> None:
        self._inner = inner
        self._copy_back = copy_back  # (device tensor, host buffer)
        self._pool = pool
        self._held = held
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            for device_tensor, host in self._copy_back:
                device_tensor.copy_(host)
            for host in self._held:
                self._pool.give(host)

    def test(self) -> bool:
        if self._done:
            return True
        if self._inner.test():
            self._finish()
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._inner.wait()
            self._finish()


class StagedTransport:
    """`inner` (a host-memory transport) for tensors on any device; see the module docstring."""

    def __init__(self, inner: Transport, pinned: bool | None = None, force: bool = False) -> None:
        self.inner = inner
        self.backend: Backend = inner.backend
        self.rank: int = inner.rank
        self.size: int = inner.size
        self.force = force
        self.pool = HostBufferPool(torch.cuda.is_available() if pinned is None else pinned)

    def __repr__(self) -> str:
        return f"StagedTransport({self.inner!r})"

    def _staged(self, tensor: torch.Tensor) -> bool:
        return self.force or tensor.device.type != "cpu"

    def _to_host(self, tensor: torch.Tensor, copy: bool = True) -> torch.Tensor:
        host = self.pool.take(tensor)
        if copy:
            host.copy_(tensor)
        return host

    def _back(self, pairs: list[tuple[torch.Tensor, torch.Tensor]],
              held: list[torch.Tensor]) -> None:
        for device_tensor, host in pairs:
            device_tensor.copy_(host)
        for host in held:
            self.pool.give(host)

    # -- reductions and broadcasts: one tensor in place, or one in and one out ----------------

    def allreduce_(self, tensor: torch.Tensor) -> None:
        if not self._staged(tensor):
            return self.inner.allreduce_(tensor)
        host = self._to_host(tensor)
        self.inner.allreduce_(host)
        self._back([(tensor, host)], [host])
        return None

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if not self._staged(tensor):
            return self.inner.allreduce(tensor, out)
        host_in, host_out = self._to_host(tensor), self._to_host(out, copy=False)
        self.inner.allreduce(host_in, host_out)
        self._back([(out, host_out)], [host_in, host_out])
        return None

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        if not self._staged(tensor):
            return self.inner.reduce(tensor, out, root)
        host_in = self._to_host(tensor)
        host_out = None if out is None else self._to_host(out, copy=False)
        self.inner.reduce(host_in, host_out, root)
        pairs = [] if out is None or host_out is None or self.rank != root else [(out, host_out)]
        self._back(pairs, [host_in] + ([] if host_out is None else [host_out]))
        return None

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        if not self._staged(tensor):
            return self.inner.iallreduce_(tensor)
        host = self._to_host(tensor)
        return _StagedRequest(self.inner.iallreduce_(host), [(tensor, host)], self.pool, [host])

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        if not self._staged(tensor):
            return self.inner.bcast_(tensor, root)
        host = self._to_host(tensor, copy=self.rank == root)
        self.inner.bcast_(host, root)
        self._back([] if self.rank == root else [(tensor, host)], [host])
        return None

    # -- movements between ranks ----------------------------------------------------------------

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        if not any(self._staged(buf) for buf, _ in sends + recvs):
            return self.inner.exchange(sends, recvs, tag)
        host_sends = [(self._to_host(buf), dst) for buf, dst in sends]
        host_recvs = [(self._to_host(buf, copy=False), src) for buf, src in recvs]
        request = self.inner.exchange(host_sends, host_recvs, tag)
        copy_back = [(buf, host) for (buf, _), (host, _) in zip(recvs, host_recvs, strict=True)]
        held = [host for host, _ in host_sends + host_recvs]
        return _StagedRequest(request, copy_back, self.pool, held)

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        if not self._staged(out):
            return self.inner.allgatherv_(piece, out, counts)
        host_piece, host_out = self._to_host(piece), self._to_host(out, copy=False)
        self.inner.allgatherv_(host_piece, host_out, counts)
        self._back([(out, host_out)], [host_piece, host_out])
        return None

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        if not self._staged(out):
            return self.inner.iallgatherv_(piece, out, counts)
        host_piece, host_out = self._to_host(piece), self._to_host(out, copy=False)
        request = self.inner.iallgatherv_(host_piece, host_out, counts)
        return _StagedRequest(request, [(out, host_out)], self.pool, [host_piece, host_out])

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        if not self._staged(full):
            return self.inner.reduce_scatter_(full, out, counts)
        host_full, host_out = self._to_host(full), self._to_host(out, copy=False)
        self.inner.reduce_scatter_(host_full, host_out, counts)
        self._back([(out, host_out)], [host_full, host_out])
        return None

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        if not self._staged(send):
            return self.inner.alltoallv_(send, send_counts, recv, recv_counts)
        host_send, host_recv = self._to_host(send), self._to_host(recv, copy=False)
        self.inner.alltoallv_(host_send, send_counts, host_recv, recv_counts)
        self._back([(recv, host_recv)], [host_send, host_recv])
        return None

    # -- control ---------------------------------------------------------------------------------

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def barrier(self) -> None:
        self.inner.barrier()
