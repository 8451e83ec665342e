"""torch.distributed as the core's transport, bootstrapped from the MPI job already running.

`init_torch_distributed(mpi_comm)` (collective over the job's MPI communicator, once per process):
rank 0 opens the rendezvous store on a TCP port the operating system picks on its host (no race
for a "free" port), shares its address and port over MPI, and every rank joins the default
process group with that store. Launching is unchanged: `mpiexec` starts the ranks, MPI tells
them where to meet. `shutdown_torch_distributed()` destroys every process group (every rank, at
the end).

A grid built with `ProcessGrid(..., backend="torch")` gets process groups over the same ranks
as its MPI Cartesian communicators, in the same order (`grid_transports`): its world, its model
group and its batch group, each made once per process and reused by later grids over the same
ranks. These are the core's own gloo groups (`torch.distributed.ProcessGroupGloo` on a prefix of
the rendezvous store named after the group's ranks), made by their members only, so a grid
carved out of part of the job needs nothing from the ranks outside it. Not
`torch.distributed.new_group`: made by members only (`use_local_synchronization`) it names a
group after its ranks *and the number of groups the process made before*, so a rank that sat
out an earlier grid names the group differently from its peers and the group never forms;
made by every rank of the job, a grid could not be carved out of part of it. Every rank
creates its groups in the same order (world, model, batch), so no two wait for each other in
opposite orders. The default group `init_process_group` makes stays for any other
torch.distributed code of the run (a benchmark's DDP); the grids' traffic does not use it.

Backends by device: a group's backend is chosen by the device of the tensors an operation
moves (`backend_for`): gloo for host tensors, NCCL for CUDA tensors when the grid asks for it
(`grid_transports(..., device_types=("cpu", "cuda"))`: every rank has a GPU of its own; NCCL
refuses two ranks on one GPU, "Duplicate GPU detected"). Otherwise the grid stages CUDA tensors
through host buffers into gloo (`runner.core.staging`). Under NCCL, point-to-point exchanges
(halos, the sparse exchange's rows) still go through gloo on host copies: NCCL's send and
receive must be issued as one group call on both sides, or two ranks that each post a receive
first wait for each other for ever, and a group call of a backend object is not public API.

Speed on host tensors: gloo on one host goes through TCP on the loopback and hands every
operation to a worker thread. Measured on 2 cores, a 1 KiB all-reduce takes 1.2–2 ms on 2 ranks
and 5–6 ms on 4 (pure torch.distributed the same), against MPICH's 20 µs and 0.3 ms through
shared memory: on host tensors "mpi" is the faster backend; "torch" is there for NCCL. And a
rank waiting in gloo sleeps where one waiting in MPI spins: mixing the two (an MPI collective
while peers are in gloo) takes the cores from the ranks at work on an oversubscribed machine.

What gloo (torch 2.13) offers and what this transport does instead, per operation (the recorded
payload is `CountedComm`'s, the same as under MPI, whatever moves physically):

- all-reduce, reduce, broadcast, all-to-all-v (`alltoall_base` with split sizes), point-to-point
  send/receive with tags, barrier: gloo's own. `reduce` uses its buffer as scratch on every
  rank, so non-roots reduce a copy.
- all-gather with uneven pieces: gloo's all-gather needs equal pieces. Equal counts use it
  (`_allgather_base`); uneven ones go as an all-to-all-v in which each rank sends its piece to
  every rank, so each rank sends (P−1)·its piece and receives exactly the others' pieces: the
  bytes of MPI's Allgatherv, with no padding (a padded all-gather would move P·max; measured on
  4 ranks with one piece twice the others: 1.5 ms against 4.1 ms for 20 KiB, 32 ms against 80 ms
  for 20 MiB). The non-blocking all-gather (`iallgatherv_`) issues the same work without waiting
  for it: gloo's worker threads move it while the caller computes.
- object all-gather: pickled, the lengths all-gathered, then the bytes as an all-gather above.
- reduce-scatter: gloo has no reduce-scatter of its own in torch 2.13: `reduce_scatter_tensor`
  all-reduces a copy of the whole tensor and keeps this rank's chunk (equal chunks only), the
  list form all-reduces each block in turn; either way the whole tensor is all-reduced, about
  twice the bytes of a reduce-scatter. Here it is the direct (pairwise) algorithm: an
  all-to-all-v sends block k of each rank's tensor to rank k (n − n_k elements sent per rank,
  the least a reduce-scatter can), and rank k sums the P blocks it received, in rank order.
  Measured on 4 ranks of 2 cores: 1.3 ms against gloo's 5.7 ms for 16 KiB, 20 ms against 41 ms
  for 16 MiB. The record is the whole tensor, as under MPI (the convention of the α–β cost).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist

from runner.core.comm import Backend, Request, Transport

GLOO = "gloo"
NCCL = "nccl"
# The process groups' own timeout when the caller sets none: practically never (MPI's
# collectives have none either; the watchdog is what ends a hung job).
NO_TIMEOUT = datetime.timedelta(days=365)
# Where rank 0's rendezvous store listens, when set (otherwise 127.0.0.1 for a job on one host,
# rank 0's host name for a job on several).
ADDRESS_VARIABLE = "GRIDRUN_TORCH_ADDR"


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend for tensors on `device`: gloo on the host, NCCL on CUDA."""
    return NCCL if device.type == "cuda" else GLOO


