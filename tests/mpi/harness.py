"""The runner of the MPI check scripts: `@check` functions run in order on every rank; rank 0
prints `ok <name>` for each one that passed on all ranks; a failure prints that rank's
traceback and aborts the job (tests/test_mpi_checks.py reads the `ok` lines)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from mpi4py import MPI

CHECKS: list[Callable[[], None]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


def run_checks() -> None:
    world = MPI.COMM_WORLD
    for fn in CHECKS:
        try:
            fn()
            world.Barrier()
            if world.Get_rank() == 0:
                print(f"ok {fn.__name__}", flush=True)
        except BaseException:
            sys.stderr.write(f"[rank {world.Get_rank()}] {fn.__name__} FAILED\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            world.Abort(1)
