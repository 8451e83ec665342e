"""A rank that hangs outside any collective still ends the job, under either backend: its peer
waits in an all-reduce (a torch.distributed one under "torch"), its watchdog fires and aborts
the MPI job from the watchdog's thread, as `runner.training.rank` does. Not a `@check` script: the
job is meant to end by MPI_Abort. `mpiexec -n 2 python THIS --backend=torch [blocking|nonblocking]`.

Rank 0 prints `waiting` just before it enters the collective that never completes; the test
reads the watchdog's line on stderr, the exit code and how long the job took.
"""

from __future__ import annotations

import sys
import time

import torch
from harness import BACKEND
from mpi4py import MPI

from runner.core import CommWatchdog, ProcessGrid

TIMEOUT_S = 1.0
ABORT_GRACE_S = 1.0  # runner.training.rank's
WORLD = MPI.COMM_WORLD
MODE = sys.argv[1] if len(sys.argv) > 1 else "blocking"


def on_timeout(message: str, in_flight: object) -> None:
    # as runner.training.rank: the watchdog's line through the launcher first
    time.sleep(ABORT_GRACE_S)
    WORLD.Abort(1)  # from the watchdog's thread: the main thread is blocked in the collective


def main() -> None:
    grid = ProcessGrid(1, WORLD.Get_size(), WORLD, backend=BACKEND)
    assert grid.world.backend == BACKEND, grid.world
    watchdog = CommWatchdog(grid.counter, TIMEOUT_S, grid.rank, on_timeout).start()
    x = torch.ones(1000)
    grid.world.allreduce_(x, label="warm")  # both ranks arrive: completes
    if grid.rank == 1:
        time.sleep(120)  # hung outside any collective: the test ends long before
    else:
        print("waiting", flush=True)
        if MODE == "blocking":
            grid.world.allreduce_(x, label="hang")
        else:
            grid.world.iallreduce_(x, label="hang").wait()
    watchdog.stop()
    print("not reached", flush=True)


if __name__ == "__main__":
    main()