def process_group_timeout(timeout_s: float | None) -> datetime.timedelta:
    """The process groups' own timeout for a communication timeout of `timeout_s` (None: none).

    A backstop, later than the watchdog (`runner.core.watchdog`), which ends a job within about
    `timeout_s` + 4 s and names the rank that did not arrive: gloo's own timeout would only raise
    a transport error in the rank that waited."""
    if timeout_s is None:
        return NO_TIMEOUT
    return datetime.timedelta(seconds=2 * timeout_s + 60)


class Group(Protocol):
    """What the transport uses of a torch.distributed backend object (`ProcessGroupGloo`; its
    type stubs do not declare the collectives). Ranks are the group's."""

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work:
        ...

    def reduce(self, tensors: list[torch.Tensor], opts: dist.ReduceOptions) -> dist.Work:
        ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work:
        ...

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        ...

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: dist.AllToAllOptions) -> dist.Work:
        ...

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        ...

    def barrier(self, opts: dist.BarrierOptions) -> dist.Work:
        ...

    def shutdown(self) -> None:
        ...


@dataclass
class _Session:
    rank: int
    size: int
    mpi_comm: Any
    store: dist.Store
    timeout: datetime.timedelta
    owns_default_group: bool
    # the grids' groups by their members' ranks (group rank k = ranks[k]), then by device type
    groups: dict[tuple[int, ...], dict[str, Group]] = field(default_factory=dict)


_session: _Session | None = None


def torch_distributed_ready() -> bool:
    """Whether `init_torch_distributed` has run in this process (and no shutdown since)."""
    return _session is not None


def _rendezvous_address(mpi_comm: Any) -> str:
    """Rank 0's address for the others (collective; the answer is rank 0's): the variable when
    set, the loopback for a job on one host, else rank 0's host name."""
    hosts = mpi_comm.gather(socket.gethostname(), root=0)
    if mpi_comm.Get_rank() != 0:
        return ""
    explicit = os.environ.get(ADDRESS_VARIABLE)
    if explicit:
        return explicit
    return "127.0.0.1" if len(set(hosts)) == 1 else str(hosts[0])


