"""Device tensors through a transport that moves host memory only: staged in host buffers.

An MPI without CUDA support cannot read GPU memory (the `mpich` wheel's Allreduce on CUDA
tensors segfaults), and gloo moves host tensors. `StagedTransport` wraps such a transport: an
operation on device tensors copies its inputs into host buffers, runs the inner transport on
those, and copies the results back into the device tensors; host tensors pass straight through.

Ordering on a GPU, without the host waiting inside a gradient hook:
- the copy to the host runs on a side CUDA stream, after an event recorded on the current stream
  when the operation is issued (it reads what the kernels issued so far write, and nothing
  later);
- the inner transport is called once that copy's event has completed: a blocking operation
  waits for it; a non-blocking one (`iallreduce_`, `iallgatherv_`, `exchange`) returns at once
  and is started by a later `test()`, `wait()` or operation on this transport that finds the
  event complete. Operations start in the order they were issued, so every rank of a group starts
  them in the same order (as MPI and gloo need); any other call into the inner transport starts
  the ones before it first;
- the copy back to the device is issued on the side stream, after an event on the current
  stream, and the current stream waits on its event: kernels issued after the operation
  completes see the result, and the host does not wait for the copy.
The transfer of a gradient bucket, or of a prefetched unit, overlaps the backward, and so do
both copies.

Host buffers come from a pool by (elements, dtype, pinned), so a step reuses the previous
step's. They are page-locked for GPU tensors (a copy from pinned memory runs at the link's full
rate, and only a pinned buffer lets the copy run asynchronously); the pool holds at most
`pool_cap_bytes` (`DEFAULT_POOL_CAP_BYTES`, 1 GiB) of them, in use and kept together: an
operation always gets its buffers, and beyond the cap the kept ones are freed (the oldest first)
and returned buffers are freed rather than kept. A buffer still being copied to the device is
reused only once its copy's event has completed.

On the CPU (`force=True`, `debug.stage_host_tensors`: the path a GPU run takes, exercised on a
machine without one) the copies are plain synchronous ones into unpinned buffers: nothing pins
memory or touches torch.cuda, so a CPU run makes no CUDA context.

What the counted communicator records is unchanged (the operation's logical payload, as for
any transport); the copies are the price of the path and are timed as part of the operation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from runner.core.mpi_transport import Backend, Request, Transport

DEFAULT_POOL_CAP_BYTES = 1 << 30

_Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (device-side tensor, host buffer)
_Key = tuple[int, torch.dtype, bool]  # (elements, dtype, pinned)


class CopyEvent(Protocol):
    """The completion of copies issued to a device's stream (`torch.cuda.Event`)."""

    def query(self) -> bool:
        ...

    def synchronize(self) -> None:
        ...


class DeviceCopies(Protocol):
    """Copies between one device's tensors and host buffers."""

    def to_host(self, pairs: _Pairs) -> CopyEvent | None:
        """Issue the copies of each pair's tensor into its host buffer; the event they complete
        with (None: complete already)."""
        ...

    def to_device(self, pairs: _Pairs) -> CopyEvent | None:
        """Issue the copies of each pair's host buffer into its tensor, ordered before the
        device's later work; the event after which the host buffers may be reused."""
        ...


class HostCopies:
    """Between host tensors: synchronous copies, nothing to wait for."""

    def to_host(self, pairs: _Pairs) -> CopyEvent | None:
        for source, host in pairs:
            host.copy_(source)
        return None

    def to_device(self, pairs: _Pairs) -> CopyEvent | None:
        for target, host in pairs:
            target.copy_(host)
        return None


