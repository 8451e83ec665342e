"""The torch.distributed session of backend "torch", bootstrapped from the MPI job already
running, and its process groups.

`init_torch_distributed(mpi_comm)` (collective over the job's MPI communicator, once per process):
rank 0 opens the rendezvous store on a TCP port the operating system picks on its host (no race
for a "free" port), shares its address and port over MPI, and every rank joins the default
process group with that store. Launching is unchanged: `mpiexec` starts the ranks, MPI tells
them where to meet. `shutdown_torch_distributed()` destroys every process group (every rank, at
the end).

A grid built with `ProcessGrid(..., backend="torch")` gets process groups over the same ranks as its
MPI Cartesian communicators, in the same order (`process_groups`, called by
`runner.core.torch_transport.grid_transports`): its world, its model group and its batch group, each
made once per process and reused by later grids over the same ranks. Each is a
`torch.distributed.ProcessGroup` the core assembles itself: a gloo backend (`ProcessGroupGloo`) for
host tensors and, where asked, an NCCL one for CUDA tensors, each on a prefix of the rendezvous
store named after the group's ranks, made by their members only, so a grid carved out of part of the
job needs nothing from the ranks outside it. The functional collectives
(`torch.distributed.all_reduce(..., group=...)`, `batch_isend_irecv`) take it as any group; it is
entered in torch.distributed's tables of groups (its backend, and its ranks in the job: `P2POp`
translates ranks through them) and taken out at shutdown. Not `torch.distributed.new_group`: made by
members only (`use_local_synchronization`) it names a group after its ranks *and the number of
groups the process made before*, so a rank that sat out an earlier grid names the group differently
from its peers and the group never forms; made by every rank of the job, a grid could not be carved
out of part of it. Every rank creates its groups in the same order (world, model, batch), so no two
wait for each other in opposite orders. The default group `init_process_group` makes stays for any
other torch.distributed code of the run (a benchmark's DDP); the grids' traffic does not use it.

The groups' timeout comes from `trainer.comm_timeout_s` (`init_torch_distributed(timeout_s=)`,
kept for every group of the process): a backstop later than the watchdog, which ends a hung job
first and names the rank that did not arrive (`process_group_timeout`).

Backends by device: an operation goes to the backend of its tensors' device (`backend_for`):
gloo for host tensors, NCCL for CUDA tensors when the grid asks for it (`device_types=("cpu",
"cuda")`: every rank has a GPU of its own; NCCL refuses two ranks on one GPU, "Duplicate GPU
detected"). Otherwise the grid stages CUDA tensors through host buffers into gloo
(`runner.core.staging`).

The transports over these groups (`TorchTransport`, `LocalTransport`: which call each operation
makes under NCCL and on gloo) are `runner.core.torch_transport`'s.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

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
    `timeout_s` + 4 s and names the rank that did not arrive (under NCCL too: it watches an
    operation until the device has completed it). gloo's own timeout would only raise a
    transport error in the rank that waited, and NCCL's ends the process that waited, naming a
    sequence number."""
    if timeout_s is None:
        return NO_TIMEOUT
    return datetime.timedelta(seconds=2 * timeout_s + 60)


class Group(Protocol):
    """What the transport uses of a torch.distributed backend object itself (`ProcessGroupGloo`,
    `ProcessGroupNCCL`); everything else goes through the `ProcessGroup` they are registered
    on."""

    def barrier(self, opts: dist.BarrierOptions) -> dist.Work:
        ...

    def shutdown(self) -> None:
        ...


@dataclass
class Groups:
    """The process group of some ranks: one `torch.distributed.ProcessGroup` (what the
    functional collectives take), with a backend per device type registered on it."""

    group: dist.ProcessGroup
    backends: dict[str, Group]


