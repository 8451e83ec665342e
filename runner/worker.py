"""One rank of a training job: `python -m runner.worker RUN_DIR` (started by the head), or
rank k of a job the user started (`mpiexec -n P python -m runner ...`), where rank 0 composes the
config and makes the run directory, then tells the others where it is.

A rank that fails prints its traceback, records the failure in `summary.json`, and aborts the
whole MPI job: the other ranks never wait forever in a collective.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.config import validate
from runner.logs import setup_rank_logging
from runner.rundir import RunDir, write_json

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


def _record_failure(directory: RunDir, rank: int, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    sys.stderr.write(f"\n[rank {rank}] failed:\n{text}")
    sys.stderr.flush()
    try:
        if not directory.summary.exists():
            write_json(directory.summary, {"status": "failed", "failed_rank": rank,
                                           "error": f"{type(exc).__name__}: {exc}",
                                           "run_dir": str(directory.path)})
    except OSError:
        pass


def run_rank(run_dir: Path, mpi_comm: Any | None) -> int:
    """Train as this rank. `mpi_comm=None` is the 1-process run inside the head."""
    from runner.core import ProcessGrid
    from runner.train import train

    rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
    directory = RunDir(Path(run_dir))
    log = setup_rank_logging(directory.rank_log(rank), rank)
    try:
        size = 1 if mpi_comm is None else mpi_comm.Get_size()
        run = validate(OmegaConf.load(directory.config), world_size=size)
        _set_threads(run.trainer.threads, mpi_comm)
        grid = ProcessGrid(run.grid.pr, run.grid.pc, mpi_comm)
        train(run, directory, grid)
        return 0
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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m runner.worker RUN_DIR", file=sys.stderr)
        return 2
    from mpi4py import MPI

    return run_rank(Path(argv[1]), MPI.COMM_WORLD)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
