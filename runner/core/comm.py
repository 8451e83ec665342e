"""The counted communicator: every collective goes through here and is recorded.

A record holds the operation, the group size, the payload bytes and the seconds this rank was
blocked in it. Payload bytes are the `n` of the α–β cost of the operation: the buffer for
all-reduce, broadcast and reduce; the whole gathered tensor for all-gather; the whole tensor
before scattering for reduce-scatter; this rank's input for all-to-all. For a non-blocking
operation the seconds are the time spent issuing it plus the time spent waiting for it, i.e. the
part of the communication that was *not* hidden behind computation.

A group of size 1 moves nothing: every operation returns at once and records nothing, and no MPI
call is made. That lets a 1-process run use the same code without initialising MPI at all.

Every blocking call (and the wait of a non-blocking one) also marks itself in flight on the
counter, for the watchdog (`runner.core.watchdog`): one tuple written before the transport's
call, None after it; no lock, since the watchdog thread only reads the attribute (an atomic read).

Operations the device completes after the host has moved on (NCCL's: `work.wait()` makes the
current stream wait, not the host; the transport says which, `stream_ordered`) are timed on the
device instead: a CUDA event is recorded on the current stream before the call (before the wait,
for a non-blocking one) and one after it, and the counter keeps the pair. Calls and bytes count
at once; the seconds (the time the stream was held) are resolved when the totals are read
(`CommCounter.snapshot`, `since`: the training loop reads them after each step), which waits for
the device there and nowhere inside a step. Until its end event has completed, the operation is
in flight for the watchdog (`CommCounter.watched`). On the host nothing of this runs.

The data itself moves through the group's *transport* (`runner.core.mpi_transport.Transport`):
mpi4py (`MpiTransport`, the default) or torch.distributed process groups
(`runner.core.torch_transport`, chosen per grid with `ProcessGrid(..., backend="torch")`).
Records are made here, above the transport, from the operation's logical payload, so the same
operation records the same operation, group, size, bytes and label under either transport, and
measured == predicted bytes holds alike. What a transport physically sends may differ from the
recorded payload (gloo has no uneven all-gather and no true reduce-scatter: see
`runner.core.torch_transport`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

from runner.core.mpi_transport import Backend, MpiTransport, Request, Transport
from runner.core.pace import Pace

# Operation names as records, predictions (`runner.cost.collectives.CommOp`) and JSON output
# spell them: measured and predicted operations are matched on these strings.
# The collectives and point-to-point exchanges, each with an α–β cost (`runner.cost.collectives`):
CollectiveOp = Literal["allreduce", "iallreduce", "allgather", "reduce_scatter", "bcast", "reduce",
                       "alltoall", "alltoallv", "exchange"]
# One-sided accesses (`runner.core.rma`): recorded, never predicted.
OneSidedOp = Literal["rma_read", "rma_add", "rma_write", "rma_lock", "rma_turn"]
RecordedOp = Literal[CollectiveOp, OneSidedOp]
# Small control messages: watched while in flight, not recorded.
ControlOp = Literal["allgather_object", "barrier"]
InFlightOp = Literal[RecordedOp, ControlOp]

# The groups of a process grid (`runner.core.grid`), and a group of one rank alone.
GridGroup = Literal["world", "model", "batch"]
GroupName = Literal[GridGroup, "self"]


@dataclass(frozen=True)
class CommRecord:
    op: RecordedOp
    group: GroupName
    group_size: int
    nbytes: int
    seconds: float
    label: str


@dataclass
class CommTotals:
    calls: int = 0
    nbytes: int = 0
    seconds: float = 0.0


# (operation, group name, group size, label, start time from time.perf_counter())
InFlight = tuple[InFlightOp, GroupName, int, str, float]


class DeviceMark(Protocol):
    """A point in a device's stream of work: a CUDA event with timing, recorded on the current
    stream (`cuda_mark`)."""

    def query(self) -> bool:
        """Whether the device has reached it (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until the device has reached it."""
        ...

    def elapsed_time(self, end_event: Any, /) -> float:
        """Milliseconds from this mark to `end_event` (both reached)."""
        ...


def cuda_mark(tensor: torch.Tensor) -> DeviceMark:
    """A CUDA event recorded now on the current stream of `tensor`'s device."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(tensor.device))
    return event


@dataclass
class _OnDevice:
    """An operation counted on issue whose seconds its device will tell."""

    in_flight: InFlight  # what the watchdog sees until `end` is reached
    start: DeviceMark
    end: DeviceMark
    record: tuple[int, CommRecord] | None  # its record and where, when records are kept


# Unresolved device operations kept at most before the completed ones are resolved anyway (a
# counter nobody reads would otherwise grow for ever).
_MAX_ON_DEVICE = 4096


@dataclass
class CommCounter:
    """Accumulates records from every communicator that shares it (world, row, column groups)."""

    records: list[CommRecord] = field(default_factory=list)
    keep_records: bool = False
    isolate: bool = False  # measure each operation alone (see CountedComm._start)
    totals: CommTotals = field(default_factory=CommTotals)
    # The blocking operation this rank is in now, if any (read by the watchdog thread).
    in_flight: InFlight | None = None
    # What the rank is doing and how long its steps take (its collectives' deadlines).
    pace: Pace = field(default_factory=Pace)
    # How device operations are marked (`DeviceMark`; a fake one in tests).
    mark: Callable[[torch.Tensor], DeviceMark] = cuda_mark
    # Operations timed on a device, oldest first, until their seconds are resolved: appended
    # and removed by the thread that communicates, read by the watchdog's (under the lock).
    _on_device: deque[_OnDevice] = field(default_factory=deque, init=False, repr=False,
                                         compare=False)
    _on_device_lock: threading.Lock = field(default_factory=threading.Lock, init=False,
                                            repr=False, compare=False)

    def add(self, op: RecordedOp, group: GroupName, group_size: int, nbytes: int, seconds: float,
            label: str) -> None:
        totals = self.totals
        totals.calls += 1
        totals.nbytes += nbytes
        totals.seconds += seconds
        if self.keep_records:  # a record object per call only when someone reads them
            self.records.append(CommRecord(op, group, group_size, nbytes, seconds, label))

    def add_on_device(self, issued: CommRecord, began: float, start: DeviceMark,
                      end: DeviceMark) -> None:
        """Count the operation `issued` (its call and bytes now; its seconds, 0 until then, are
        those from `start` to `end` on its device, resolved when the totals are next read),
        issued at `began` (`time.perf_counter()`)."""
        totals = self.totals
        totals.calls += 1
        totals.nbytes += issued.nbytes
        record = None
        if self.keep_records:
            self.records.append(issued)
            record = (len(self.records) - 1, issued)
        in_flight = (issued.op, issued.group, issued.group_size, issued.label, began)
        timed = _OnDevice(in_flight, start, end, record)
        with self._on_device_lock:
            self._on_device.append(timed)
        if len(self._on_device) > _MAX_ON_DEVICE:
            self._resolve(wait=False)

    def _resolve(self, wait: bool) -> None:
        """Add the device operations' seconds, oldest first: all of them, waiting for the
        device (`wait`), or those it has completed."""
        while self._on_device:
            timed = self._on_device[0]
            if wait:
                timed.end.synchronize()
            elif not timed.end.query():
                return
            seconds = timed.start.elapsed_time(timed.end) / 1000
            self.totals.seconds += seconds
            if timed.record is not None:
                index, record = timed.record
                if index < len(self.records) and self.records[index] is record:  # not cleared
                    self.records[index] = replace(record, seconds=seconds)
            with self._on_device_lock:
                self._on_device.popleft()

    def watched(self) -> InFlight | None:
        """What the watchdog times: the blocking operation this rank is in, or the oldest
        operation its device has not completed, whichever began first."""
        host = self.in_flight
        if not self._on_device:
            return host
        with self._on_device_lock:
            timed = tuple(self._on_device)
        device = next((t.in_flight for t in timed if not t.end.query()), None)
        if device is None or (host is not None and host[4] <= device[4]):
            return host
        return device

    def snapshot(self, wait: bool = True) -> CommTotals:
        """The totals so far; a device's operations' seconds all in (`wait`: waiting for the
        device) or those it has completed (a step that reads nothing from the device)."""
        self._resolve(wait)
        return CommTotals(self.totals.calls, self.totals.nbytes, self.totals.seconds)

    def since(self, earlier: CommTotals, wait: bool = True) -> CommTotals:
        """What moved since `earlier` (`wait`: as `snapshot`'s; without it, seconds the device
        has not reported yet count in a later reading's)."""
        self._resolve(wait)
        return CommTotals(
            self.totals.calls - earlier.calls,
            self.totals.nbytes - earlier.nbytes,
            self.totals.seconds - earlier.seconds,
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def has_c_strides(tensor: torch.Tensor) -> bool:
    """Exactly row-major strides. Stricter than `is_contiguous()`, which ignores the strides of
    size-1 dims: mpi4py's DLPack import checks every stride."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True):
        if stride != expected:
            return False
        expected *= size
    return True


def _require_contiguous(tensor: torch.Tensor) -> None:
    if not has_c_strides(tensor):
        raise ValueError("communication buffers must be row-major contiguous tensors")


# -- the counted communicator ---------------------------------------------------------------------


class PendingOp:
    """A non-blocking collective in flight; `wait()` completes it and records it: `issued` is
    its record as issued (its seconds those spent issuing it, to which waiting adds). With
    `on_device` (a tensor of the operation, when the transport's operations on it are only
    ordered on its device's stream) the wait is timed on that device."""

    def __init__(self, owner: CountedComm, issued: CommRecord, request: Request | None,
                 keepalive: tuple[Any, ...] = (), on_device: torch.Tensor | None = None) -> None:
        self._owner = owner
        self._issued = issued
        self._request = request
        self._seconds = issued.seconds
        self._keepalive = keepalive  # the transport reads these buffers until completion
        self._on_device = on_device
        self.done = request is None

    def test(self) -> bool:
        """Drive progress without blocking (MPI progresses non-blocking ops only inside calls;
        torch.distributed's own threads progress them, and this only asks)."""
        if self.done or self._request is None:
            return True
        start = time.perf_counter()
        self.done = self._request.test()
        self._seconds += time.perf_counter() - start
        if self.done:
            self._finish()
        return self.done

    def wait(self) -> None:
        if self.done or self._request is None:
            return
        owner = self._owner
        start = time.perf_counter()
        issued = self._issued
        owner.counter.in_flight = (issued.op, issued.group, issued.group_size, issued.label,
                                   start)
        mark = None if self._on_device is None else owner.counter.mark(self._on_device)
        self._request.wait()
        self.done = True
        if mark is not None and self._on_device is not None:
            # the seconds the stream waits for it (what computation did not hide)
            owner._timed_on_device(replace(issued, seconds=0.0), start, self._on_device, mark)
            self._keepalive = ()
            return
        self._seconds += time.perf_counter() - start
        self._finish()

    def _finish(self) -> None:
        issued = self._issued
        self._owner._record(issued.op, issued.nbytes, self._seconds, issued.label)
        self._keepalive = ()


class CountedComm:
    """A group's communicator (or none, for one process) whose collectives are all counted.

    `mpi_comm` is the group's MPI communicator; `transport` how its data moves: by default
    mpi4py on `mpi_comm` (`MpiTransport`). A grid with backend "torch" passes a
    torch.distributed transport and keeps `mpi_comm` all the same: the one-sided windows of
    `runner.core.rma` are MPI's under either backend (`communicator`).
    """

    def __init__(self, mpi_comm: Any | None, counter: CommCounter,
                 name: GroupName = "world", transport: Transport | None = None) -> None:
        self.mpi_comm = mpi_comm
        self.counter = counter
        self.name = name
        if transport is None and mpi_comm is not None:
            transport = MpiTransport(mpi_comm)
        self.transport = transport
        self.rank: int = 0 if transport is None else transport.rank
        self.size: int = 1 if transport is None else transport.size
        # Which tensors' operations the transport leaves to their device's stream (NCCL's on
        # CUDA tensors): those are timed there (module docstring).
        self._stream_ordered: Callable[[torch.Tensor], bool] | None = getattr(
            transport, "stream_ordered", None)
        self._staging: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"CountedComm({self.name}, rank={self.rank}, size={self.size})"

    @property
    def backend(self) -> Backend:
        """The transport's backend ("mpi" for a group of one without any)."""
        return "mpi" if self.transport is None else self.transport.backend

    @property
    def communicator(self) -> Any:
        """The MPI communicator (under either backend: `runner.core.rma` opens its windows on
        it). Only a group of more than one rank needs one: a group of one returns from every
        operation before reaching MPI."""
        if self.mpi_comm is None:
            raise RuntimeError(f"{self!r} has no MPI communicator")
        return self.mpi_comm

    @property
    def _moved(self) -> Transport:
        """The transport (only a group of one rank has none: it moves nothing)."""
        if self.transport is None:
            raise RuntimeError(f"{self!r} has no communicator")
        return self.transport

    def _start(self, op: CollectiveOp, label: str) -> float:
        """Mark `op` in flight and return its start time. When the counter isolates operations,
        every rank first waits at an (uncounted, but watched) barrier, so the time is the
        operation's own and not the wait for a late peer: what the α–β model describes."""
        counter = self.counter
        start = time.perf_counter()
        counter.in_flight = (op, self.name, self.size, label, start)
        if counter.isolate and self.size > 1:
            self._moved.barrier()
            start = time.perf_counter()
        return start

    def _record(self, op: RecordedOp, nbytes: int, seconds: float, label: str) -> None:
        self.counter.in_flight = None
        self.counter.add(op, self.name, self.size, nbytes, seconds, label)

    def _issued(self, op: CollectiveOp, nbytes: int, label: str,
                seconds: float = 0.0) -> CommRecord:
        """The record of `op` on this group as issued (`seconds`: those known so far)."""
        return CommRecord(op, self.name, self.size, nbytes, seconds, label)

    def _ordered(self, tensor: torch.Tensor) -> bool:
        """Whether the transport's operation on `tensor` is only ordered on its device's stream
        when the call returns, not complete."""
        return self._stream_ordered is not None and self._stream_ordered(tensor)

    def _mark(self, tensor: torch.Tensor) -> DeviceMark | None:
        """A mark on `tensor`'s stream before an operation the device completes later."""
        return self.counter.mark(tensor) if self._ordered(tensor) else None

    def _done(self, op: CollectiveOp, nbytes: int, start: float, label: str,
              tensor: torch.Tensor, mark: DeviceMark | None) -> None:
        """Record the blocking `op` that began at `start`: the seconds the host spent in it, or
        with `mark` (`_mark`) those its device's stream spent, resolved later."""
        if mark is None:
            self._record(op, nbytes, time.perf_counter() - start, label)
        else:
            self._timed_on_device(self._issued(op, nbytes, label), start, tensor, mark)

    def _timed_on_device(self, issued: CommRecord, began: float, tensor: torch.Tensor,
                         mark: DeviceMark) -> None:
        counter = self.counter
        # watched as the device's before the host's mark goes: never out of sight
        counter.add_on_device(issued, began, mark, counter.mark(tensor))
        counter.in_flight = None

    # -- collectives on tensors -------------------------------------------------------------

    def allreduce_(self, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        """Sum `tensor` over the group, in place."""
        if self.size == 1:
            return tensor
        _require_contiguous(tensor)
        transport = self._moved
        start = self._start("allreduce", label)
        mark = self._mark(tensor)
        transport.allreduce_(tensor)
        self._done("allreduce", _nbytes(tensor), start, label, tensor, mark)
        return tensor

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor, label: str = "") -> torch.Tensor:
        """`out` = sum of `tensor` over the group (out of place: no copy of the input needed)."""
        if self.size == 1:
            return out.copy_(tensor)
        _require_contiguous(tensor)
        transport = self._moved
        start = self._start("allreduce", label)
        mark = self._mark(tensor)
        transport.allreduce(tensor, out)
        self._done("allreduce", _nbytes(tensor), start, label, tensor, mark)
        return out

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int = 0,
               label: str = "") -> torch.Tensor | None:
        """Sum of `tensor` over the group into `out` on `root` (out of place; `out` unused
        elsewhere)."""
        if self.size == 1:
            return None if out is None else out.copy_(tensor)
        _require_contiguous(tensor)
        transport = self._moved
        start = self._start("reduce", label)
        mark = self._mark(tensor)
        transport.reduce(tensor, out, root)
        self._done("reduce", _nbytes(tensor), start, label, tensor, mark)
        return out

    def iallreduce_(self, tensor: torch.Tensor, label: str = "") -> PendingOp:
        """Start an in-place sum of `tensor` over the group; complete it with `wait()`."""
        if self.size == 1:
            return PendingOp(self, self._issued("iallreduce", 0, label), None)
        _require_contiguous(tensor)
        transport = self._moved
        start = self._start("iallreduce", label)
        request = transport.iallreduce_(tensor)
        self.counter.in_flight = None  # issued: in flight again only while someone waits for it
        issued = self._issued("iallreduce", _nbytes(tensor), label, time.perf_counter() - start)
        pending = PendingOp(self, issued, request, (tensor,),
                            tensor if self._ordered(tensor) else None)
        if self.counter.isolate:  # no overlap: the operation's own time
            pending.wait()
        return pending

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], label: str = "",
                 tag: int = 0) -> PendingOp:
        """Post non-blocking sends of (tensor, destination) and receives into (tensor, source);
        `wait()` completes them all. Ranks are the group's. Payload: the bytes this rank
        sends."""
        if self.size == 1 or (not sends and not recvs):
            return PendingOp(self, self._issued("exchange", 0, label), None)
        transport = self._moved
        start = self._start("exchange", label)
        request = transport.exchange(sends, recvs, tag)
        self.counter.in_flight = None
        nbytes = sum(_nbytes(buf) for buf, _ in sends)
        buffers = tuple(buf for buf, _ in sends + recvs)
        issued = self._issued("exchange", nbytes, label, time.perf_counter() - start)
        pending = PendingOp(self, issued, request, buffers,
                            buffers[0] if self._ordered(buffers[0]) else None)
        if self.counter.isolate:
            pending.wait()
        return pending

    def bcast_(self, tensor: torch.Tensor, root: int = 0, label: str = "") -> torch.Tensor:
        if self.size == 1:
            return tensor
        _require_contiguous(tensor)
        transport = self._moved
        start = self._start("bcast", label)
        mark = self._mark(tensor)
        transport.bcast_(tensor, root)
        self._done("bcast", _nbytes(tensor), start, label, tensor, mark)
        return tensor

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int],
                    label: str = "") -> torch.Tensor:
        """Concatenate every rank's `piece` (of `counts[rank]` elements) into `out`, by rank."""
        _require_contiguous(piece)
        _require_contiguous(out)
        transport = self._moved
        start = self._start("allgather", label)
        mark = self._mark(out)
        transport.allgatherv_(piece, out, counts)
        self._done("allgather", _nbytes(out), start, label, out, mark)
        return out

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int],
                     label: str = "") -> PendingOp:
        """Start `allgatherv_(piece, out, counts)`; `wait()` completes it and records it as the
        blocking one records ("allgather", the bytes of `out`). Neither buffer may be touched
        until then (the pending operation keeps both alive)."""
        _require_contiguous(piece)
        _require_contiguous(out)
        transport = self._moved
        start = self._start("allgather", label)
        request = transport.iallgatherv_(piece, out, counts)
        self.counter.in_flight = None  # issued: in flight again only while someone waits for it
        issued = self._issued("allgather", _nbytes(out), label, time.perf_counter() - start)
        pending = PendingOp(self, issued, request, (piece, out),
                            out if self._ordered(out) else None)
        if self.counter.isolate:  # no overlap: the operation's own time
            pending.wait()
        return pending

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int],
                        label: str = "") -> torch.Tensor:
        """Sum `full` over the group; rank k receives elements of block k (`counts[k]` long)."""
        _require_contiguous(full)
        _require_contiguous(out)
        transport = self._moved
        start = self._start("reduce_scatter", label)
        mark = self._mark(full)
        transport.reduce_scatter_(full, out, counts)
        self._done("reduce_scatter", _nbytes(full), start, label, full, mark)
        return out

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int], label: str = "",
                   op: Literal["alltoall", "alltoallv"] = "alltoall") -> torch.Tensor:
        """Block k of `send` goes to rank k; block k of `recv` comes from rank k. Recorded as
        `op` with this rank's whole input as payload ("alltoall": equal blocks, self included;
        "alltoallv": irregular blocks whose input holds nothing for this rank itself)."""
        _require_contiguous(send)
        _require_contiguous(recv)
        transport = self._moved
        start = self._start(op, label)
        mark = self._mark(send)
        transport.alltoallv_(send, send_counts, recv, recv_counts)
        self._done(op, _nbytes(send), start, label, send, mark)
        return recv

    def staging(self, tag: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A scratch buffer reused across calls (blocking operations only: it is free again as
        soon as the call that used it returns)."""
        key = (tag, shape, dtype)
        buffer = self._staging.get(key)
        if buffer is None:
            # host: the host tensors' scratch (`primitives._scratch` makes a device's there)
            buffer = self._staging[key] = torch.empty(shape, dtype=dtype)
        return buffer

    # -- small control messages (pickled Python objects) --------------------------------------

    def allgather_object(self, obj: Any, label: str = "") -> list[Any]:
        if self.size == 1:
            return [obj]
        transport = self._moved
        counter = self.counter
        counter.in_flight = ("allgather_object", self.name, self.size, label, time.perf_counter())
        gathered = transport.allgather_object(obj)
        counter.in_flight = None
        return gathered

    def barrier(self, label: str = "") -> None:
        if self.size > 1:
            transport = self._moved
            counter = self.counter
            counter.in_flight = ("barrier", self.name, self.size, label, time.perf_counter())
            transport.barrier()
            counter.in_flight = None


# The calls through which data moves between ranks: `outside_compiled_graphs` keeps them out
# of every compiled graph.
_MOVING = {CountedComm: ("allreduce_", "allreduce", "reduce", "iallreduce_", "exchange", "bcast_",
                         "allgatherv_", "iallgatherv_", "reduce_scatter_", "alltoallv_",
                         "allgather_object", "barrier"),
           PendingOp: ("test", "wait")}
OUTSIDE_GRAPHS = "a collective, counted outside compiled graphs"  # dynamo's reason for a break


def outside_compiled_graphs() -> None:
    """Mark every call that moves data never to be traced by `torch.compile` (`trainer.compile`):
    a compiled region that reaches one breaks its graph there, so a collective always runs,
    and is counted, as the eager step runs it; a `fullgraph` region that reaches one is refused
    before it runs. Done once, by a run that compiles (importing torch._dynamo costs a rank
    1-2 s: one that compiles nothing never pays it)."""
    import torch._dynamo

    for cls, names in _MOVING.items():
        for name in names:
            method = cls.__dict__[name]
            if not getattr(method, "_gridrun_outside_graphs", False):
                disabled = torch._dynamo.disable(method, recursive=True, reason=OUTSIDE_GRAPHS)
                disabled._gridrun_outside_graphs = True
                setattr(cls, name, disabled)
