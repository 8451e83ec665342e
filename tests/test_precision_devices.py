"""Mixed precision, loss scaling, device placement and host staging, in one process.

What needs ranks is in tests/test_cli_runs.py (staged, bf16 and fp16 runs against fp32) and
what needs a GPU in tests/test_gpu.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runner.cli.app import precheck
from runner.config.schema import parse
from runner.core import CommCounter, CountedComm, DevicePaths, ProcessGrid
from runner.core.staging import HostBufferPool, StagedTransport
from runner.core.torch_transport import LocalTransport
from runner.cost.collectives import MachineCosts
from runner.records.rundir import RunDir, release_run_dirs
from runner.training.precision import DynamicLossScale, Precision
from runner.training.state import RunSetup, Start
from runner.training.step import Feed, train_step
from strategies.base import Score, cross_entropy_score


def test_half_precision_stores_floating_inputs_in_the_half_type() -> None:
    bf16 = Precision("bf16", "cpu")
    assert bf16.input_dtype(torch.float32) == torch.bfloat16
    assert Precision("fp16", "cpu").input_dtype(torch.float32) == torch.float16
    assert Precision("fp32", "cpu").input_dtype(torch.float64) == torch.float64
    with bf16.autocast():
        assert nn.Linear(3, 2)(torch.zeros(1, 3)).dtype == torch.bfloat16


def test_the_loss_scale_unscales_finds_overflow_backs_off_and_grows() -> None:
    scaler = DynamicLossScale(scale=8.0, growth_interval=2)
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([8.0, 16.0, -8.0]), torch.tensor([4.0, 0.0])
    assert scaler.unscale([a, b]) is False
    assert a.grad.tolist() == [1.0, 2.0, -1.0] and b.grad.tolist() == [0.5, 0.0]
    b.grad = torch.tensor([float("inf"), 1.0])
    assert scaler.unscale([a, b]) is True
    scaler.update(3, overflow=True)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1 and scaler.history == [3]
    scaler.update(4, overflow=False)
    scaler.update(5, overflow=False)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    restored = DynamicLossScale()
    restored.load_state(scaler.state())
    assert restored.state() == scaler.state()


class _NoExchange(nn.Sequential):
    """A ParallelModel's surface for one process: no gradient exchange to finish."""

    def finish_gradient_sync(self) -> None:
        return None

    def score(self, output: torch.Tensor, targets: torch.Tensor, correct: bool = False) -> Score:
        return cross_entropy_score(output, targets, correct)


class _Recorder:
    steps: list[int]

    def __init__(self) -> None:
        self.steps = []

    def step(self, index: int) -> None:
        self.steps.append(index)


def one_process_setup(model: nn.Module, optimizer: _Recorder, loss_comm: CountedComm,
                      precision: Precision, scaler: DynamicLossScale,
                      run_dir: Path) -> RunSetup:
    """A one-process run's setup around `model` and `optimizer`: one row per batch, so its loss
    scale is 1."""
    run = parse({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                 "strategy": {"name": "data"}, "optimizer": {"name": "sgd"},
                 "trainer": {"batch_size": 1}})
    return RunSetup(
        run=run, run_dir=RunDir(run_dir), grid=ProcessGrid(1, 1),
        model=model, optimizer=optimizer,  # type: ignore[arg-type]
        start=Start(), loss_comm=loss_comm, predicted_ops=None, predicted_step=None,
        costs=MachineCosts(), device=torch.device("cpu"), precision=precision, scaler=scaler,
        targets_per_sample=1, predicted_memory=None)