def _open_store(mpi_comm: Any, timeout: datetime.timedelta) -> dist.Store:
    """Rank 0 opens the rendezvous store on a port the system picks (port 0: chosen as it starts
    listening, on every interface, so nothing can take it between choosing and binding), and
    tells the others its address and port over MPI. Collective over `mpi_comm`."""
    size = mpi_comm.Get_size()
    address = _rendezvous_address(mpi_comm)
    store: dist.TCPStore | None = None
    if mpi_comm.Get_rank() == 0:
        try:
            store = dist.TCPStore(address, 0, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            meeting: tuple[str, int, str | None] = (address, store.port, None)
        except Exception as exc:  # told to the others: nobody waits for a store that is not
            meeting = (address, 0, f"{type(exc).__name__}: {exc}")
        mpi_comm.bcast(meeting, root=0)
    else:
        meeting = mpi_comm.bcast(None, root=0)
    address, port, error = meeting
    if error is not None:
        raise RuntimeError(f"rank 0 could not open torch.distributed's rendezvous store on "
                           f"{address}: {error}")
    if store is None:
        store = dist.TCPStore(address, port, size, is_master=False, timeout=timeout)
    return store


def init_torch_distributed(mpi_comm: Any | None, timeout_s: float | None = None) -> None:
    """Bootstrap torch.distributed from the MPI job: one rank per rank of `mpi_comm` (the job's
    world, normally `MPI.COMM_WORLD`), with the same rank numbers. Collective over `mpi_comm`;
    once per process: a second call does nothing. Nothing to do for one process (`mpi_comm`
    None or of size 1).

    Every rank joins torch.distributed's default process group (gloo) through a rendezvous store
    rank 0 opens; the grids' groups meet through the same store. `timeout_s` is the
    communication timeout (`trainer.comm_timeout_s`; None: none): the process groups get a later
    one as a backstop (`process_group_timeout`). A default group someone else made already (a
    benchmark's DDP) stays as it is when its ranks are `mpi_comm`'s."""
    global _session
    if mpi_comm is None or mpi_comm.Get_size() == 1:
        return
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    if _session is not None:
        if (_session.rank, _session.size) != (rank, size):
            raise RuntimeError(f"torch.distributed is initialised as rank {_session.rank} of "
                               f"{_session.size}, not rank {rank} of {size}")
        return
    if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != (rank, size):
        raise RuntimeError(f"torch.distributed's default group (rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}) is not this MPI job's (rank {rank} of "
                           f"{size})")
    timeout = process_group_timeout(timeout_s)
    store = _open_store(mpi_comm, timeout)
    owns_default_group = not dist.is_initialized()
    if owns_default_group:
        dist.init_process_group(GLOO, store=dist.PrefixStore("default/", store), rank=rank,
                                world_size=size, timeout=timeout)
    _session = _Session(rank, size, mpi_comm, store, timeout, owns_default_group)


def shutdown_torch_distributed(barrier: bool = True) -> None:
    """Close every group this module made, and the default group when it made it. With
    `barrier` (collective over the MPI job) every rank's last operation is complete at every peer
    before any rank closes its connections. Nothing to do when torch.distributed was never
    initialised here."""
    global _session
    session, _session = _session, None
    if session is None:
        return
    if barrier:
        session.mpi_comm.Barrier()
    for backends in session.groups.values():
        for backend in backends.values():
            backend.shutdown()
    session.groups.clear()
    if session.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def _new_backend(device_type: str, store: dist.Store, rank: int, size: int,
                 timeout: datetime.timedelta) -> Group:
    """A group's backend for tensors on `device_type`: gloo on the host, NCCL on CUDA (on this
    rank's current GPU: `torch.cuda.set_device` comes first)."""
    if device_type == "cpu":
        return cast(Group, dist.ProcessGroupGloo(store, rank, size, timeout))
    if device_type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("backend 'torch' on CUDA tensors needs NCCL, and this torch has "
                               "none: use comm.backend=mpi (staged), or a CUDA build of torch")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cast(Group, dist.ProcessGroupNCCL(store, rank, size, options))
    raise ValueError(f"backend 'torch' has no process groups for {device_type} tensors")


def process_group(ranks: Sequence[int], device_type: str = "cpu") -> Group:
    """The group of the job's `ranks` (group rank k = `ranks[k]`) for tensors on `device_type`;
    made on first use, collective over `ranks` only, then the same object for the same ranks."""
    session = _require_session()
    key = tuple(ranks)
    backends = session.groups.setdefault(key, {})
    backend = backends.get(device_type)
    if backend is None:
        if session.rank not in key:
            raise ValueError(f"rank {session.rank} is not in the group {list(key)}")
        name = "-".join(map(str, key))
        store = dist.PrefixStore(f"gridrun/{device_type}/{name}/", session.store)
        backend = backends[device_type] = _new_backend(device_type, store, key.index(session.rank),
                                                       len(key), session.timeout)
    return backend


def _require_session() -> _Session:
    if _session is None:
        raise RuntimeError("backend 'torch' needs torch.distributed: call "
                           "runner.core.torchdist.init_torch_distributed(MPI.COMM_WORLD) on every "
                           "rank first")
    return _session


def grid_transports(mpi_comms: Sequence[Any],
                    device_types: Sequence[str] = ("cpu",)) -> list[Transport]:
    """A transport per MPI communicator of a grid (world, model, batch, in that order on every
    rank), over the same ranks in the same order, with groups for tensors on each of
    `device_types`. Collective over each communicator."""
    session = _require_session()
    members = [list(comm.allgather(session.rank)) for comm in mpi_comms]
    transports: list[Transport] = []
    for comm, ranks in zip(mpi_comms, members, strict=True):
        transport: Transport = (LocalTransport() if len(ranks) == 1
                                else TorchTransport(ranks, device_types))
        assert transport.rank == comm.Get_rank(), (transport, comm.Get_rank())
        transports.append(transport)
    return transports


# -- the transports -------------------------------------------------------------------------------


class _TorchRequest:
    def __init__(self, works: list[dist.Work], keepalive: tuple[torch.Tensor, ...] = ()) -> None:
        self._works = works
        self._keepalive = keepalive  # buffers of the transport's own the works read

    def test(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class _Done:
    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def _flat(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` elements of a row-major tensor, as a 1-D view."""
    return tensor.view(-1)[:count]


_SUM = dist.ReduceOp(dist.ReduceOp.SUM)


def _sum() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = _SUM
    return options


class TorchTransport:
    """torch.distributed process groups over the job's ranks `ranks` (group rank k is job rank
    `ranks[k]`, as in the MPI communicator it mirrors); each operation goes to the group's
    backend for its tensors' device. Blocking operations wait for their work (the GIL is
    released meanwhile: the watchdog's thread runs)."""

    backend: Backend = "torch"

    def __init__(self, ranks: Sequence[int], device_types: Sequence[str] = ("cpu",)) -> None:
        from runner.core.staging import StagedTransport

        session = _require_session()
        self.global_ranks = list(ranks)
        self.size: int = len(self.global_ranks)
        self.rank: int = self.global_ranks.index(session.rank)
        self._groups = {kind: process_group(self.global_ranks, kind)
                        for kind in dict.fromkeys(("cpu", *device_types))}
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._host_exchange = StagedTransport(self)  # device point-to-point (module docstring)

    def __repr__(self) -> str:
        return f"TorchTransport(rank {self.rank} of ranks {self.global_ranks})"

    def _group(self, tensor: torch.Tensor) -> Group:
        """The group for `tensor`'s device (made with the transport: made on first use, a group
        would be collective over ranks that may not all be in this operation)."""
        group = self._groups.get(tensor.device.type)
        if group is None:
            raise ValueError(f"{self!r} has no {backend_for(tensor.device)} group for "
                             f"{tensor.device.type} tensors: the grid stages them through the "
                             f"host (runner.core.grid.DevicePaths)")
        return group

    def _buffer(self, tag: str, count: int, like: torch.Tensor) -> torch.Tensor:
        """A 1-D scratch buffer of `count` elements, reused across blocking calls."""
        key = (tag, like.dtype, like.device)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = self._scratch[key] = torch.empty(count, dtype=like.dtype,
                                                      device=like.device)
        return buffer[:count]

    def allreduce_(self, tensor: torch.Tensor) -> None:
        self._group(tensor).allreduce([tensor], _sum()).wait()

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
        options = dist.ReduceOptions()
        options.reduceOp = _SUM
        options.rootRank, options.rootTensor = root, 0
        self._group(buffer).reduce([buffer], options).wait()

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        return _TorchRequest([self._group(tensor).allreduce([tensor], _sum())])

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        if any(buf.device.type != "cpu" for buf, _ in sends + recvs):
            return self._host_exchange.exchange(sends, recvs, tag)
        works = [self._group(buf).recv([buf], src, tag) for buf, src in recvs]
        works += [self._group(buf).send([buf], dst, tag) for buf, dst in sends]
        return _TorchRequest(works)

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = root, 0
        self._group(tensor).broadcast([tensor], options).wait()

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        total, mine = sum(counts), counts[self.rank]
        if total == 0:
            return  # every rank knows the counts: all skip alike
        group = self._group(out)
        if all(count == mine for count in counts):
            group._allgather_base(_flat(out, total), _flat(piece, mine)).wait()
            return
        # Uneven: each rank's piece to every rank (see the module's docstring).
        copies = self._buffer("allgather.send", self.size * mine, piece)
        copies.view(self.size, mine).copy_(_flat(piece, mine).expand(self.size, mine))
        group.alltoall_base(_flat(out, total), copies, counts, [mine] * self.size,
                            dist.AllToAllOptions()).wait()

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        total, mine = sum(counts), counts[self.rank]
        if total == 0:
            return _Done()
        group = self._group(out)
        if all(count == mine for count in counts):
            return _TorchRequest([group._allgather_base(_flat(out, total), _flat(piece, mine))])
        # Uneven: as `allgatherv_`, from copies of its own (the scratch buffer is the blocking
        # calls'), kept until the work completes.
        copies = _flat(piece, mine).expand(self.size, mine).contiguous().view(-1)
        work = group.alltoall_base(_flat(out, total), copies, counts, [mine] * self.size,
                                   dist.AllToAllOptions())
        return _TorchRequest([work], (copies,))

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        total, mine = sum(counts), counts[self.rank]
        if total == 0:
            return
        # Block k to rank k, then this rank's P blocks summed (see the module's docstring).
        blocks = self._buffer("reduce_scatter.recv", self.size * mine, full)
        self._group(full).alltoall_base(blocks, _flat(full, total), [mine] * self.size, counts,
                                        dist.AllToAllOptions()).wait()
        torch.sum(blocks.view(self.size, mine), dim=0, out=_flat(out, mine))

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        self._group(send).alltoall_base(_flat(recv, sum(recv_counts)),
                                        _flat(send, sum(send_counts)), recv_counts, send_counts,
                                        dist.AllToAllOptions()).wait()

    def allgather_object(self, obj: Any) -> list[Any]:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
        lengths = torch.empty(self.size, dtype=torch.int64)
        self.allgatherv_(length, lengths, [1] * self.size)
        counts = [int(n) for n in lengths.tolist()]
        everything = torch.empty(sum(counts), dtype=torch.uint8)
        self.allgatherv_(data, everything, counts)
        gathered, offset = [], 0
        for count in counts:
            gathered.append(pickle.loads(everything[offset:offset + count].numpy().tobytes()))
            offset += count
        return gathered

    def barrier(self) -> None:
        self._groups["cpu"].barrier(dist.BarrierOptions()).wait()


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
