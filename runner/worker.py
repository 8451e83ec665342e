"""One rank of a training job: `python -m runner.worker RUN_DIR` (started by the head), or
rank k of a job the user started (`mpiexec -n P python -m runner ...`), where rank 0 composes the
config and makes the run directory, then tells the others where it is.

A rank that fails prints its traceback, records the failure in `summary.json`, and aborts the
whole MPI job: the other ranks never wait forever in a collective. A rank blocked in a collective
for longer than `trainer.comm_timeout_s` (a peer hung) does the same from its watchdog thread.

A rank that can say nothing (SIGKILL, the OOM killer, a segfault) is named by its supervisor:
under the head, the process the launcher starts forks the rank before MPI is initialised and
waits for it, writing the rank's pid on start and its exit status at the end into
`RUN_DIR/.ranks/rank<k>.json` (read by `runner.mpijob`), then ends the way the rank did, so the
launcher reacts as it would without it. Why not let the head watch pids alone: MPICH ends the
whole job ~40 ms after one rank is killed, and the other ranks die within milliseconds of it
(some even before the dead rank's pid is seen to end), too close to tell which was first; the
PID in MPICH's own message is not the dead rank's either. A parent's `waitpid` is exact.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

# Light imports only (runner.config would bring torch): the supervisor forks before the rank
# imports torch and initialises MPI.
from runner.logs import setup_rank_logging
from runner.rundir import RunDir, write_json

if TYPE_CHECKING:
    from runner.core import CommWatchdog, ProcessGrid

_announced = False
ABORT_GRACE_S = 1.0
RANKS_DIR = ".ranks"  # the supervisors' records, inside the run directory
# Forwarded by MPICH's mpiexec to every process of each rank's process group: meant for the rank
# (which stops cleanly, see runner.interrupt), not for its supervisor.
_RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@dataclass(frozen=True)
class MPIEnvironment:
    rank: int
    size: int
    source: str


# (rank variable, size variable, who sets them). Checked without importing mpi4py, so that
# merely looking does not initialise MPI in a head process (or in a rank's supervisor).
_MPI_ENV_VARS = (
    ("PMI_RANK", "PMI_SIZE", "MPICH/Intel MPI"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MVAPICH2"),
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun"),
)


def detect_mpi_environment(environ: Mapping[str, str] = os.environ) -> MPIEnvironment | None:
    """The MPI job this process belongs to, if it was started as one rank of several."""
    for rank_var, size_var, source in _MPI_ENV_VARS:
        if rank_var in environ and size_var in environ:
            if source == "srun" and "SLURM_STEP_ID" not in environ:
                continue  # an sbatch script's own shell is not a task of a job step
            try:
                rank, size = int(environ[rank_var]), int(environ[size_var])
            except ValueError:
                continue
            if size > 1:
                return MPIEnvironment(rank, size, source)
    return None


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
    from runner.config import validate
    from runner.core import ProcessGrid
    from runner.train import StepFailure, train

    rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
    directory = RunDir(Path(run_dir))
    log = setup_rank_logging(directory.rank_log(rank), rank)
    try:
        size = 1 if mpi_comm is None else mpi_comm.Get_size()
        run = validate(OmegaConf.load(directory.config), world_size=size)
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


# -- the supervisor: who names a rank that died without a word -------------------------------

def rank_record_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank{rank}.json"


def read_rank_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The supervisors' records by rank (records being replaced are read whole or not at all)."""
    records: dict[int, dict[str, Any]] = {}
    folder = Path(run_dir) / RANKS_DIR
    try:
        paths = list(folder.glob("rank*.json"))
    except OSError:
        return records
    for path in paths:
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def _die_with_parent(parent: int) -> None:
    """In the rank: be killed if the supervisor goes (Linux), so no rank outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it went before the request was in place
        os._exit(1)


def _exit_like(status: int) -> int:
    """End the supervisor as the rank ended: MPICH cleans up at once after a rank killed by a
    signal (a non-zero exit before MPI init, on the other hand, leaves the others waiting)."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                import resource

                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core of the supervisor
            except (ImportError, ValueError, OSError):
                pass
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum  # the signal is ignored or blocked: say it anyway
    return os.waitstatus_to_exitcode(status)


def supervise(run_dir: Path, rank: int) -> int | None:
    """Fork the rank. Returns None in the rank (go on and train), the exit code in the
    supervisor after the rank ended."""
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with_parent(parent)
        return None
    for signum in _RANK_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    path = rank_record_path(run_dir, rank)
    record: dict[str, Any] = {"rank": rank, "pid": child, "supervisor_pid": parent,
                              "launcher_pid": os.getppid(), "host": socket.gethostname(),
                              "started": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, record)
    except OSError:
        pass  # the head then knows less, nothing more
    _, status = os.waitpid(child, 0)
    record["ended"] = time.time()
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit_code"] = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(OSError):
        write_json(path, record)
    return _exit_like(status)


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
    run_dir = Path(argv[1])
    job = detect_mpi_environment()
    if job is not None and hasattr(os, "fork"):
        code = supervise(run_dir, job.rank)
        if code is not None:
            return code
    from mpi4py import MPI

    return run_rank(run_dir, MPI.COMM_WORLD)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
