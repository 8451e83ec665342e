"""Being one rank of a training job: train, and make sure a failure ends the job.

A rank reads the resolved `config.yaml` the head (or rank 0 of a job the user started) validated
and wrote; it parses it and trusts it. A rank that fails prints its traceback, records the
failure in `summary.json`, and aborts the whole MPI job: the other ranks never wait forever in a
collective. A rank blocked in a collective for longer than its deadline (a peer hung) does the
same from its watchdog thread: at most `trainer.comm_timeout_s`, and within training steps a few
times the slowest step so far (`runner.core.pace`); under the head, the head ends the job where
that abort does not (`runner.cli.mpijob`).

The rank that times out is the one that waited: to name the one that did not arrive, each rank's
watchdog records this rank's progress in `RUN_DIR/.ranks/progress-<rank>.json` about once a
second, and reads the others' when it times out (no MPI traffic; the run directory is shared by
the ranks already). Under the head, a failure is also reported in room the rank reserved in
`.ranks/` at its start (`runner.training.supervisor.report_failure`): on a full disk `summary.json`
cannot be written, and the head still names the rank, the file and the reason.

The user's code may end the process itself: `sys.exit(n)` (or `raise SystemExit`) and, while a
rank trains, `os._exit(n)` (which raises `UserExit` in the process that trains, so that it unwinds
as `sys.exit` does) are recorded as one line naming the code, the place and the phase ("rank 1
exited with code 5 (sys.exit in the user's code at nets.py:12 in Net.__init__) during
start-up"), and end the job as any failure does: an exit with code 0 before the run completed is
a failure too. Where no supervisor outlives the rank (a 1-process run in the head, a job the user
started), the rank ends what its code left running itself, as a supervisor would.

In a job the user started (`mpiexec -n P python -m runner ...`), rank 0 composes the config and
makes the run directory, then tells the others where it is (`announce_run_dir`/`follow_rank0`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from runner.records import safe_paths
from runner.records.console import printable
from runner.records.logs import setup_rank_logging
from runner.records.process import (
    UserExit,
    adopt_orphans,
    code_place,
    descendants,
    end_processes,
    exit_words,
    reap,
    whose_code,
)
from runner.records.rundir import RunDir, write_json
from runner.training.interrupt import relay_stop_signal_from
from runner.training.supervisor import (
    RANKS_DIR,
    report_failure,
    reserve_failure_report,
    stop_signal_path,
    supervised,
)

if TYPE_CHECKING:
    import torch

    from runner.config.schema import RunConfig
    from runner.core import CommWatchdog, ProcessGrid
    from runner.core.watchdog import CommProgress

_announced = False
ABORT_GRACE_S = 1.0
PROGRESS_BYTES = 1 << 16  # a progress record is a few hundred bytes


def _set_threads(configured: int | None, mpi_comm: Any) -> None:
    import torch

    if configured is not None:
        torch.set_num_threads(configured)
    elif mpi_comm is not None:
        from mpi4py import MPI

        # Ranks on one node share its cores: oversubscribed threads only fight each other.
        local_ranks = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))


def _write_failure(directory: RunDir, rank: int, failure: dict[str, Any]) -> None:
    """The first failure recorded stays: a later one is usually a consequence of it. It is
    reported to the head too, where `summary.json` cannot be written (a full disk)."""
    if supervised():
        report_failure(directory.path, rank, failure)
    try:
        if not directory.summary.exists():
            write_json(directory.summary, {"status": "failed", **failure,
                                           "run_dir": str(directory.path)})
    except OSError:
        pass


# Errors of a write that found no room or no permission to grow: "cannot write FILE".
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def describe_error(exc: BaseException) -> str:
    """The failure in one line, for `summary.json` and so the head's last line (the traceback
    is in the rank's log): an `OSError` that names its file says the file and the system's
    words, e.g. "cannot write /runs/a/metrics.jsonl: No space left on device (ENOSPC)"; a
    refusal of a place in the run directory (a link) in its own words."""
    if isinstance(exc, safe_paths.PathRefused):
        return str(exc)
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        target = str(exc.filename)
        if exc.filename2 is not None:
            target += f" -> {exc.filename2}"
        code = errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else ""
        if exc.errno in _WRITE_ERRNOS:
            return f"cannot write {target}: {exc.strerror} ({code})"
        return f"{target}: {exc.strerror} ({type(exc).__name__}{f', {code}' if code else ''})"
    return f"{type(exc).__name__}: {exc}"


def _said_in_one_line(exc: BaseException) -> bool:
    """A failure whose message says all (a dataset's bad row, named with its value; a link
    refused in the run directory): its traceback is for the rank's log only."""
    from runner.zoo.datasets import DatasetError

    return isinstance(exc, (DatasetError, safe_paths.PathRefused))


def _record_failure(directory: RunDir, rank: int, exc: BaseException) -> None:
    if not _said_in_one_line(exc):
        text = "".join(traceback.format_exception(exc))
        # its messages may quote a run's files: escaped, as all text from files is
        sys.stderr.write(printable(f"\n[rank {rank}] failed:\n{text}", newlines=True))
        sys.stderr.flush()
    _write_failure(directory, rank, {"failed_rank": rank, "error": describe_error(exc)})