def test_an_overflowing_fp16_step_is_skipped_and_the_next_one_taken(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _NoExchange(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    comm = CountedComm(None, CommCounter())
    optimizer = _Recorder()
    # A scale beyond float16's range: the backward's half-precision gradients overflow.
    scaler = DynamicLossScale(scale=2.0 ** 40)
    setup = one_process_setup(model, optimizer, comm, Precision("fp16", "cpu"), scaler, tmp_path)
    assert setup.loss_scale == 1.0
    loss, stopping = train_step(setup, [Feed(x, y)], 1, comm, False)
    assert optimizer.steps == [] and scaler.skipped_steps == 1 and not stopping
    assert torch.isfinite(torch.tensor(loss))
    scaler.scale = 2.0 ** 8
    train_step(setup, [Feed(x, y)], 1, comm, False)
    assert optimizer.steps == [0] and scaler.skipped_steps == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_device_paths_stage_device_buffers_unless_the_transport_reads_them() -> None:
    assert not DevicePaths("cpu").staged and DevicePaths("cpu").describe("mpi", 4) == "host"
    assert DevicePaths("cuda").staged
    assert DevicePaths("cuda").describe("torch", 4) == "staged through host buffers (gloo)"
    assert not DevicePaths("cuda", direct=True).staged
    assert DevicePaths("cuda", direct=True).describe("torch", 2) == "direct (NCCL)"
    assert DevicePaths("cpu", stage_host=True).staged
    # one rank: no process group, no collective, whatever the backend would have used
    assert DevicePaths("cuda", direct=True).describe("torch", 1) == "none: one rank"
    many = DevicePaths("cuda", shared=tuple((f"GPU-{i} on n", (i, i + 6)) for i in range(6)))
    assert many.describe("mpi", 12) == (
        "staged through host buffers (MPI); 2 ranks share GPU-0 on n (ranks 0, 6); "
        "2 ranks share GPU-1 on n (ranks 1, 7); 2 ranks share GPU-2 on n (ranks 2, 8); "
        "2 ranks share GPU-3 on n (ranks 3, 9); and 2 more GPUs are shared")


def test_staging_moves_through_pooled_host_buffers_and_copies_results_back() -> None:
    staged = StagedTransport(LocalTransport(), pinned=False, force=True)
    out = torch.zeros(4)
    staged.allreduce(torch.arange(4.0), out)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    gathered = torch.zeros(3)
    staged.allgatherv_(torch.tensor([5.0, 6.0, 7.0]), gathered, [3])
    assert gathered.tolist() == [5.0, 6.0, 7.0]
    started = torch.zeros(3)
    request = staged.iallgatherv_(torch.tensor([8.0, 9.0, 1.0]), started, [3])
    request.wait()
    assert started.tolist() == [8.0, 9.0, 1.0] and request.test()
    received = torch.zeros(2)
    request = staged.exchange([(torch.tensor([1.0, 2.0]), 0)], [(received, 0)], tag=0)
    assert received.tolist() == [0.0, 0.0]  # copied back when the exchange completes
    request.wait()
    assert received.tolist() == [1.0, 2.0] and request.test()
    allocated = staged.pool.allocated_bytes
    staged.allreduce(torch.arange(4.0), out)  # the same shapes again: the pool's buffers
    assert staged.pool.allocated_bytes == allocated


class Twice:
    """A host transport for a group of two ranks that hold the same tensors (rank 0 of them),
    its non-blocking operations complete at their second test; it logs the calls it gets."""

    backend = "mpi"
    rank, size = 0, 2

    def __init__(self) -> None:
        self.log: list[str] = []

    def _later(self, name: str, finish: Callable[[], object]) -> _Later:
        self.log.append(name)
        return _Later(finish)

    def allreduce_(self, tensor: torch.Tensor) -> None:
        self.log.append("allreduce_")
        tensor.mul_(2)

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        self.log.append("allreduce")
        torch.mul(tensor, 2, out=out)

    def reduce(self, tensor: torch.Tensor, out: torch.Tensor | None, root: int) -> None:
        self.log.append("reduce")
        if out is not None:
            torch.mul(tensor, 2, out=out)

    def iallreduce_(self, tensor: torch.Tensor) -> _Later:
        return self._later(f"iallreduce_ {tensor.tolist()}", lambda: tensor.mul_(2))

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]], tag: int) -> _Later:
        def finish() -> None:
            for (send, _), (recv, _) in zip(sends, recvs, strict=True):
                recv.copy_(send + 1)
        return self._later("exchange", finish)

    def bcast_(self, tensor: torch.Tensor, root: int) -> None:
        self.log.append("bcast_")

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        self.log.append("allgatherv_")
        out.copy_(torch.cat([piece, piece + 10]))

    def iallgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> _Later:
        return self._later("iallgatherv_", lambda: out.copy_(torch.cat([piece, piece + 10])))

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        self.log.append("reduce_scatter_")
        torch.mul(full[:counts[0]], 2, out=out)

    def alltoallv_(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor,
                   recv_counts: list[int]) -> None:
        self.log.append("alltoallv_")
        recv.copy_(torch.cat([send[:send_counts[0]]] * 2))

    def allgather_object(self, obj: object) -> list[object]:
        return [obj, obj]

    def barrier(self) -> None:
        self.log.append("barrier")