@dataclass
class _Session:
    rank: int
    size: int
    mpi_comm: Any
    store: dist.Store
    timeout: datetime.timedelta
    owns_default_group: bool
    # the grids' groups by their members' ranks (group rank k = ranks[k])
    groups: dict[tuple[int, ...], Groups] = field(default_factory=dict)


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
    communication timeout (`trainer.comm_timeout_s`; None: none): every process group of the
    process, the grids' included, gets a later one as a backstop (`process_group_timeout`). A
    default group someone else made already (a benchmark's DDP) stays as it is when its ranks
    are `mpi_comm`'s."""
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
    for groups in session.groups.values():
        _forget(groups.group)
        for backend in groups.backends.values():
            backend.shutdown()
    session.groups.clear()
    if session.owns_default_group and dist.is_initialized():
        dist.destroy_process_group()


def _new_backend(device_type: str, store: dist.Store, rank: int, size: int,
                 timeout: datetime.timedelta) -> Group:
    """A group's backend for tensors on `device_type`: gloo on the host, NCCL on CUDA (on this
    rank's current GPU: `torch.cuda.set_device` comes first), its communicator connected now."""
    if device_type == "cpu":
        return cast(Group, dist.ProcessGroupGloo(store, rank, size, timeout))
    if device_type == "cuda":
        if not dist.is_nccl_available():
            raise RuntimeError("backend 'torch' on CUDA tensors needs NCCL, and this torch has "
                               "none: use comm.backend=mpi (staged), or a CUDA build of torch")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(store, rank, size, options)
        # Collective over the group's ranks, as making the group is: connected lazily, the
        # first operation would connect it, and an exchange only some ranks take part in
        # would wait for the others for ever.
        nccl.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return cast(Group, nccl)
    raise ValueError(f"backend 'torch' has no process groups for {device_type} tensors")


_BACKEND_TYPES = {"cpu": dist.ProcessGroup.BackendType.GLOO,
                  "cuda": dist.ProcessGroup.BackendType.NCCL}


def _enter(group: dist.ProcessGroup, ranks: Sequence[int], backend: str,
           store: dist.Store) -> None:
    """Enter `group` in torch.distributed's tables as `new_group` would: its backend (read when
    a collective raises, to describe the group) and its ranks in the job (`P2POp` translates a
    group rank through them)."""
    world = distributed_c10d._world
    world.pg_map[group] = (backend, store)
    world.pg_group_ranks[group] = {job_rank: k for k, job_rank in enumerate(ranks)}


def _forget(group: dist.ProcessGroup) -> None:
    world = distributed_c10d._world
    world.pg_map.pop(group, None)
    world.pg_group_ranks.pop(group, None)


def process_groups(ranks: Sequence[int], device_types: Sequence[str] = ("cpu",)) -> Groups:
    """The group of the job's `ranks` (group rank k = `ranks[k]`) with backends for tensors on
    each of `device_types`; made on first use, collective over `ranks` only, then the same
    object for the same ranks (a backend for a device type asked for later is added then)."""
    session = _require_session()
    key = tuple(ranks)
    if session.rank not in key:
        raise ValueError(f"rank {session.rank} is not in the group {list(key)}")
    name = "-".join(map(str, key))
    store = dist.PrefixStore(f"gridrun/{name}/", session.store)
    groups = session.groups.get(key)
    if groups is None:
        group = dist.ProcessGroup(store, key.index(session.rank), len(key))
        group._set_default_backend(_BACKEND_TYPES["cpu"])  # control messages: host tensors
        groups = session.groups[key] = Groups(group, {})
    added = False
    for device_type in device_types:
        if device_type not in groups.backends:
            backend = _new_backend(device_type,
                                   dist.PrefixStore(f"gridrun/{device_type}/{name}/",
                                                    session.store),
                                   key.index(session.rank), len(key), session.timeout)
            groups.group._register_backend(torch.device(device_type),
                                           _BACKEND_TYPES[device_type],
                                           cast(Any, backend))
            groups.backends[device_type] = backend
            added = True
    if added:
        groups.group._set_group_name(cast("distributed_c10d.GroupName", f"gridrun:{name}"))
        names = [f"{kind}:{backend_for(torch.device(kind))}" for kind in groups.backends]
        _enter(groups.group, key, names[0].partition(":")[2] if len(names) == 1
               else ",".join(names), store)
    return groups


def session_rank() -> int:
    """This process's rank in the torch.distributed session (`init_torch_distributed` first)."""
    return _require_session().rank


def _require_session() -> _Session:
    if _session is None:
        raise RuntimeError("backend 'torch' needs torch.distributed: call "
                           "runner.core.torchdist.init_torch_distributed(MPI.COMM_WORLD) on every "
                           "rank first")
    return _session