# -- the user's code ending the process ----------------------------------------------------------

class UserCodeExited(RuntimeError):
    """A 1-process run whose user code exited (its one line, recorded in `summary.json`)."""


def describe_exit(rank: int, exc: SystemExit | UserExit, phase: str) -> str:
    """The one line for the user's code ending a rank: the code, how, where, when."""
    status, words = exit_words(exc)
    unfinished = ", before the run completed" if status == 0 else ""
    return f"rank {rank} {words}{phase}{unfinished}"


@contextlib.contextmanager
def _exits_recorded(rank: int, record: Any) -> Iterator[None]:
    """While the rank trains, `os._exit` in this process raises `UserExit` (in its main
    thread), or records the exit through `record(message)` before it happens (another
    thread: nothing there unwinds to `run_rank`); a process the user's code forked exits as
    asked."""
    real = os._exit
    owner = os.getpid()

    def guarded(status: int) -> NoReturn:
        if os.getpid() != owner:
            real(status)
        caller: FrameType = sys._getframe(1)
        where = f"in {whose_code(caller.f_code)} {code_place(caller.f_code, caller.f_lineno)}"
        if threading.current_thread() is threading.main_thread():
            raise UserExit(status, where)
        thread = threading.current_thread().name
        record(describe_exit(rank, UserExit(status, f"{where}, in thread {thread!r}"), ""))
        real(status if status != 0 else 1)

    os._exit = guarded
    try:
        yield
    finally:
        os._exit = real


@contextlib.contextmanager
def _ends_what_it_starts(log: Any, rank: int) -> Iterator[None]:
    """Processes the rank's code started and left running are killed when it ends, orphans
    included (reparented here meanwhile): where no supervisor does it (`runner.training.
    supervisor`)."""
    me = os.getpid()
    before = set(descendants([me]))
    was = adopt_orphans()
    try:
        yield
    finally:
        left = [pid for pid in descendants([me]) if pid not in before]
        if left:
            killed = end_processes(left)
            reap(killed)
            log.warning("rank %d left %d process(es) running (pids %s): killed", rank,
                        len(killed), ", ".join(map(str, killed[:10])))
        if not was:
            adopt_orphans(False)


# -- progress for the watchdogs: which rank did not arrive --------------------------------------

def progress_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"progress-{rank}.json"


def _write_progress(path: Path, progress: CommProgress) -> None:
    """Replaced by a rename (a reader sees a whole record), not synced: it only matters while
    the job runs. A failed write (a full disk) leaves the last one."""
    with contextlib.suppress(OSError):  # from the run directory, no link followed
        safe_paths.replace_file(*safe_paths.locate(path), json.dumps(progress.to_json()).encode(),
                                sync=False)


