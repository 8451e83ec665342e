"""The communication watchdog: a collective that does not complete in time ends the job.

MPI collectives have no timeout: a peer that hung (or died without the launcher noticing) leaves
every other rank blocked in its next collective for ever. `CountedComm` marks each blocking
operation in flight on the shared `CommCounter` (a tuple written before the MPI call, None after:
no lock on the hot path), and a daemon thread per rank looks at it every `interval` seconds.
mpi4py releases the GIL inside MPI calls, so the thread runs while the main thread is blocked.

On timeout the thread writes one line to stderr and to the rank's log, then calls `on_timeout`
(the worker records the failure and calls MPI Abort from this thread, which ends the whole job
under MPICH while the main thread is still blocked; see tests/test_failures.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from runner.core.comm import CommCounter, InFlight

LOGGER_NAME = "gridrun"


def describe_timeout(rank: int, in_flight: InFlight, timeout_s: float,
                     setting: str = "the communication timeout") -> str:
    """The one line that says which operation did not complete, on which rank and group."""
    op, group, size, label, _ = in_flight
    what = f"{op} '{label}'" if label else op
    return (f"rank {rank}: {what} on group {group} ({size} ranks) did not complete within "
            f"{timeout_s:g} s ({setting}); a peer may have hung or died")


class CommWatchdog:
    """Watches `counter.in_flight` from a daemon thread; `on_timeout(message, in_flight)` runs
    in that thread, once, when one operation has been in flight longer than `timeout_s`."""

    def __init__(self, counter: CommCounter, timeout_s: float, rank: int,
                 on_timeout: Callable[[str, InFlight], None], *,
                 setting: str = "the communication timeout",
                 interval: float | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.counter = counter
        self.timeout_s = timeout_s
        self.rank = rank
        self.on_timeout = on_timeout
        self.setting = setting
        # Late by at most `interval`: a tenth of the timeout, checked at least once a second.
        self.interval = interval if interval is not None else min(1.0, timeout_s / 10)
        self.fired: str | None = None
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

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            in_flight = self.counter.in_flight  # one read: a consistent tuple
            if in_flight is not None and time.perf_counter() - in_flight[4] > self.timeout_s:
                self._fire(in_flight)
                return

    def _fire(self, in_flight: InFlight) -> None:
        message = describe_timeout(self.rank, in_flight, self.timeout_s, self.setting)
        self.fired = message
        sys.stderr.write(f"\n[rank {self.rank}] {message}\n")
        sys.stderr.flush()
        logging.getLogger(LOGGER_NAME).error("%s", message)
        self.on_timeout(message, in_flight)
