"""Operations a device completes after the host has moved on (NCCL's), on the CPU with fakes:
timed by marks on the device's stream and resolved when the totals are read, watched until the
device has completed them; and the torch transport's padding of uneven pieces."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch

from runner.core import CommCounter, CommWatchdog, CountedComm
from runner.core import comm as comm_module
from runner.core.torch_transport import cut_blocks, pad_blocks, padding_pays
from runner.core.torchdist import NO_TIMEOUT, process_group_timeout


class FakeMark:
    """A CUDA event as the counter uses one: reached when the test says (`at`, in ms), or when
    the host waits for it or a later mark (then at `due`: a stream reaches its marks in
    order)."""

    def __init__(self, stream: FakeStream, due: float) -> None:
        self.stream, self.due = stream, due
        self.at: float | None = None

    def query(self) -> bool:
        self.stream.queries += 1
        return self.at is not None

    def synchronize(self) -> None:
        self.stream.synchronized += 1
        self.stream.reach_all(until=self)

    def elapsed_time(self, end: FakeMark) -> float:
        assert self.at is not None and end.at is not None, "elapsed time of an unreached mark"
        return end.at - self.at


class FakeStream:
    """Hands out marks; each is due `step_ms` after the previous one."""

    def __init__(self, step_ms: float = 5.0) -> None:
        self.marks: list[FakeMark] = []
        self.step_ms = step_ms
        self.queries = self.synchronized = 0

    def mark(self, tensor: torch.Tensor) -> FakeMark:
        mark = FakeMark(self, self.step_ms * (len(self.marks) + 1))
        self.marks.append(mark)
        return mark

    def reach_all(self, until: FakeMark | None = None) -> None:
        for mark in self.marks:
            if mark.at is None:
                mark.at = mark.due
            if mark is until:
                return


class FakeRequest:
    def __init__(self) -> None:
        self.waited = False

    def test(self) -> bool:
        return self.waited

    def wait(self) -> None:
        self.waited = True


class StreamOrderedTransport:
    """A transport that, like NCCL's, returns before the device has completed its operations
    (here it moves nothing: one rank of four, as far as the counter can tell)."""

    backend = "torch"
    rank, size = 1, 4

    def __init__(self, ordered: bool = True) -> None:
        self.ordered = ordered
        self.calls: list[str] = []

    def stream_ordered(self, tensor: torch.Tensor) -> bool:
        return self.ordered

    def allreduce_(self, tensor: torch.Tensor) -> None:
        self.calls.append("allreduce_")

    def iallreduce_(self, tensor: torch.Tensor) -> FakeRequest:
        self.calls.append("iallreduce_")
        return FakeRequest()

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        self.calls.append("reduce_scatter_")

    def exchange(self, sends: Any, recvs: Any, tag: int) -> FakeRequest:
        self.calls.append("exchange")
        return FakeRequest()


def device_comm(ordered: bool = True, keep_records: bool = False
                ) -> tuple[CountedComm, FakeStream, StreamOrderedTransport]:
    stream = FakeStream()
    counter = CommCounter(keep_records=keep_records, mark=stream.mark)
    transport = StreamOrderedTransport(ordered)
    return CountedComm(None, counter, "world", transport), stream, transport  # type: ignore[arg-type]


def test_a_device_operation_counts_at_once_and_its_seconds_when_the_totals_are_read() -> None:
    comm, stream, _ = device_comm(keep_records=True)
    counter = comm.counter
    before = counter.snapshot()
    x = torch.zeros(8)
    comm.allreduce_(x, label="grads")
    comm.reduce_scatter_(torch.zeros(8), torch.zeros(2), [2, 2, 2, 2], label="shard")
    # counted on issue; nothing waited for the device, nothing asked of it
    assert (counter.totals.calls, counter.totals.nbytes, counter.totals.seconds) == (2, 64, 0.0)
    assert stream.synchronized == 0 and stream.queries == 0 and len(stream.marks) == 4
    assert [r.seconds for r in counter.records] == [0.0, 0.0]
    stream.marks[0].at, stream.marks[1].at = 10.0, 35.0  # the all-reduce: 25 ms on the stream
    # reading the totals waits for the rest (the reduce-scatter: marks due at 15 and 20 ms)
    step = counter.since(before)
    assert stream.synchronized == 2  # the two end marks, at the read
    assert (step.calls, step.nbytes) == (2, 64)
    assert step.seconds == pytest.approx(0.025 + 0.005)
    assert [(r.op, r.label, r.nbytes) for r in counter.records] == [
        ("allreduce", "grads", 32), ("reduce_scatter", "shard", 32)]
    assert [r.seconds for r in counter.records] == pytest.approx([0.025, 0.005])
    assert counter.since(before).seconds == pytest.approx(0.030)  # resolved once
    assert stream.synchronized == 2


def test_a_waited_operation_is_timed_from_the_wait_on_the_device() -> None:
    comm, stream, _ = device_comm()
    counter = comm.counter
    pending = comm.iallreduce_(torch.zeros(4), label="bucket")
    assert stream.marks == [] and counter.totals.calls == 0  # issued: not yet counted
    pending.wait()
    assert pending.done and len(stream.marks) == 2 and counter.in_flight is None
    stream.marks[0].at, stream.marks[1].at = 100.0, 102.5  # the stream waited 2.5 ms for it
    assert counter.snapshot().seconds == pytest.approx(0.0025)
    assert (counter.totals.calls, counter.totals.nbytes) == (1, 16)


def test_operations_the_host_completes_are_timed_on_the_host_and_mark_nothing() -> None:
    comm, stream, transport = device_comm(ordered=False, keep_records=True)
    comm.allreduce_(torch.zeros(4), label="loss")
    comm.exchange([(torch.zeros(3), 0)], [(torch.zeros(3), 2)], label="halo").wait()
    assert stream.marks == [] and transport.calls == ["allreduce_", "exchange"]
    assert [(r.op, r.nbytes) for r in comm.counter.records] == [("allreduce", 16),
                                                                ("exchange", 12)]
    assert comm.counter.watched() is None


def test_the_watchdog_sees_a_device_operation_in_flight_until_its_device_completes_it() -> None:
    comm, stream, _ = device_comm()
    counter = comm.counter
    comm.allreduce_(torch.zeros(4), label="grads")
    assert counter.in_flight is None  # the host has moved on
    watched = counter.watched()
    assert watched is not None and watched[:4] == ("allreduce", "world", 4, "grads")
    stream.reach_all()
    assert counter.watched() is None  # completed, still unresolved: no longer in flight
    # the older of the host's operation and the device's is the one timed
    comm.allreduce_(torch.zeros(4), label="late")
    counter.in_flight = ("barrier", "world", 4, "", time.perf_counter())
    assert counter.watched()[3] == "late"  # type: ignore[index]
    counter.in_flight = ("barrier", "world", 4, "", 0.0)
    assert counter.watched()[0] == "barrier"  # type: ignore[index]
    counter.in_flight = None


def test_the_watchdog_ends_the_job_on_a_device_operation_that_never_completes() -> None:
    comm, stream, _ = device_comm()
    fired: list[str] = []
    with CommWatchdog(comm.counter, 0.2, 3, lambda message, _: fired.append(message),
                      interval=0.02):
        comm.allreduce_(torch.zeros(4), label="quick")
        stream.reach_all()  # completed by the device in time: nothing
        time.sleep(0.3)
        assert not fired
        comm.allreduce_(torch.zeros(4), label="hung")  # the host goes on; the device never does
        time.sleep(0.5)
    assert fired == ["rank 3: allreduce 'hung' on group world (4 ranks) did not complete "
                     "within 0.2 s (the communication timeout); a peer may have hung or died"]


def test_a_record_cleared_before_its_seconds_are_resolved_stays_cleared() -> None:
    comm, stream, _ = device_comm(keep_records=True)
    comm.allreduce_(torch.zeros(4), label="a")
    comm.counter.records.clear()
    comm.allreduce_(torch.zeros(4), label="b")
    stream.reach_all()
    comm.counter.snapshot()
    assert [(r.label, r.seconds) for r in comm.counter.records] == [("b", pytest.approx(0.005))]


def test_unread_totals_resolve_completed_operations_without_waiting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm_module, "_MAX_ON_DEVICE", 2)
    comm, stream, _ = device_comm()
    comm.allreduce_(torch.zeros(4))
    stream.reach_all()
    comm.allreduce_(torch.zeros(4))
    comm.allreduce_(torch.zeros(4))  # over the bound: the completed first one resolved
    assert stream.synchronized == 0
    assert comm.counter.totals.seconds == pytest.approx(0.005)
    assert len(comm.counter._on_device) == 2


@pytest.mark.parametrize("counts", [[3, 2, 2], [1, 0, 4, 4], [0, 0, 1], [2, 2]])
def test_uneven_blocks_padded_to_the_longest_and_cut_back(counts: list[int]) -> None:
    flat = torch.arange(float(sum(counts)))
    longest = max(counts)
    padded = torch.full((len(counts) * longest,), -1.0)
    pad_blocks(flat, counts, padded)
    rows = padded.view(len(counts), longest)
    offset = 0
    for k, count in enumerate(counts):
        assert rows[k, :count].tolist() == flat[offset:offset + count].tolist()
        assert rows[k, count:].tolist() == [-1.0] * (longest - count)
        offset += count
    back = torch.empty_like(flat)
    cut_blocks(padded, counts, back)
    assert torch.equal(back, flat)


def test_uneven_pieces_are_padded_where_the_padding_adds_little() -> None:
    assert padding_pays([3, 3, 2, 2], 4)  # a balanced partition: 2 of 10 more
    assert padding_pays([1, 1, 1, 4000], 4)  # 3 times the bytes, but 48 KB: latency's
    assert not padding_pays([1, 1, 1, 40_000], 4)  # 480 KB more: as an all-to-all
    assert padding_pays([100_000] * 3 + [75_000], 4)  # 100 KB, a fifteenth more


def test_the_process_groups_timeout_is_a_backstop_after_the_communication_timeout() -> None:
    assert process_group_timeout(30.0) == datetime.timedelta(seconds=120)
    assert process_group_timeout(None) == NO_TIMEOUT
