"""Being one rank of a training job: train, and make sure a failure ends the job.

A rank reads the resolved `config.yaml` the head (or rank 0 of a job the user started) validated
and wrote; it parses it and trusts it. A rank that fails prints its traceback, records the
failure in `summary.json`, and aborts the whole MPI job: the other ranks never wait forever in a
collective. A rank blocked in a collective for longer than `trainer.comm_timeout_s` (a peer hung)
does the same from its watchdog thread.

In a job the user started (`mpiexec -n P python -m runner ...`), rank 0 composes the config and
makes the run directory, then tells the others where it is (`announce_run_dir`/`follow_rank0`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.logs import setup_rank_logging
from runner.rundir import RunDir, write_json

if TYPE_CHECKING:
    from runner.core import CommWatchdog, ProcessGrid

_announced = False
ABORT_GRACE_S = 1.0


def _set_threads(configured: int | None, mpi_comm: Any) -> None:
    import torch

    if configured is not None:
        torch.set_num_threads(configured)
    elif mpi_comm is not None:
        from mpi4py import MPI

        # Ranks on one node share its cores: oversubscribed threads only fight each other.
        local_ranks = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))


def _write_failure(directory: RunDir, failure: dict[str, Any]) -> None:
    """The first failure recorded stays: a later one is usually a consequence of it."""
    try:
        if not directory.summary.exists():
            write_json(directory.summary, {"status": "failed", **failure,
                                           "run_dir": str(directory.path)})
    except OSError:
        pass


def _record_failure(directory: RunDir, rank: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    sys.stderr.write(f"\n[rank {rank}] failed:\n{text}")
    sys.stderr.flush()
    _write_failure(directory, {"failed_rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def _start_watchdog(timeout_s: float | None, grid: ProcessGrid, directory: RunDir,
                    mpi_comm: Any) -> CommWatchdog | None:
    """The watchdog of this rank's collectives (None: disabled, or nobody to wait for)."""
    if timeout_s is None or mpi_comm is None or grid.size == 1:
        return None
    from runner.core import CommWatchdog

    rank = grid.rank

    def on_timeout(message: str, in_flight: tuple[str, str, int, str, float]) -> None:
        op, group, size, label, _ = in_flight
        _write_failure(directory, {"error": message, "timed_out": {
            "rank": rank, "op": op, "label": label, "group": group, "group_size": size,
            "timeout_s": timeout_s}})
        time.sleep(ABORT_GRACE_S)  # let the message through the launcher's pipes first
        mpi_comm.Abort(1)  # from this thread: the main thread is blocked in the collective

    return CommWatchdog(grid.counter, timeout_s, rank, on_timeout,
                        setting="trainer.comm_timeout_s").start()


def run_rank(run_dir: Path, mpi_comm: Any | None) -> int:
    """Train as this rank. `mpi_comm=None` is the 1-process run inside the head."""
    from runner.config import load_run_config
    from runner.core import ProcessGrid
    from runner.step import StepFailure
    from runner.train import train

    rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
    directory = RunDir(Path(run_dir))
    log = setup_rank_logging(directory.rank_log(rank), rank)
    try:
        run = load_run_config(directory.config)
        _set_threads(run.trainer.threads, mpi_comm)
        grid = ProcessGrid(run.grid.pr, run.grid.pc, mpi_comm)
        watchdog = _start_watchdog(run.trainer.comm_timeout_s, grid, directory, mpi_comm)
        try:
            train(run, directory, grid)
        finally:
            if watchdog is not None:
                watchdog.stop()
        return 0
    except StepFailure as exc:
        # Every rank met it at the same step: one line, no traceback, and no rank has to
        # abort the others.
        log.error("%s", exc)
        if rank == 0:
            _write_failure(directory, {"error": str(exc)})
        if mpi_comm is None or mpi_comm.Get_size() == 1:
            raise
        return 1
    except BaseException as exc:
        log.exception("rank %d failed", rank)
        _record_failure(directory, rank, exc)
        if mpi_comm is None or mpi_comm.Get_size() == 1:
            raise
        # MPI_Abort tears down the launcher's output forwarding at once: give the traceback
        # just written a moment to get through the pipes first.
        time.sleep(ABORT_GRACE_S)
        mpi_comm.Abort(1)
        return 1  # not reached: Abort ends the process


# -- inside a job the user started: rank 0 leads, the others follow --------------------------

def announce_run_dir(run_dir: Path | None) -> None:
    """Rank 0: tell the other ranks the run directory, or None when the run is refused."""
    global _announced
    if _announced:
        return
    _announced = True
    from mpi4py import MPI

    MPI.COMM_WORLD.bcast(None if run_dir is None else str(run_dir), root=0)


def lead_followers_on_exit() -> None:
    """Rank 0: whatever ends this process before the announcement must release the others."""
    atexit.register(announce_run_dir, None)


def follow_rank0() -> int:
    """Ranks 1..P-1: wait for rank 0's run directory, then train; exit 2 if rank 0 refused."""
    from mpi4py import MPI

    run_dir = MPI.COMM_WORLD.bcast(None, root=0)
    if run_dir is None:
        return 2
    return run_rank(Path(run_dir), MPI.COMM_WORLD)