class _Later:
    def __init__(self, finish: Callable[[], object]) -> None:
        self._finish, self._tests = finish, 0

    def test(self) -> bool:
        self._tests += 1
        if self._tests == 2:
            self._finish()
        return self._tests >= 2

    def wait(self) -> None:
        if self._tests < 2:
            self._tests = 1
            self.test()


def every_operation(transport: object) -> list[torch.Tensor]:
    """Every operation of a transport once, non-blocking ones completed; their results."""
    t: Any = transport
    a = torch.arange(4.0)
    t.allreduce_(a)
    out = torch.zeros(4)
    t.allreduce(torch.arange(4.0), out)
    reduced = torch.zeros(3)
    t.reduce(torch.ones(3), reduced, 0)
    b = torch.arange(3.0)
    pending = t.iallreduce_(b)
    received = torch.zeros(2)
    exchanged = t.exchange([(torch.tensor([1.0, 2.0]), 1)], [(received, 1)], 0)
    c = torch.tensor([5.0])
    t.bcast_(c, 0)
    gathered = torch.zeros(4)
    t.allgatherv_(torch.tensor([1.0, 2.0]), gathered, [2, 2])
    started = torch.zeros(2)
    gathering = t.iallgatherv_(torch.tensor([3.0]), started, [1, 1])
    scattered = torch.zeros(2)
    t.reduce_scatter_(torch.arange(4.0), scattered, [2, 2])
    moved = torch.zeros(4)
    t.alltoallv_(torch.arange(4.0), [2, 2], moved, [2, 2])
    for request in (pending, exchanged, gathering):
        request.wait()
        assert request.test()
    t.barrier()
    return [a, out, reduced, b, received, c, gathered, started, scattered, moved]


