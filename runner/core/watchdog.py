"""The communication watchdog: a collective that does not complete in time ends the job.

MPI collectives have no timeout: a peer that hung (or died without the launcher noticing) leaves
every other rank blocked in its next collective for ever. `CountedComm` marks each blocking
operation in flight on the shared `CommCounter` (a tuple written before the MPI call, None after:
no lock on the hot path), and a daemon thread per rank looks at it every `interval` seconds.
mpi4py releases the GIL inside MPI calls, and torch.distributed while it waits for a
collective's work, so the thread runs while the main thread is blocked under either backend
(`ProcessGrid(backend=...)`). Under "torch" the process groups have a timeout of their own, set
later than this one (`runner.core.torchdist.process_group_timeout`): a backstop, where this
watchdog names the rank that did not arrive.

Under NCCL the host does not block in a collective: the call returns once the work is queued
and the current stream waits for it, and the host blocks later, wherever it next waits for the
device (a loss read with `.item()`), outside any collective. So what the thread times is
`CommCounter.watched()`: the blocking operation the rank is in, or the oldest operation its
device has not completed (its CUDA event not reached), counted from when the host issued it.
A collective that hangs on the GPU therefore ends the job as one that hangs on the host does.

The rank that times out is the one that waited, not the one that hung. To name the latter, the same
thread also keeps a `CommProgress` of its rank (how many operations it completed, when the count
last moved, what it is in now) and hands it to `publish` about once a second; on timeout it asks
`peers` for the latest progress of the other ranks of the group (both: `ProgressSharing`) and names
those that are not in the same operation (`absent_ranks`). How progress travels between ranks (files
in the run directory, in `runner.training.rank`) is the caller's business: no MPI traffic, nothing
on the hot path.

On timeout the thread writes one line to stderr and to the rank's log, then calls `on_timeout`
(the worker records the failure and calls MPI Abort from this thread, which ends the whole job
under MPICH while the main thread is still blocked, in MPI or in gloo; see tests/test_failures.py
and, under both backends, tests/mpi/hang.py). The recorded failure is what the head acts on: an
Abort from this thread may wait for minutes while the main thread spins in MPI's progress
engine, so under the head it kills the job a few seconds after the record appears
(`runner.cli.mpijob`, tests/test_hangs.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runner.core.comm import CommCounter, InFlight
from runner.core.pace import Deadline

LOGGER_NAME = "gridrun"
# The most ranks a timeout message names one by one (all are in `CommWatchdog.absent`).
NAMED_ABSENT = 8

# (operation, group name, group size, label, start as wall-clock time: compared across ranks)
ProgressInFlight = tuple[str, str, int, str, float]


def describe_timeout(rank: int, in_flight: InFlight, timeout_s: float,
                     setting: str = "the communication timeout", where: str = "") -> str:
    """The one line that says which operation did not complete, on which rank and group, and
    (`where`) in what work: " in step 8"; `setting` says how the deadline was derived."""
    op, group, size, label, _ = in_flight
    what = f"{op} '{label}'" if label else op
    return (f"rank {rank}: {what} on group {group} ({size} ranks){where} did not complete "
            f"within {timeout_s:g} s ({setting}); a peer may have hung or died")


@dataclass(frozen=True)
class CommProgress:
    """One rank's communication as its watchdog last saw it. Times are wall-clock
    (`time.time()`): they are compared between processes, on one host or several whose clocks
    agree to well under the timeout."""

    rank: int
    completed: int  # operations completed so far (the counter's calls)
    last_completed_at: float  # when `completed` was last seen to change (or the watch began)
    in_flight: ProgressInFlight | None  # the blocking operation it is in, if any
    written: float  # when this snapshot was taken

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "completed": self.completed,
                "last_completed_at": self.last_completed_at,
                "in_flight": None if self.in_flight is None else list(self.in_flight),
                "written": self.written}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CommProgress:
        """The inverse of `to_json`; a malformed record raises KeyError, TypeError or
        ValueError."""
        raw = data["in_flight"]
        in_flight: ProgressInFlight | None = None
        if raw is not None:
            op, group, size, label, since = raw
            in_flight = (str(op), str(group), int(size), str(label), float(since))
        return cls(int(data["rank"]), int(data["completed"]), float(data["last_completed_at"]),
                   in_flight, float(data["written"]))


@dataclass(frozen=True)
class Absence:
    """A rank of the group that did not arrive in the operation, and what it was doing."""

    rank: int
    reason: str


def _where(in_flight: ProgressInFlight, now: float) -> str:
    op, group, _, label, since = in_flight
    what = f"{op} '{label}'" if label else op
    return f"it is in {what} on group {group}, for {max(0.0, now - since):.1f} s"


def absent_ranks(waiting: CommProgress, peers: Mapping[int, CommProgress | None], now: float,
                 stale_after: float) -> list[Absence]:
    """The ranks of `peers` that are not in `waiting`'s operation (same op, group, size and
    label), with why: not in any operation (and how long since it last completed one), in
    another one, or no progress recorded (none, or none for `stale_after` seconds)."""
    if waiting.in_flight is None:
        return []
    absent = []
    for rank in sorted(peers):
        progress = peers[rank]
        if rank == waiting.rank:
            continue
        if progress is None:
            absent.append(Absence(rank, "it recorded no progress (it may not have started, "
                                        "or its process is gone)"))
            continue
        if progress.in_flight is not None and progress.in_flight[:4] == waiting.in_flight[:4]:
            continue  # it arrived: it waits in the same operation
        if progress.in_flight is not None:
            state = f"{_where(progress.in_flight, now)} (after #{progress.completed})"
        elif progress.completed == 0:
            state = "it has completed no collective; it is not in a collective"
        else:
            ago = max(0.0, now - progress.last_completed_at)
            state = (f"its last collective was #{progress.completed}, {ago:.1f} s ago; it is not "
                     f"in a collective")
        behind = waiting.completed - progress.completed
        if behind > 0:
            state += f" ({behind} fewer completed than rank {waiting.rank})"
        age = now - progress.written
        if age > stale_after:
            state = (f"its progress was last recorded {age:.1f} s ago (its process may be stopped "
                     f"or gone); then {state}")
        absent.append(Absence(rank, state))
    return absent


def describe_absent(absent: list[Absence], limit: int = NAMED_ABSENT) -> str:
    """'rank 2 did not arrive: ...; rank 3 did not arrive: ...', the first `limit` of them."""
    parts = [f"rank {a.rank} did not arrive: {a.reason}" for a in absent[:limit]]
    if len(absent) > limit:
        parts.append(f"{len(absent) - limit} more ranks did not arrive")
    return "; ".join(parts)


@dataclass(frozen=True)
class ProgressSharing:
    """How a watchdog shares its rank's progress with the other ranks' watchdogs (how it
    travels is the caller's business: module docstring).

    With `publish`, the watchdog's thread hands this rank's `CommWatchdog.progress()` to it
    every `publish_every` seconds (from the thread: a slow file system never delays training).
    With `peers`, a timeout asks it for the other ranks' latest progress (`peers(in_flight)`:
    the other ranks of that operation's group by rank, None where none is known) and waits up
    to `settle_s` for snapshots taken after the timeout."""

    publish: Callable[[CommProgress], None] | None = None
    peers: Callable[[InFlight], Mapping[int, CommProgress | None]] | None = None
    publish_every: float = 1.0
    settle_s: float | None = None


class CommWatchdog:
    """Watches `counter.watched()` from a daemon thread; `on_timeout(message, in_flight)` runs
    in that thread, once, when one operation has been in flight longer than its deadline:
    `timeout_s`, or with `paced`, the deadline `counter.pace` derives from the steps timed so
    far, at most `timeout_s` (`runner.core.pace`); the one that fired is in `deadline`.

    With `sharing`, the thread publishes this rank's progress and, on a timeout, reads the
    peers' (`ProgressSharing`) to name the ranks that did not arrive, in the message and in
    `absent` (set before `on_timeout` runs)."""

    def __init__(self, counter: CommCounter, timeout_s: float, rank: int,
                 on_timeout: Callable[[str, InFlight], None], *,
                 setting: str = "the communication timeout",
                 interval: float | None = None,
                 sharing: ProgressSharing = ProgressSharing(),
                 paced: bool = False) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.counter = counter
        self.timeout_s = timeout_s
        self.rank = rank
        self.on_timeout = on_timeout
        self.setting = setting
        # Late by at most `interval`: a tenth of the timeout, checked at least once a second.
        self.interval = interval if interval is not None else min(1.0, timeout_s / 10)
        self.publish = sharing.publish
        self.peers = sharing.peers
        self.publish_every = sharing.publish_every
        # Every peer that still runs its watchdog publishes within `publish_every` of a
        # timeout: a little more than that is enough to hear from all of them.
        self.settle_s = (sharing.settle_s if sharing.settle_s is not None
                         else sharing.publish_every + 0.5)
        self.paced = paced
        self.fired: str | None = None
        self.deadline: Deadline | None = None
        self.absent: list[Absence] = []
        self._completed = counter.totals.calls
        self._completed_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gridrun-comm-watchdog",
                                        daemon=True)

    def start(self) -> CommWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def __enter__(self) -> CommWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def progress(self) -> CommProgress:
        """This rank's communication now (cheap: two attribute reads and a clock)."""
        in_flight = self.counter.watched()  # one read: a consistent tuple
        completed = self.counter.totals.calls
        now, clock = time.time(), time.perf_counter()
        if completed != self._completed:
            self._completed, self._completed_at = completed, now
        since: ProgressInFlight | None = None
        if in_flight is not None:
            op, group, size, label, start = in_flight
            since = (op, group, size, label, now - (clock - start))
        return CommProgress(self.rank, completed, self._completed_at, since, now)

    def _publish(self) -> CommProgress:
        progress = self.progress()
        if self.publish is not None:
            try:
                self.publish(progress)
            except Exception as exc:  # a failed record must not end the watch
                logging.getLogger(LOGGER_NAME).warning("progress not recorded: %s", exc)
        return progress

    def _watch(self) -> None:
        next_publish = time.monotonic()
        while True:
            if self.publish is not None and time.monotonic() >= next_publish:
                self._publish()
                next_publish = time.monotonic() + self.publish_every
            wait = self.interval
            if self.publish is not None:
                wait = max(0.0, min(wait, next_publish - time.monotonic()))
            if self._stop.wait(wait):
                return
            in_flight = self.counter.watched()  # one read: a consistent tuple
            if in_flight is not None:
                deadline = self._deadline()
                if time.perf_counter() - in_flight[4] > deadline.seconds:
                    self._fire(in_flight, deadline)
                    return
            self.progress()  # notes when the count of completed operations moved

    def _absent_peers(self, in_flight: InFlight) -> list[Absence]:
        """The ranks of the group that are not in `in_flight`, from snapshots taken after now
        where they come within `settle_s` (this rank's own is published meanwhile, for the
        peers that timed out too)."""
        assert self.peers is not None
        asked_at = time.time()
        deadline = time.monotonic() + self.settle_s
        while True:
            mine = self._publish()
            try:
                latest = self.peers(in_flight)
            except Exception as exc:  # the timeout is reported all the same
                logging.getLogger(LOGGER_NAME).warning("peers' progress not read: %s", exc)
                return []
            fresh = all(p is not None and p.written >= asked_at for p in latest.values())
            if fresh or time.monotonic() >= deadline:
                return absent_ranks(mine, latest, time.time(),
                                    stale_after=self.settle_s + self.publish_every)
            time.sleep(0.1)

    def _deadline(self) -> Deadline:
        if not self.paced:
            return Deadline(self.timeout_s, self.setting)
        return self.counter.pace.deadline(self.timeout_s, self.setting)

    def _fire(self, in_flight: InFlight, deadline: Deadline) -> None:
        self.deadline = deadline
        where = self.counter.pace.where() if self.paced else ""
        message = describe_timeout(self.rank, in_flight, deadline.seconds, deadline.how, where)
        if self.peers is not None:
            self.absent = self._absent_peers(in_flight)
            if self.absent:
                message = f"{message}; {describe_absent(self.absent)}"
        self.fired = message
        sys.stderr.write(f"\n[rank {self.rank}] {message}\n")
        sys.stderr.flush()
        logging.getLogger(LOGGER_NAME).error("%s", message)
        self.on_timeout(message, in_flight)
