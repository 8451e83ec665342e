"""Reading ahead: the next steps' rows are read on background threads while a step computes.

`ReadAhead` takes the plans of the reads to come (an iterator: what each step will read) and a
function that reads one plan; it keeps `depth` reads in flight on `workers` threads and hands
them back in the plans' order. A read that fails raises where its result is taken, at the step
that needed it, never earlier (a read ahead of the last step that fails is never seen). With
`workers` 0 a read is made when its result is taken, on the caller's thread.

Threads, not processes: the reads are file reads and decoding, which release the GIL (`pread`,
PIL's decoders, torch's gathers), and a thread shares the rank's memory, its open files and its
MPI process, where a forked reader would copy a rank that holds a communicator.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

Plan = TypeVar("Plan")
Result = TypeVar("Result")


class ReadAhead(Generic[Plan, Result]):
    """Reads of `plans` by `read`, `depth` in flight on `workers` threads, in order."""

    def __init__(self, read: Callable[[Plan], Result], plans: Iterator[Plan], workers: int,
                 depth: int) -> None:
        self.read, self.plans = read, plans
        self.depth = max(1, depth)
        self._pool = (ThreadPoolExecutor(workers, thread_name_prefix="gridrun-read")
                      if workers > 0 else None)
        self._pending: collections.deque[Future[tuple[Plan, Result]]] = collections.deque()
        self._exhausted = False

    def _fill(self) -> None:
        """Reads started until `depth` are in flight or the plans run out."""
        assert self._pool is not None
        while not self._exhausted and len(self._pending) < self.depth:
            try:
                plan = next(self.plans)
            except StopIteration:
                self._exhausted = True
                return
            self._pending.append(self._pool.submit(self._planned, plan))

    def _planned(self, plan: Plan) -> tuple[Plan, Result]:
        return plan, self.read(plan)

    def next(self) -> tuple[Plan, Result]:
        """The next plan and what its read gave (its error raised here); StopIteration when
        the plans have run out."""
        if self._pool is None:
            return self._planned(next(self.plans))
        self._fill()
        if not self._pending:
            raise StopIteration
        done = self._pending.popleft()
        self._fill()  # the pool stays `depth` ahead while the caller computes
        return done.result()

    def close(self) -> None:
        """Stops reading: reads not started are dropped, those under way end on their own."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pending.clear()