class CudaCopies:
    """Copies on a side stream of one GPU, ordered against its current stream by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def _after_current(self) -> torch.cuda.Stream:
        current = torch.cuda.current_stream(self.device)
        issued = torch.cuda.Event()
        issued.record(current)
        self.side.wait_event(issued)
        return current

    def to_host(self, pairs: _Pairs) -> CopyEvent | None:
        self._after_current()
        with torch.cuda.stream(self.side):
            for source, host in pairs:
                host.copy_(source, non_blocking=True)
                # The source may be freed on the current stream while the side stream reads it.
                source.record_stream(self.side)
        copied = torch.cuda.Event()
        copied.record(self.side)
        return copied

    def to_device(self, pairs: _Pairs) -> CopyEvent | None:
        current = self._after_current()  # the current stream's reads of the targets go first
        with torch.cuda.stream(self.side):
            for target, host in pairs:
                target.copy_(host, non_blocking=True)
                target.record_stream(self.side)
        copied = torch.cuda.Event()
        copied.record(self.side)
        current.wait_event(copied)
        return copied


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class HostBufferPool:
    """Host buffers by (elements, dtype, pinned), taken for the length of one operation.

    Holds at most `cap_bytes` (default `DEFAULT_POOL_CAP_BYTES`, 1 GiB) of buffers, lent and
    kept together, while the operations in flight need less: a buffer is always lent (an
    operation cannot run without it), a new one first frees kept ones, the oldest first, to fit
    under the cap, and a buffer given back while the pool holds more than the cap is freed. A
    freed pinned buffer still being copied from goes back to torch's pinned-memory allocator,
    which reuses it only after the copy (torch records an event for every asynchronous copy
    from pinned memory)."""

    def __init__(self, cap_bytes: int = DEFAULT_POOL_CAP_BYTES) -> None:
        if cap_bytes < 0:
            raise ValueError(f"a host buffer pool's cap is a number of bytes >= 0, got "
                             f"{cap_bytes}")
        self.cap_bytes = cap_bytes
        self.held_bytes = 0  # lent and kept
        self.allocated_bytes = 0  # every allocation's bytes, all told: a reuse adds nothing
        self._kept: list[tuple[_Key, torch.Tensor, CopyEvent | None]] = []  # oldest first
        self._lent: dict[int, tuple[_Key, torch.Tensor]] = {}  # by address

    @property
    def kept_bytes(self) -> int:
        return sum(_nbytes(flat) for _, flat, _ in self._kept)

    def take(self, like: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """A host buffer shaped like `like` (contents undefined), page-locked if `pinned`."""
        if like.numel() == 0:  # no address to tell it by, and nothing to keep
            return torch.empty(like.shape, dtype=like.dtype)  # host: a staging buffer
        key: _Key = (like.numel(), like.dtype, pinned)
        for i, (kept_key, flat, event) in enumerate(self._kept):
            if kept_key == key and (event is None or event.query()):
                del self._kept[i]
                return self._lend(key, flat).view(like.shape)
        nbytes = like.numel() * like.element_size()
        excess = self.held_bytes + nbytes - self.cap_bytes
        while excess > 0 and self._kept:
            _, freed, _ = self._kept.pop(0)
            self.held_bytes -= _nbytes(freed)
            excess -= _nbytes(freed)
        flat = torch.empty(like.numel(), dtype=like.dtype, pin_memory=pinned)  # host: staging
        self.held_bytes += nbytes
        self.allocated_bytes += nbytes
        return self._lend(key, flat).view(like.shape)

    def _lend(self, key: _Key, flat: torch.Tensor) -> torch.Tensor:
        self._lent[flat.data_ptr()] = (key, flat)
        return flat

    def give(self, buffer: torch.Tensor, event: CopyEvent | None = None) -> None:
        """Return a buffer `take` lent; `event`: a copy from it still in flight."""
        if buffer.numel() == 0:
            return
        key, flat = self._lent.pop(buffer.data_ptr())
        if self.held_bytes > self.cap_bytes:
            self.held_bytes -= _nbytes(flat)
            return
        self._kept.append((key, flat, event))


class _StagedRequest:
    """A non-blocking operation on host buffers: started once its copies to the host have
    completed (`StagedTransport._progress`), its results copied back when it completes."""

    def __init__(self, owner: StagedTransport, start: Callable[[], Request],
                 copies_in: list[CopyEvent], copy_back: _Pairs,
                 held: list[torch.Tensor]) -> None:
        self._owner = owner
        self._start = start
        self._copies_in = copies_in
        self._copy_back = copy_back
        self._held = held
        self._inner: Request | None = None
        self._done = False

    def copied_in(self, block: bool = False) -> bool:
        """Whether the copies to the host are complete (with `block`: once they are)."""
        if block:
            for event in self._copies_in:
                event.synchronize()
            self._copies_in = []
        else:
            self._copies_in = [event for event in self._copies_in if not event.query()]
        return not self._copies_in

    def start(self) -> None:
        self._inner = self._start()

    @property
    def started(self) -> bool:
        return self._inner is not None

    def _finish(self) -> None:
        self._done = True
        self._owner._copy_back(self._copy_back, self._held)

    def test(self) -> bool:
        if self._done:
            return True
        if self._inner is None:
            self._owner._progress()
        if self._inner is not None and self._inner.test():
            self._finish()
        return self._done

    def wait(self) -> None:
        if self._done:
            return
        if self._inner is None:
            self._owner._progress(until=self)
        assert self._inner is not None, "started by _progress"
        self._inner.wait()
        self._finish()


class StagedTransport:
    """`inner` (a host-memory transport) for tensors on any device; see the module docstring.

    `pinned`: page-lock the host buffers of GPU tensors; `force`: stage host tensors too;
    `pool_cap_bytes`: the most bytes of host buffers the pool holds (`HostBufferPool`);
    `copies`: how copies to and from a device's tensors run (by default a `CudaCopies` per GPU
    and `HostCopies` for the host)."""

    def __init__(self, inner: Transport, pinned: bool = True, force: bool = False,
                 pool_cap_bytes: int = DEFAULT_POOL_CAP_BYTES,
                 copies: Callable[[torch.device], DeviceCopies] | None = None) -> None:
        self.inner = inner
        self.backend: Backend = inner.backend
        self.rank: int = inner.rank
        self.size: int = inner.size
        self.force = force
        self.pinned = pinned
        self.pool = HostBufferPool(pool_cap_bytes)
        self._make_copies = copies
        self._copies: dict[torch.device, DeviceCopies] = {}
        self._unstarted: deque[_StagedRequest] = deque()  # issued, in order

    def __repr__(self) -> str:
        return f"StagedTransport({self.inner!r})"

    def _staged(self, tensor: torch.Tensor) -> bool:
        return self.force or tensor.device.type != "cpu"

    def _copies_for(self, device: torch.device) -> DeviceCopies:
        copies = self._copies.get(device)
        if copies is None:
            if self._make_copies is not None:
                copies = self._make_copies(device)
            elif device.type == "cuda":
                copies = CudaCopies(device)
            else:
                copies = HostCopies()
            self._copies[device] = copies
        return copies

    def _take(self, tensor: torch.Tensor) -> torch.Tensor:
        # Only a GPU tensor's buffer is pinned: pinning makes a CUDA context.
        return self.pool.take(tensor, pinned=self.pinned and tensor.device.type == "cuda")

    def _stage_in(self, ins: list[torch.Tensor],
                  outs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                     list[CopyEvent]]:
        """Host buffers for `ins` (copies issued) and for `outs` (contents undefined), and the
        events those copies complete with."""
        host_ins = [self._take(t) for t in ins]
        host_outs = [self._take(t) for t in outs]
        by_device: dict[torch.device, _Pairs] = {}
        for tensor, host in zip(ins, host_ins, strict=True):
            by_device.setdefault(tensor.device, []).append((tensor, host))
        events = [self._copies_for(device).to_host(pairs) for device, pairs in by_device.items()]
        return host_ins, host_outs, [event for event in events if event is not None]

    def _copy_back(self, pairs: _Pairs, held: list[torch.Tensor]) -> None:
        """Copy results to their tensors; the host buffers back to the pool."""
        by_device: dict[torch.device, _Pairs] = {}
        for target, host in pairs:
            by_device.setdefault(target.device, []).append((target, host))
        after: dict[int, CopyEvent] = {}  # a buffer copied from: reused after its copy
        for device, device_pairs in by_device.items():
            event = self._copies_for(device).to_device(device_pairs)
            if event is not None:
                after.update((id(host), event) for _, host in device_pairs)
        for host in held:
            self.pool.give(host, after.get(id(host)))

    def _progress(self, until: _StagedRequest | None = None) -> None:
        """Start the issued operations whose copies to the host are complete, in the order they
        were issued; with `until`, every one up to it, waiting for their copies."""
        while self._unstarted:
            head = self._unstarted[0]
            if not head.copied_in(block=until is not None):
                return
            self._unstarted.popleft()
            head.start()
            if head is until:
                return

    def _drain(self) -> None:
        """Start every issued operation (before anything else goes to the inner transport)."""
        if self._unstarted:
            self._progress(until=self._unstarted[-1])

    def _blocking(self, ins: list[torch.Tensor], outs: list[torch.Tensor],
                  run: Callable[[list[torch.Tensor], list[torch.Tensor]], None],
                  copy_back: Callable[[list[torch.Tensor], list[torch.Tensor]], _Pairs]) -> None:
        """One blocking operation on host buffers: `run(host_ins, host_outs)` once the copies in
        are complete, then the pairs `copy_back(host_ins, host_outs)` names copied back."""
        self._drain()
        host_ins, host_outs, events = self._stage_in(ins, outs)
        for event in events:
            event.synchronize()
        run(host_ins, host_outs)
        self._copy_back(copy_back(host_ins, host_outs), host_ins + host_outs)

    def _issue(self, ins: list[torch.Tensor], outs: list[torch.Tensor],
               start: Callable[[list[torch.Tensor], list[torch.Tensor]], Request],
               copy_back: Callable[[list[torch.Tensor], list[torch.Tensor]], _Pairs]) -> Request:
        """One non-blocking operation on host buffers, started in issue order (`_progress`)."""
        host_ins, host_outs, events = self._stage_in(ins, outs)
        request = _StagedRequest(self, lambda: start(host_ins, host_outs), events,
                                 copy_back(host_ins, host_outs), host_ins + host_outs)
        self._unstarted.append(request)
        self._progress()
        return request

    # -- reductions and broadcasts: one tensor in place, or one in and one out ----------------

    def allreduce_(self, tensor: torch.Tensor) -> None:
        if not self._staged(tensor):
            self._drain()
            return self.inner.allreduce_(tensor)
        self._blocking([tensor], [], lambda i, o: self.inner.allreduce_(i[0]),
                       lambda i, o: [(tensor, i[0])])
        return None

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        if not self._staged(tensor):
            self._drain()
            return self.inner.allreduce(tensor, out)
        self._blocking([tensor], [out], lambda i, o: self.inner.allreduce(i[0], o[0]),
                       lambda i, o: [(out, o[0])])
        return None

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        if not self._staged(tensor):
            self._drain()
            return self.inner.reduce(tensor, out, root)
        outs = [] if out is None else [out]
        self._blocking([tensor], outs,
                       lambda i, o: self.inner.reduce(i[0], o[0] if o else None, root),
                       lambda i, o: [(out, o[0])] if out is not None and self.rank == root else [])
        return None

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        if not self._staged(tensor):
            self._drain()
            return self.inner.iallreduce_(tensor)
        return self._issue([tensor], [], lambda i, o: self.inner.iallreduce_(i[0]),
                           lambda i, o: [(tensor, i[0])])

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        if not self._staged(tensor):
            self._drain()
            return self.inner.bcast_(tensor, root)
        if self.rank == root:
            self._blocking([tensor], [], lambda i, o: self.inner.bcast_(i[0], root),
                           lambda i, o: [])
        else:
            self._blocking([], [tensor], lambda i, o: self.inner.bcast_(o[0], root),
                           lambda i, o: [(tensor, o[0])])
        return None

    # -- movements between ranks ----------------------------------------------------------------

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        if not any(self._staged(buf) for buf, _ in sends + recvs):
            self._drain()
            return self.inner.exchange(sends, recvs, tag)

        def start(host_sends: list[torch.Tensor], host_recvs: list[torch.Tensor]) -> Request:
            return self.inner.exchange(
                [(host, dst) for host, (_, dst) in zip(host_sends, sends, strict=True)],
                [(host, src) for host, (_, src) in zip(host_recvs, recvs, strict=True)], tag)

        return self._issue([buf for buf, _ in sends], [buf for buf, _ in recvs], start,
                           lambda i, o: [(buf, host) for (buf, _), host
                                         in zip(recvs, o, strict=True)])

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        if not self._staged(out):
            self._drain()
            return self.inner.allgatherv_(piece, out, counts)
        self._blocking([piece], [out], lambda i, o: self.inner.allgatherv_(i[0], o[0], counts),
                       lambda i, o: [(out, o[0])])
        return None

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        if not self._staged(out):
            self._drain()
            return self.inner.iallgatherv_(piece, out, counts)
        return self._issue([piece], [out],
                           lambda i, o: self.inner.iallgatherv_(i[0], o[0], counts),
                           lambda i, o: [(out, o[0])])

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        if not self._staged(full):
            self._drain()
            return self.inner.reduce_scatter_(full, out, counts)
        self._blocking([full], [out],
                       lambda i, o: self.inner.reduce_scatter_(i[0], o[0], counts),
                       lambda i, o: [(out, o[0])])
        return None

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        if not self._staged(send):
            self._drain()
            return self.inner.alltoallv_(send, send_counts, recv, recv_counts)
        self._blocking([send], [recv],
                       lambda i, o: self.inner.alltoallv_(i[0], send_counts, o[0],
                                                          recv_counts),
                       lambda i, o: [(recv, o[0])])
        return None

    # -- control ---------------------------------------------------------------------------------

    def allgather_object(self, obj: Any) -> list[Any]:
        self._drain()
        return self.inner.allgather_object(obj)

    def barrier(self) -> None:
        self._drain()
        self.inner.barrier()