def test_staged_operations_equal_unstaged_ones_and_make_no_cuda_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the staged path copies into unpinned buffers and asks torch.cuda nothing."""
    def untouchable(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.cuda used by a CPU run")

    for name in ("Stream", "Event", "current_stream", "stream", "is_available", "init",
                 "set_device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, untouchable)
    empty = torch.empty

    def unpinned_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert not kwargs.get("pin_memory"), "a CPU run pinned host memory"
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", unpinned_empty)
    plain, inner = Twice(), Twice()
    staged = StagedTransport(inner, force=True)
    expected, results = every_operation(plain), every_operation(staged)
    for want, got in zip(expected, results, strict=True):
        assert torch.equal(want, got), (want, got)
    assert inner.log == plain.log
    assert staged.pool.allocated_bytes > 0 and not staged.pool._lent
    monkeypatch.undo()
    assert not torch.cuda.is_initialized()


class _Copied:
    """A stand-in for a CUDA event: complete when the test says so; counts host waits."""

    waits = 0

    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        _Copied.waits += 1
        self.complete = True


class _SideStream:
    """A GPU's copies as `CudaCopies` orders them, on host tensors: each copy's event stays
    incomplete until the test completes it (the data moves at once)."""

    def __init__(self) -> None:
        self.to_host_events: list[_Copied] = []
        self.back_events: list[_Copied] = []

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _Copied:
        for source, host in pairs:
            host.copy_(source)
        self.to_host_events.append(_Copied())
        return self.to_host_events[-1]

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> _Copied:
        for target, host in pairs:
            target.copy_(host)
        self.back_events.append(_Copied())
        return self.back_events[-1]


def test_staged_operations_start_in_issue_order_once_copied_without_host_waits() -> None:
    side = _SideStream()
    inner = Twice()
    staged = StagedTransport(inner, force=True, copies=lambda device: side)
    _Copied.waits = 0
    first, second = torch.tensor([1.0]), torch.tensor([2.0])
    r1, r2 = staged.iallreduce_(first), staged.iallreduce_(second)  # as in gradient hooks
    assert inner.log == [] and _Copied.waits == 0  # issued: copies in flight, nothing waited
    side.to_host_events[1].complete = True
    assert not r2.test() and inner.log == []  # the first goes to the transport first
    side.to_host_events[0].complete = True
    assert not r2.test()
    assert inner.log == ["iallreduce_ [1.0]", "iallreduce_ [2.0]"]
    assert not r1.test()  # the inner operation's first test: still in flight
    assert r1.test() and r2.test() and _Copied.waits == 0  # copied back, no host wait
    assert first.tolist() == [2.0] and second.tolist() == [4.0]
    # A buffer still being copied back is not lent again; once its copy is done it is.
    allocated = staged.pool.allocated_bytes
    r3 = staged.iallreduce_(torch.tensor([3.0]))
    assert staged.pool.allocated_bytes == allocated + 4
    side.back_events[0].complete = True
    r4 = staged.iallreduce_(torch.tensor([4.0]))
    assert staged.pool.allocated_bytes == allocated + 4
    # A blocking operation starts what was issued before it: waiting for those copies.
    late = torch.tensor([5.0])
    staged.allreduce_(late)
    assert inner.log[2:] == ["iallreduce_ [3.0]", "iallreduce_ [4.0]", "allreduce_"]
    assert _Copied.waits == 3 and late.tolist() == [10.0]  # r3's, r4's and its own copy
    r3.wait()
    r4.wait()
    # wait() waits for the copies of the operations before it, then starts them in order.
    r5, r6 = staged.iallreduce_(torch.tensor([6.0])), staged.iallreduce_(torch.tensor([7.0]))
    r6.wait()
    assert inner.log[-2:] == ["iallreduce_ [6.0]", "iallreduce_ [7.0]"]
    r5.wait()
    assert r5.test() and not staged.pool._lent


def test_the_host_buffer_pool_holds_at_most_its_cap() -> None:
    pool = HostBufferPool(cap_bytes=64)
    a, b = pool.take(torch.zeros(8)), pool.take(torch.zeros(8))  # 32 bytes each
    c = pool.take(torch.zeros(4))  # past the cap: an operation always gets its buffers
    assert pool.held_bytes == 80
    pool.give(c)  # given back while over the cap: freed
    pool.give(a)
    pool.give(b)
    assert pool.held_bytes == pool.kept_bytes == 64
    again = pool.take(torch.zeros(2, 4))  # the same elements and dtype: reused
    assert again.shape == (2, 4) and pool.allocated_bytes == 80
    bigger = pool.take(torch.zeros(16))  # 64 bytes: the kept buffer is freed to make room
    assert pool.kept_bytes == 0 and pool.held_bytes == 96
    pool.give(again)
    pool.give(bigger)
    assert pool.held_bytes == 64 and pool.kept_bytes == 64  # `again` freed, `bigger` kept
    with pytest.raises(ValueError, match="cap"):
        HostBufferPool(cap_bytes=-1)
    staged = StagedTransport(LocalTransport(), force=True, pool_cap_bytes=0)
    staged.allreduce_(torch.ones(1000))
    assert staged.pool.held_bytes == 0  # a cap of 0 keeps nothing between operations


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_asked_for_where_there_is_none_is_refused_before_any_rank_starts(
        tmp_path) -> None:
    try:
        problem = precheck(["trainer.device=cuda", f"hydra.run.dir={tmp_path / 'run'}"])
    finally:
        release_run_dirs()
    assert problem is not None and problem.startswith("trainer.device=cuda: ")
    assert "trainer.device=cpu" in problem and not (tmp_path / "run").exists()
