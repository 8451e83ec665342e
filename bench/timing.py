"""Timing shared by the benchmarks: every rank starts each repetition together."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def barrier_timed(comm: Any, fn: Callable[[], object], repeats: int,
                  warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones, each started
    right after a barrier (so no rank's time includes waiting for a late starter)."""
    times = []
    for i in range(warmup + repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
