"""A vector shared through MPI one-sided windows: read and updated without its owners' help.

`OneSidedVector` partitions a flat vector over the ranks of a communicator (balanced pieces, see
`Partition`); each piece lives in its owner's MPI window. Reads and additions are passive-target
operations: the owner does not take part, so a rank that is busy computing, or slowed down,
delays nobody who reads or updates its piece. All accesses are atomic per element (additions
are `MPI_Accumulate`, reads `MPI_Get_accumulate` with `MPI_NO_OP`), so concurrent readers and
writers never see torn values, only interleaved ones.

Mutual exclusion is a first-come-first-served *ticket lock* per piece, built from atomic
fetch-and-add on a small counter window, not `MPI_LOCK_EXCLUSIVE`: MPICH grants an exclusive
lock only when the target enters the MPI progress engine (measured: a lock on a sleeping rank
waits until it wakes), which would make every worker wait for the slowest one. A *turn*
counter on rank 0 lets ranks take turns in a fixed order.

The windows are opened once (`MPI_Win_lock_all`, `MPI_MODE_NOCHECK`) and closed by `close()`,
which is collective. With one rank no MPI is used: the vector is a local tensor.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

import torch

from runner.core.comm import CountedComm
from runner.core.mpi_transport import mpi_module
from runner.core.partition import Partition

NEXT_TICKET, NOW_SERVING, TURN = 0, 1, 2  # slots of each rank's counter window


class OneSidedVector:
    def __init__(self, comm: CountedComm, initial: torch.Tensor, label: str = "") -> None:
        """Collective over `comm`: every rank passes the same full `initial` (1-D) vector."""
        if initial.dim() != 1:
            raise ValueError("OneSidedVector holds a 1-D vector")
        self.comm, self.label = comm, label
        self.dtype = initial.dtype
        self.partition = Partition(initial.numel(), comm.size)
        self._data_window: Any = None
        self._counter_window: Any = None
        if comm.size == 1:
            self._local = initial.clone()
            self._turn = 0
            return
        MPI = mpi_module()
        itemsize = initial.element_size()
        own = self.partition.sizes[comm.rank]
        mpi_comm = comm.communicator
        self._data_window = MPI.Win.Allocate(own * itemsize, itemsize, comm=mpi_comm)
        self._counter_window = MPI.Win.Allocate(3 * 8, 8, comm=mpi_comm)
        if own:
            self._window_tensor(self._data_window, self.dtype).copy_(
                initial[self.partition.slice(comm.rank)])
        self._window_tensor(self._counter_window, torch.int64).zero_()
        mpi_comm.Barrier()  # every piece initialised before anyone reads it
        self._data_window.Lock_all(MPI.MODE_NOCHECK)
        self._counter_window.Lock_all(MPI.MODE_NOCHECK)
        self._mpi_type = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}[self.dtype]
        # host: MPI's one-sided windows live in host memory; so do their counters
        self._one = torch.ones(1, dtype=torch.int64)
        self._fetched = torch.zeros(1, dtype=torch.int64)  # host: the window's counter

    @staticmethod
    def _window_tensor(window: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(window.tomemory(), dtype=dtype)  # host: the window's memory

    def piece(self, owner: int) -> slice:
        """Where `owner`'s piece lies in the full vector."""
        return self.partition.slice(owner)

    # -- data -----------------------------------------------------------------------------------

    def read(self, owner: int, out: torch.Tensor) -> torch.Tensor:
        """`out` ← `owner`'s piece (atomic per element)."""
        if self._data_window is None:
            return out.copy_(self._local[self.piece(owner)])
        if out.numel():
            MPI = mpi_module()
            start = time.perf_counter()
            # NO_OP: the origin is unused (count 0); the target count is the piece's length
            self._data_window.Get_accumulate([None, 0, self._mpi_type], out, owner,
                                             target=(0, out.numel(), self._mpi_type),
                                             op=MPI.NO_OP)
            self._data_window.Flush(owner)
            self._record("rma_read", out, start)
        return out

    def add(self, owner: int, values: torch.Tensor) -> None:
        """`owner`'s piece += `values` (atomic per element), complete at the owner on return."""
        if self._data_window is None:
            self._local[self.piece(owner)] += values
            return
        if values.numel():
            MPI = mpi_module()
            start = time.perf_counter()
            self._data_window.Accumulate(values, owner, op=MPI.SUM)
            self._data_window.Flush(owner)
            self._record("rma_add", values, start)

    def write(self, owner: int, values: torch.Tensor) -> None:
        """`owner`'s piece ← `values` (atomic per element: `MPI_Accumulate` with `MPI_REPLACE`),
        complete at the owner on return. A replacing write, where `add` sums: an update made
        without the lock that should have excluded it is then lost, and seen."""
        if self._data_window is None:
            self._local[self.piece(owner)] = values
            return
        if values.numel():
            MPI = mpi_module()
            start = time.perf_counter()
            self._data_window.Accumulate(values, owner, op=MPI.REPLACE)
            self._data_window.Flush(owner)
            self._record("rma_write", values, start)

    def read_all(self, out: torch.Tensor) -> torch.Tensor:
        """The whole vector (each piece atomic per element; pieces read one after another)."""
        for owner in range(self.comm.size):
            self.read(owner, out[self.piece(owner)])
        return out

    # -- ordering -------------------------------------------------------------------------------

    def acquire(self, owner: int) -> None:
        """Take `owner`'s ticket lock: waits only while other ranks that asked first hold it."""
        if self._counter_window is None:
            return
        start = time.perf_counter()
        ticket = self._fetch_add(owner, NEXT_TICKET, 1)
        self._spin_until(owner, NOW_SERVING, ticket)
        self.comm.counter.add("rma_lock", self.comm.name, self.comm.size, 0,
                              time.perf_counter() - start, self.label)

    def release(self, owner: int) -> None:
        """Pass `owner`'s lock to the next ticket (our updates are complete: `add` flushes)."""
        if self._counter_window is not None:
            self._fetch_add(owner, NOW_SERVING, 1)

    def wait_turn(self, turn: int) -> None:
        """Wait until the shared turn counter (on rank 0) reaches `turn`."""
        if self._counter_window is None:
            assert self._turn == turn, "with one rank every turn is ours"
            return
        start = time.perf_counter()
        self._spin_until(0, TURN, turn)
        self.comm.counter.add("rma_turn", self.comm.name, self.comm.size, 0,
                              time.perf_counter() - start, self.label)

    def next_turn(self) -> None:
        if self._counter_window is None:
            self._turn += 1
        else:
            self._fetch_add(0, TURN, 1)

    def _fetch_add(self, owner: int, slot: int, amount: int) -> int:
        MPI = mpi_module()
        self._one[0] = amount
        self._counter_window.Fetch_and_op(self._one, self._fetched, owner, slot,
                                          op=MPI.SUM if amount else MPI.NO_OP)
        self._counter_window.Flush(owner)
        return int(self._fetched[0])

    def _spin_until(self, owner: int, slot: int, value: int) -> None:
        polls = 0
        while self._fetch_add(owner, slot, 0) != value:
            polls += 1
            # Give the core away: with more ranks than cores the holder may be waiting for it.
            if polls < 100:
                os.sched_yield()
            else:
                time.sleep(20e-6)

    def _record(self, op: Literal["rma_read", "rma_add", "rma_write"], tensor: torch.Tensor,
                start: float) -> None:
        self.comm.counter.add(op, self.comm.name, self.comm.size,
                              tensor.numel() * tensor.element_size(),
                              time.perf_counter() - start, self.label)

    def close(self) -> None:
        """Collective: free the windows once every rank is done with them."""
        if self._data_window is None:
            return
        self._data_window.Unlock_all()
        self._counter_window.Unlock_all()
        self.comm.communicator.Barrier()
        self._data_window.Free()
        self._counter_window.Free()
        self._data_window = self._counter_window = None
