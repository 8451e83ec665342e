"""Ending a gridrun process without the interpreter's teardown.

Tearing down an interpreter that has imported torch costs 0.5–1 s (measured here: 1.5–1.7 s to
exit after the imports of a head, 2.0–2.6 s with the teardown), paid by every rank and by the
head of every run and sweep job. By the time a gridrun process ends, everything it wrote is
closed or flushed (metrics, checkpoints, the summary), so `end_process` flushes the standard
streams, runs the `atexit` handlers (logging's flush among them), finalises MPI if this process
started it, and leaves through C's `exit`, which also flushes C's stdio (MPICH's connection to
its launcher: `os._exit` there makes mpiexec kill the job). Under a profiler or tracer (cProfile,
coverage) or with GRIDRUN_FULL_EXIT=1 the process exits normally, so their reports are written.
"""

from __future__ import annotations

import atexit
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
