"""torch.distributed as the core's transport: the `Transport`s of a grid with backend "torch"
(`grid_transports`), over the process groups of `runner.core.torchdist` (which must be
initialised first). A group of more than one rank gets a `TorchTransport`, a group of one a
`LocalTransport`, which moves nothing.

Under NCCL nothing of an operation goes through the host: every collective is NCCL's own call on
the device tensors (the sparse exchange's rows travel by all-to-all), and point-to-point
exchanges (halos, ring attention) are one `batch_isend_irecv` per exchange. NCCL's communicator
is connected when the group is made (collective over its ranks then), so an exchange in which
some ranks have nothing to send or receive never makes the connection with only part of the
group. The host does not wait for an NCCL operation: `work.wait()` makes the current stream wait
for it and returns. The transport names such operations (`stream_ordered`): `CountedComm` times
them with CUDA events on the current stream and the watchdog sees each in flight until the
device has completed it (`runner.core.comm`).

Speed on host tensors: gloo on one host goes through TCP on the loopback and hands every
operation to a worker thread. Measured on 2 cores, a 1 KiB all-reduce takes 1.2–2 ms on 2 ranks
and 5–6 ms on 4 (pure torch.distributed the same), against MPICH's 20 µs and 0.3 ms through
shared memory: on host tensors "mpi" is the faster backend; "torch" is there for NCCL. And a
rank waiting in gloo sleeps where one waiting in MPI spins: mixing the two (an MPI collective
while peers are in gloo) takes the cores from the ranks at work on an oversubscribed machine.

The calls, per operation, under NCCL and on gloo (torch 2.13). Host tensors take the same call
as device tensors wherever gloo has it, so that the CPU suite runs the NCCL path; the recorded
payload is `CountedComm`'s, the same as under MPI, whatever moves physically:

- all-reduce, reduce, broadcast: `all_reduce`, `reduce`, `broadcast` on both. gloo's `reduce`
  uses its buffer as scratch on every rank, so non-roots reduce a copy (under NCCL too: one
  path).
- all-to-all-v: `all_to_all_single` with split sizes on both.
- point-to-point: `batch_isend_irecv` on both; under NCCL one group call (see `exchange`).
- all-gather with equal pieces: `all_gather_single` (`all_gather_into_tensor` before torch
  2.13) on both.
- all-gather with uneven pieces. Under NCCL: each piece padded to the longest, one
  `all_gather_single` into a P·longest buffer, then each rank's piece cut out into the output.
  Not the list form (`all_gather` with pieces of their own sizes): NCCL runs that as P
  broadcasts in a group, where one all-gather runs NCCL's own algorithm; most of gridrun's
  pieces come from balanced partitions (shards, activations), which differ by at most one
  slice, so the padding moves almost nothing more; and gloo refuses the list form with uneven
  pieces, so the CPU could not check it. Where padding would add more than a quarter to the
  bytes and over 64 KiB (`padding_pays`: pieces far apart, as the sparse exchange's rows can
  be), the pieces go as the all-to-all-v below, which moves only the pieces. gloo's
  all-gather would move P·longest too, and is slower than an all-to-all-v here, so host
  tensors go as an all-to-all-v in which each rank sends its piece to every rank: each rank
  sends (P−1)·its piece and receives exactly the others' pieces, the bytes of MPI's
  Allgatherv (measured on 4 ranks with one piece twice the others: 1.5 ms against 4.1 ms for
  20 KiB, 32 ms against 80 ms for 20 MiB). The non-blocking all-gather (`iallgatherv_`)
  issues the same work without waiting for it (gloo's worker threads, or the GPU, move it
  while the caller computes); the padded form's cut runs when it completes.
- reduce-scatter. Under NCCL: `reduce_scatter_single` (`reduce_scatter_tensor` before torch
  2.13); with uneven blocks each block padded to the longest first and this rank's cut from
  the result (where the padding pays, as for the all-gather; else the host path below). gloo
  has no reduce-scatter of its own in torch 2.13: its `reduce_scatter_single`
  all-reduces a copy of the whole tensor and keeps this rank's chunk, about twice the bytes of
  a reduce-scatter. Host tensors take the direct (pairwise) algorithm: an all-to-all-v sends
  block k of each rank's tensor to rank k (n − n_k elements sent per rank, the least a
  reduce-scatter can), and rank k sums the P blocks it received, in rank order. Measured on 4
  ranks of 2 cores: 1.3 ms against gloo's 5.7 ms for 16 KiB, 20 ms against 41 ms for 16 MiB.
  The record is the whole tensor, as under MPI (the convention of the α–β cost).

`TorchTransport.native_on_host` runs the device path's calls on host tensors too (the padded
all-gather and gloo's reduce-scatter): tests/mpi/check_core.py checks with real ranks on gloo
that they give the host path's results and records.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from runner.core.mpi_transport import Backend, Request, Transport
from runner.core.torchdist import backend_for, process_groups, session_rank

# torch 2.13 renamed these two (the old names still work, with a warning): whichever this
# torch has.
_all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single",
                                                 dist.all_gather_into_tensor)
_reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single",
                                                     dist.reduce_scatter_tensor)


def grid_transports(mpi_comms: Sequence[Any],
                    device_types: Sequence[str] = ("cpu",)) -> list[Transport]:
    """A transport per MPI communicator of a grid (world, model, batch, in that order on every
    rank), over the same ranks in the same order, with groups for tensors on each of
    `device_types`. Collective over each communicator."""
    rank = session_rank()
    members = [list(comm.allgather(rank)) for comm in mpi_comms]
    transports: list[Transport] = []
    for comm, ranks in zip(mpi_comms, members, strict=True):
        transport: Transport = (LocalTransport() if len(ranks) == 1
                                else TorchTransport(ranks, device_types))
        assert transport.rank == comm.Get_rank(), (transport, comm.Get_rank())
        transports.append(transport)
    return transports


class _TorchRequest:
    """Works in flight; `finish` runs once, when they are complete (a padded all-gather's cut).
    Complete means complete for the current stream too: under NCCL `wait()` makes the stream
    wait (the host does not), so `test()` calls it once the works are done."""

    def __init__(self, works: list[dist.Work], keepalive: tuple[torch.Tensor, ...] = (),
                 finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._keepalive = keepalive  # buffers of the transport's own the works read
        self._finish = finish
        self._done = False

    def _complete(self) -> None:
        for work in self._works:
            work.wait()
        if not self._done:
            self._done = True
            if self._finish is not None:
                self._finish()
            self._keepalive = ()

    def test(self) -> bool:
        if not self._done and all(work.is_completed() for work in self._works):
            self._complete()
        return self._done

    def wait(self) -> None:
        if not self._done:
            self._complete()


class _Done:
    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def _flat(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` elements of a row-major tensor, as a 1-D view."""
    return tensor.view(-1)[:count]


def _started(work: Any) -> dist.Work:
    """The work of a functional collective called with `async_op=True` (typed as optional)."""
    assert work is not None
    return cast(dist.Work, work)


# The most padding an uneven all-gather or reduce-scatter takes under NCCL: a quarter of the
# bytes, or any amount under 64 KiB (latency, not bytes, prices such a call).
PAD_SHARE = 0.25
PAD_BYTES = 64 * 1024


def padding_pays(counts: list[int], element_size: int) -> bool:
    """Whether uneven pieces of `counts` elements go padded to the longest (module docstring):
    the padding adds at most `PAD_SHARE` of the bytes, or at most `PAD_BYTES`."""
    padding = len(counts) * max(counts) - sum(counts)
    return padding <= PAD_SHARE * sum(counts) or padding * element_size <= PAD_BYTES


def pad_blocks(flat: torch.Tensor, counts: list[int], padded: torch.Tensor) -> None:
    """Block k of `flat` (`counts[k]` elements, in order) into row k of `padded` (P × longest);
    the rest of each row is left as it is (it never reaches a result)."""
    rows = padded.view(len(counts), -1)
    offset = 0
    for k, count in enumerate(counts):
        rows[k, :count].copy_(flat[offset:offset + count])
        offset += count


def cut_blocks(padded: torch.Tensor, counts: list[int], flat: torch.Tensor) -> None:
    """The inverse of `pad_blocks`: the first `counts[k]` elements of row k, end to end."""
    rows = padded.view(len(counts), -1)
    offset = 0
    for k, count in enumerate(counts):
        flat[offset:offset + count].copy_(rows[k, :count])
        offset += count


class TorchTransport:
    """torch.distributed process groups over the job's ranks `ranks` (group rank k is job rank
    `ranks[k]`, as in the MPI communicator it mirrors); each operation goes to the group's
    backend for its tensors' device. Blocking operations wait for their work (on the host, the
    GIL released meanwhile: the watchdog's thread runs; under NCCL the current stream waits and
    the host goes on, see `stream_ordered`)."""

    backend: Backend = "torch"
    # The device path's calls for host tensors too, where gloo's own are slower (module
    # docstring): for checks on the CPU.
    native_on_host = False

    def __init__(self, ranks: Sequence[int], device_types: Sequence[str] = ("cpu",)) -> None:
        self.global_ranks = list(ranks)
        self.size: int = len(self.global_ranks)
        self.rank: int = self.global_ranks.index(session_rank())
        self.groups = process_groups(self.global_ranks, tuple(dict.fromkeys(("cpu",
                                                                              *device_types))))
        self._device_types = frozenset(("cpu", *device_types))
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"TorchTransport(rank {self.rank} of ranks {self.global_ranks})"

    def stream_ordered(self, tensor: torch.Tensor) -> bool:
        """Whether an operation on `tensor` is only ordered on its device's current stream when
        the call returns, not complete: NCCL's, on CUDA tensors (`runner.core.comm` times these
        with CUDA events, and the watchdog watches them until the device completes them)."""
        return tensor.is_cuda

    def _native(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` takes the device path's calls (module docstring)."""
        return tensor.is_cuda or self.native_on_host

    def _group(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        return self._group_for(tensor.device.type)

    def _group_for(self, device_type: str) -> dist.ProcessGroup:
        """The group, once it is known to have a backend for `device_type` (made with the
        transport: made on first use, a backend would be collective over ranks that may not
        all be in this operation)."""
        if device_type not in self._device_types:
            raise ValueError(f"{self!r} has no {backend_for(torch.device(device_type))} group "
                             f"for {device_type} tensors: the grid stages them through the host "
                             f"(runner.core.grid.DevicePaths)")
        return self.groups.group

    def _buffer(self, tag: str, count: int, like: torch.Tensor) -> torch.Tensor:
        """A 1-D scratch buffer of `count` elements, reused across blocking calls (on a device,
        reuse is ordered by the stream: the next call's work is queued after this one's)."""
        key = (tag, like.dtype, like.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = self._scratch[key] = torch.empty(count, dtype=like.dtype,
                                                      device=like.device)
        return buffer[:count]

    def allreduce_(self, tensor: torch.Tensor) -> None:
        _started(dist.all_reduce(tensor, group=self._group(tensor), async_op=True)).wait()

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        self.allreduce_(out.copy_(tensor))

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        # gloo reduces in the buffer it is given, on every rank: the input stays untouched.
        if self.rank == root:
            assert out is not None, "the root of a reduce needs its output"
            buffer = out.copy_(tensor)
        else:
            buffer = self._buffer("reduce", tensor.numel(), tensor).view(tensor.shape)
            buffer.copy_(tensor)
        _started(dist.reduce(buffer, group=self._group(buffer), group_dst=root,
                             async_op=True)).wait()

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        return _TorchRequest([_started(dist.all_reduce(tensor, group=self._group(tensor),
                                                       async_op=True))])

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        """Every send and receive of this rank, posted at once by `batch_isend_irecv` (one per
        device type; tags match under gloo, NCCL has none).

        Why it cannot deadlock: no rank posts a receive and then waits for it before posting
        its sends. On gloo every send and receive is posted without waiting, and the request
        waits for them all afterwards. Under NCCL the batch is one group call
        (ncclGroupStart … ncclGroupEnd): NCCL launches the sends and receives of the group
        together and progresses them concurrently, so a rank's receive from a peer and its send
        to it are in flight at once, whatever their order in the list; the peer's matching
        batch holds the complementary pair. Messages between two ranks in one direction match
        in the order they are posted; every rank of the group issues its exchanges in the same
        program order (an exchange is collective over the group), so the k-th exchange of a
        rank meets the k-th of its peers, and the halo and ring exchanges post at most one
        message to each peer. A rank with nothing to send or receive skips the exchange; the
        others' batches do not involve it, and the communicator is already connected (made
        with the group), so nobody waits for it.
        """
        works: list[dist.Work] = []
        for kind in dict.fromkeys(buf.device.type for buf, _ in recvs + sends):
            group = self._group_for(kind)
            ops = [dist.P2POp(dist.irecv, buf, group=group, tag=tag, group_peer=src)
                   for buf, src in recvs if buf.device.type == kind]
            ops += [dist.P2POp(dist.isend, buf, group=group, tag=tag, group_peer=dst)
                    for buf, dst in sends if buf.device.type == kind]
            works += [work for work in dist.batch_isend_irecv(ops) if work is not None]
        return _TorchRequest(works)

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        _started(dist.broadcast(tensor, group=self._group(tensor), group_src=root,
                                async_op=True)).wait()

    def _gather(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int],
                scratch: bool) -> Request:
        """Start the all-gather of `allgatherv_`; `scratch`: the transport's reused buffers
        (blocking calls), else buffers of the request's own."""
        total, mine = sum(counts), counts[self.rank]
        if total == 0:
            return _Done()  # every rank knows the counts: all skip alike
        group = self._group(out)
        flat_out, flat_piece = _flat(out, total), _flat(piece, mine)
        if all(count == mine for count in counts):
            return _TorchRequest([_started(_all_gather_single(flat_out, flat_piece, group=group,
                                                              async_op=True))])
        if self._native(out) and padding_pays(counts, out.element_size()):
            # Padded to the longest piece, then cut (module docstring). In place: this rank's
            # piece in its own row of the padded buffer is the input.
            longest = max(counts)
            padded = (self._buffer("allgather.padded", self.size * longest, out) if scratch
                      else out.new_empty(self.size * longest))
            own = padded[self.rank * longest:(self.rank + 1) * longest]
            own[:mine].copy_(flat_piece)
            work = _started(_all_gather_single(padded, own, group=group, async_op=True))
            return _TorchRequest([work], (padded,),
                                 lambda: cut_blocks(padded, counts, flat_out))
        # Uneven, on gloo or far apart: each rank's piece to every rank (module docstring).
        copies = (self._buffer("allgather.send", self.size * mine, piece) if scratch
                  else piece.new_empty(self.size * mine))
        copies.view(self.size, mine).copy_(flat_piece.expand(self.size, mine))
        work = _started(dist.all_to_all_single(flat_out, copies, counts, [mine] * self.size,
                                               group=group, async_op=True))
        return _TorchRequest([work], (copies,))

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        self._gather(piece, out, counts, scratch=True).wait()

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        return self._gather(piece, out, counts, scratch=False)

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        total, mine = sum(counts), counts[self.rank]
        if total == 0:
            return
        group = self._group(full)
        even = all(count == mine for count in counts)
        if self._native(full) and (even or padding_pays(counts, full.element_size())):
            if even:
                _started(_reduce_scatter_single(_flat(out, mine), _flat(full, total),
                                                group=group, async_op=True)).wait()
                return
            # Each block padded to the longest, this rank's cut from the result.
            longest = max(counts)
            padded = self._buffer("reduce_scatter.padded", self.size * longest, full)
            pad_blocks(_flat(full, total), counts, padded)
            result = self._buffer("reduce_scatter.result", longest, full)
            _started(_reduce_scatter_single(result, padded, group=group, async_op=True)).wait()
            _flat(out, mine).copy_(result[:mine])
            return
        # On gloo, or far apart: block k to rank k, then this rank's P blocks summed.
        blocks = self._buffer("reduce_scatter.recv", self.size * mine, full)
        _started(dist.all_to_all_single(blocks, _flat(full, total), [mine] * self.size, counts,
                                        group=group, async_op=True)).wait()
        torch.sum(blocks.view(self.size, mine), dim=0, out=_flat(out, mine))

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        _started(dist.all_to_all_single(_flat(recv, sum(recv_counts)),
                                        _flat(send, sum(send_counts)), recv_counts, send_counts,
                                        group=self._group(send), async_op=True)).wait()

    def allgather_object(self, obj: Any) -> list[Any]:
        # host: a pickled object and its length (control, never model tensors)
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)  # host: control
        lengths = torch.empty(self.size, dtype=torch.int64)  # host: control
        self.allgatherv_(length, lengths, [1] * self.size)
        counts = [int(n) for n in lengths.tolist()]
        everything = torch.empty(sum(counts), dtype=torch.uint8)  # host: pickled bytes
        self.allgatherv_(data, everything, counts)
        gathered, offset = [], 0
        for count in counts:
            # host: the gathered bytes, unpickled
            gathered.append(pickle.loads(everything[offset:offset + count].numpy().tobytes()))
            offset += count
        return gathered

    def barrier(self) -> None:
        self.groups.backends["cpu"].barrier(dist.BarrierOptions()).wait()


class LocalTransport:
    """A group of one rank under backend "torch": no process group, nothing moves. Only the
    operations `CountedComm` does not answer itself for one rank reach it (they are recorded
    as under MPI, whose group of one copies locally too)."""

    backend: Backend = "torch"
    rank = 0
    size = 1

    def allreduce_(self, tensor: torch.Tensor) -> None:
        return None

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(tensor)

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        if out is not None:
            out.copy_(tensor)

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        return _Done()

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        for (send, _), (recv, _) in zip(sends, recvs, strict=False):  # to itself, in order
            recv.copy_(send)
        return _Done()

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        return None

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        _flat(out, counts[0]).copy_(_flat(piece, counts[0]))

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        self.allgatherv_(piece, out, counts)
        return _Done()

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        _flat(out, counts[0]).copy_(_flat(full, counts[0]))

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        _flat(recv, recv_counts[0]).copy_(_flat(send, send_counts[0]))

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None
