"""A gridrun process's start and end, without the interpreter's overheads at either.

The start: importing torch and the plugins makes some 190,000 objects that the cyclic collector
tracks and that live as long as the process; at CPython's default thresholds each full
collection walks all of them again while they arrive: 0.3 s of the 2.1 s a rank or a head takes
to import (measured on 2 cores). `defer_full_collections` raises the full collection's
threshold while the process starts (the young generations are collected as usual, so cyclic
garbage is still freed); `start_up_done` moves what start-up made out of the collector's sight
(`gc.freeze`) and restores the thresholds, so that the full collections of a long run do not
walk torch's and the model's objects either. A process that never reaches `start_up_done` (bad
input, a dry run) ends soon, having collected its oldest objects less often.

The end: tearing down an interpreter that has imported torch costs 0.5–1 s (measured here:
1.5–1.7 s to exit after the imports of a head, 2.0–2.6 s with the teardown), paid by every rank
and by the head of every run and sweep job. By the time a gridrun process ends, everything it
wrote is closed or flushed (metrics, checkpoints, the summary), so `end_process` flushes the
standard streams, runs the `atexit` handlers (logging's flush among them), finalises MPI if this
process started it, and leaves through C's `exit`, which also flushes C's stdio (MPICH's
connection to its launcher: `os._exit` there makes mpiexec kill the job). Under a profiler or
tracer (cProfile, coverage) or with GRIDRUN_FULL_EXIT=1 the process exits normally, so their
reports are written.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from typing import NoReturn


def exit_code(code: object) -> int:
    """What `sys.exit(code)` would exit with (a message is printed, as it would be)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# The full collection's threshold while a process starts: collections of the middle generation
# before the oldest is collected (CPython's default: 10).
_START_UP_FULL_THRESHOLD = 1000
_thresholds: tuple[int, int, int] | None = None


def defer_full_collections() -> None:
    """At the start of a gridrun process, before its heavy imports: full collections seldom
    until `start_up_done`."""
    global _thresholds
    if _thresholds is None:
        _thresholds = gc.get_threshold()
        gc.set_threshold(_thresholds[0], _thresholds[1], _START_UP_FULL_THRESHOLD)


def start_up_done() -> None:
    """What the process made to start (imports, the model) stays out of later collections;
    the collector's thresholds are CPython's again. Once per process; later calls do nothing."""
    global _thresholds
    if _thresholds is not None:
        gc.freeze()
        gc.set_threshold(*_thresholds)
        _thresholds = None


def end_process(code: object = 0) -> NoReturn:
    """End this process with `code` (as `sys.exit` takes it), skipping the teardown."""
    status = exit_code(code)
    if (sys.gettrace() is not None or sys.getprofile() is not None
            or os.environ.get("GRIDRUN_FULL_EXIT") == "1"):
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # mpi4py would at teardown, from a hook C's exit does not run
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes

        ctypes.CDLL(None).exit(status)
    except (OSError, AttributeError):
        pass
    os._exit(status)