def _read_progress(path: Path) -> CommProgress | None:
    from runner.core.watchdog import CommProgress

    try:
        # no link followed, no FIFO waited on: a peer's record is a few hundred bytes
        return CommProgress.from_json(json.loads(
            safe_paths.read_bytes(*safe_paths.locate(path), PROGRESS_BYTES)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def group_members(grid: ProcessGrid, group: str) -> list[int]:
    """The world ranks of this rank's group `group` (world rank = batch index × Pr + model
    index: a model group is a block of consecutive ranks, a batch group a stride of Pr)."""
    if group == "world":
        return list(range(grid.size))
    if group == "model":
        return [grid.batch_index * grid.pr + m for m in range(grid.pr)]
    if group == "batch":
        return [b * grid.pr + grid.model_index for b in range(grid.pc)]
    return [grid.rank]


def _start_watchdog(timeout_s: float | None, grid: ProcessGrid, directory: RunDir,
                    mpi_comm: Any) -> CommWatchdog | None:
    """The watchdog of this rank's collectives (None: disabled, or nobody to wait for)."""
    if timeout_s is None or mpi_comm is None or grid.size == 1:
        return None
    from runner.core import CommWatchdog
    from runner.core.watchdog import ProgressSharing

    rank = grid.rank
    mine = progress_path(directory.path, rank)
    with contextlib.suppress(OSError):
        safe_paths.make_dir(directory.path, RANKS_DIR)

    def peers(in_flight: tuple[str, str, int, str, float]) -> dict[int, CommProgress | None]:
        return {r: _read_progress(progress_path(directory.path, r))
                for r in group_members(grid, in_flight[1]) if r != rank}

    def on_timeout(message: str, in_flight: tuple[str, str, int, str, float]) -> None:
        op, group, size, label, _ = in_flight
        deadline = watchdog.deadline
        _write_failure(directory, rank, {"error": message, "timed_out": {
            "rank": rank, "op": op, "label": label, "group": group, "group_size": size,
            "timeout_s": timeout_s, "deadline_s": None if deadline is None else deadline.seconds,
            "deadline": None if deadline is None else deadline.how,
            "missing_ranks": [a.rank for a in watchdog.absent]}})
        time.sleep(ABORT_GRACE_S)  # let the message through the launcher's pipes first
        mpi_comm.Abort(1)  # from this thread: the main thread is blocked in the collective

    sharing = ProgressSharing(publish=lambda progress: _write_progress(mine, progress),
                              peers=peers)
    watchdog = CommWatchdog(grid.counter, timeout_s, rank, on_timeout,
                            setting="trainer.comm_timeout_s", sharing=sharing, paced=True)
    return watchdog.start()


def _forget_progress(directory: RunDir, rank: int) -> None:
    """This rank's progress record, gone (with `.ranks` when it is empty: a job the user
    started has no head to remove it)."""
    with contextlib.suppress(OSError):
        progress_path(directory.path, rank).unlink(missing_ok=True)
    if not supervised():
        with contextlib.suppress(OSError):
            (directory.path / RANKS_DIR).rmdir()


def run_rank(run_dir: Path, mpi_comm: Any | None) -> int:
    """Train as this rank. `mpi_comm=None` is the 1-process run inside the head."""
    rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
    directory = RunDir(Path(run_dir))
    log = setup_rank_logging(directory.rank_log(rank), rank)
    if supervised():  # a job the head started: it reads `.ranks/` (and removes it)
        relay_stop_signal_from(stop_signal_path(directory.path))
        reserve_failure_report(directory.path, rank)

    def exited(message: str) -> None:  # os._exit on another thread, just before it exits
        log.error("%s", message)
        _write_failure(directory, rank, {"failed_rank": rank, "error": message})

    with contextlib.ExitStack() as scope:
        if not supervised():  # no supervisor to end what the rank's code leaves running
            scope.enter_context(_ends_what_it_starts(log, rank))
        scope.enter_context(_exits_recorded(rank, exited))
        return _train_rank(directory, rank, mpi_comm, log)


def _join_grid(run: RunConfig, directory: RunDir, rank: int,
               mpi_comm: Any | None) -> tuple[ProcessGrid, torch.device]:
    """This rank's place in the run's grid (collective over the job), and its device."""
    from runner.core import Backend, ProcessGrid
    from runner.core.torchdist import init_torch_distributed
    from runner.training.devices import device_paths, place_rank

    _set_threads(run.trainer.threads, mpi_comm)
    # An earlier run's record is not this rank's progress (the grid's set-up below is
    # collective: no peer reads before every rank has removed its own).
    _forget_progress(directory, rank)
    placement = place_rank(run.trainer.device, mpi_comm)  # before any NCCL group
    if run.comm.backend == "torch":  # collective over the job; nothing for one process
        init_torch_distributed(mpi_comm, timeout_s=run.trainer.comm_timeout_s)
    backend: Backend = "torch" if run.comm.backend == "torch" else "mpi"  # validated
    grid = ProcessGrid(run.grid.pr, run.grid.pc, mpi_comm, backend=backend,
                       devices=device_paths(run, placement, mpi_comm))
    return grid, placement.device


def _train_watched(run: RunConfig, directory: RunDir, grid: ProcessGrid, device: torch.device,
                   mpi_comm: Any | None) -> None:
    """Train, this rank's collectives watched for a peer that never arrives."""
    from runner.training.loop import train

    watchdog = _start_watchdog(run.trainer.comm_timeout_s, grid, directory, mpi_comm)
    try:
        train(run, directory, grid, device, ends_process=True)
    finally:
        if watchdog is not None:
            watchdog.stop()
            _forget_progress(directory, grid.rank)


def _train_rank(directory: RunDir, rank: int, mpi_comm: Any | None, log: Any) -> int:
    from runner.config.schema import load_run_config
    from runner.core.torchdist import shutdown_torch_distributed
    from runner.training.step import StepFailure

    grid: ProcessGrid | None = None  # None: the failure is the start-up's
    try:
        run = load_run_config(directory.config)
        grid, device = _join_grid(run, directory, rank, mpi_comm)
        _train_watched(run, directory, grid, device, mpi_comm)
        # Not in a `finally`: its barrier would hold a rank that failed alone from its Abort.
        shutdown_torch_distributed()  # every rank gets here; nothing under mpi
        return 0
    except StepFailure as exc:
        # Every rank met it at the same step: one line, no traceback, and no rank has to
        # abort the others.
        log.error("%s", exc)
        if rank == 0:
            _write_failure(directory, rank, {"error": str(exc)})
        if mpi_comm is None or mpi_comm.Get_size() == 1:
            raise
        shutdown_torch_distributed()  # every rank met it at the same step
        return 1
    except (SystemExit, UserExit) as exc:
        # The user's code ended the process: one line (the traceback only in the log).
        message = describe_exit(rank, exc, " during start-up" if grid is None
                                else grid.counter.pace.where())
        log.error("%s", message, exc_info=exc)
        _write_failure(directory, rank, {"failed_rank": rank, "error": message})
        if mpi_comm is None or mpi_comm.Get_size() == 1:
            raise UserCodeExited(message) from None
        time.sleep(ABORT_GRACE_S)  # as below
        mpi_comm.Abort(1)
        return 1  # not reached: Abort ends the process
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
