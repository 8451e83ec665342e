"""How a group's data physically moves: the `Transport` protocol a counted communicator
(`runner.core.comm.CountedComm`) calls, and the MPI transport, mpi4py on the grid's
communicators (the default; torch.distributed's is `runner.core.torch_transport`).

A transport moves data and counts nothing: `CountedComm` records each operation from its
logical payload above the transport, so the same operation records the same under either
backend. Tensors are handed to mpi4py directly (buffer protocol), never copied through NumPy;
MPI has no bfloat16, so its sums run on a float32 copy and its operations with counts in
elements pass bfloat16 as int16 of the same bits.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch

# How a grid's collectives travel (`runner.core.grid.ProcessGrid(backend=...)`).
Backend = Literal["mpi", "torch"]
BACKENDS: tuple[Backend, ...] = ("mpi", "torch")


def mpi_module() -> Any:
    """mpi4py's MPI module, imported on first use: a 1-process run never initialises MPI."""
    from mpi4py import MPI

    return MPI


def _displacements(counts: list[int]) -> list[int]:
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets


class Request(Protocol):
    """A transport's non-blocking operation in flight."""

    def test(self) -> bool:
        """True once complete; drives progress where the transport needs calls to progress."""
        ...

    def wait(self) -> None:
        """Block until complete."""
        ...


class Transport(Protocol):
    """The data movement of one group of ranks, without counting. Ranks are the group's own
    (0..size-1); counts and displacements are in elements; every buffer is row-major contiguous
    (`CountedComm` checks). Blocking operations return when this rank's buffers are final."""

    backend: Backend
    rank: int
    size: int

    def allreduce_(self, tensor: torch.Tensor) -> None:
        """Sum over the group, in place."""
        ...

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        """`out` = sum of `tensor` over the group."""
        ...

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        """`out` on `root` = sum of `tensor` over the group (`out` unused elsewhere)."""
        ...

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        """Start an in-place sum over the group."""
        ...

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        """Post sends of (tensor, destination) and receives into (tensor, source)."""
        ...

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        ...

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        """`out` = every rank's `piece` (`counts[k]` elements from rank k), by rank."""
        ...

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        """Start `allgatherv_(piece, out, counts)`; `out` is final once the request completes,
        and neither buffer may be touched before."""
        ...

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        """`out` = block `rank` (`counts[rank]` elements) of the sum of `full` over the group."""
        ...

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        """Block k of `send` to rank k; block k of `recv` from rank k."""
        ...

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, by rank."""
        ...

    def barrier(self) -> None:
        ...


class _MpiRequest:
    def __init__(self, request: Any) -> None:
        self._request = request

    def test(self) -> bool:
        return bool(self._request.Test())

    def wait(self) -> None:
        self._request.Wait()


class _MpiRequests:
    def __init__(self, requests: list[Any]) -> None:
        self._requests = requests

    def test(self) -> bool:
        return bool(mpi_module().Request.Testall(self._requests))

    def wait(self) -> None:
        mpi_module().Request.Waitall(self._requests)


class _Widened:
    """A non-blocking sum on a float32 copy, copied back into the bfloat16 tensor at the end."""

    def __init__(self, request: Any, wide: torch.Tensor, tensor: torch.Tensor) -> None:
        self._request, self._wide, self._tensor = request, wide, tensor
        self._done = False

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._tensor.copy_(self._wide)

    def test(self) -> bool:
        if not self._done and self._request.Test():
            self._finish()
        return self._done

    def wait(self) -> None:
        self._request.Wait()
        self._finish()


def _summable(tensor: torch.Tensor) -> bool:
    """Whether MPI can sum this dtype: MPI has no bfloat16 (mpi4py passes it as bytes), so its
    sums run on a float32 copy (`MpiTransport`): twice the bytes on the wire, the same result
    as a float32 sum rounded once."""
    return tensor.dtype != torch.bfloat16


def _device_ready(*tensors: torch.Tensor | None) -> None:
    """A CUDA-aware MPI reads device memory from the host side, outside CUDA's stream order:
    the kernels writing these tensors (a gradient a backward hook hands over) must be done."""
    for tensor in tensors:
        if tensor is not None and tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
            return


def _typed(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer MPI knows the element type of, for operations with counts in elements: mpi4py
    passes bfloat16 as bytes (counts would then be bytes), so it goes as int16 of the same
    bits."""
    return tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor


class MpiTransport:
    """mpi4py on an MPI communicator. Tensors are handed to mpi4py directly (buffer protocol),
    never copied through NumPy; sums of bfloat16 go through a float32 copy (`_summable`)."""

    backend: Backend = "mpi"

    def __init__(self, mpi_comm: Any) -> None:
        self.comm = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()

    def allreduce_(self, tensor: torch.Tensor) -> None:
        _device_ready(tensor)
        MPI = mpi_module()
        if not _summable(tensor):
            wide = tensor.float()
            self.comm.Allreduce(MPI.IN_PLACE, wide, op=MPI.SUM)
            tensor.copy_(wide)
            return
        self.comm.Allreduce(MPI.IN_PLACE, tensor, op=MPI.SUM)

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        _device_ready(tensor)
        if not _summable(tensor):
            self.allreduce_(out.copy_(tensor))
            return
        self.comm.Allreduce(tensor, out, op=mpi_module().SUM)

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        _device_ready(tensor)
        if not _summable(tensor):
            wide_out = torch.empty_like(tensor, dtype=torch.float32) if self.rank == root else None
            self.comm.Reduce(tensor.float(), wide_out, op=mpi_module().SUM, root=root)
            if out is not None and wide_out is not None:
                out.copy_(wide_out)
            return
        self.comm.Reduce(tensor, out if self.rank == root else None, op=mpi_module().SUM, root=root)

    def iallreduce_(self, tensor: torch.Tensor) -> Request:
        _device_ready(tensor)
        MPI = mpi_module()
        if not _summable(tensor):
            wide = tensor.float()
            return _Widened(self.comm.Iallreduce(MPI.IN_PLACE, wide, op=MPI.SUM), wide, tensor)
        return _MpiRequest(self.comm.Iallreduce(MPI.IN_PLACE, tensor, op=MPI.SUM))

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> Request:
        _device_ready(*(buf for buf, _ in sends))
        comm = self.comm
        requests = [comm.Irecv(buf, source=src, tag=tag) for buf, src in recvs]
        requests += [comm.Isend(buf, dest=dst, tag=tag) for buf, dst in sends]
        return _MpiRequests(requests)

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        _device_ready(tensor)
        self.comm.Bcast(tensor, root=root)

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        _device_ready(piece)
        self.comm.Allgatherv(_typed(piece), [_typed(out), (counts, _displacements(counts))])

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor,
                     counts: list[int]) -> Request:
        _device_ready(piece)
        return _MpiRequest(self.comm.Iallgatherv(
            _typed(piece), [_typed(out), (counts, _displacements(counts))]))

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        _device_ready(full)
        if not _summable(full):
            wide_out = torch.empty_like(out, dtype=torch.float32)
            self.comm.Reduce_scatter(full.float(), wide_out, counts, op=mpi_module().SUM)
            out.copy_(wide_out)
            return
        self.comm.Reduce_scatter(full, out, counts, op=mpi_module().SUM)

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        _device_ready(send)
        self.comm.Alltoallv([_typed(send), (send_counts, _displacements(send_counts))],
                            [_typed(recv), (recv_counts, _displacements(recv_counts))])

    def allgather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = self.comm.allgather(obj)
        return gathered

    def barrier(self) -> None:
        self.comm.Barrier()
