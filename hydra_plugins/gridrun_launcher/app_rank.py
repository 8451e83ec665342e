"""One rank of a job that `hydra/launcher=mpi` started for an app other than gridrun:
`python -m hydra_plugins.gridrun_launcher.app_rank JOB_FILE RESULT_FILE`.

`JOB_FILE` holds what the launcher's process knew (the task function, the job's composed config,
the HydraContext, Hydra's singleton state), pickled with cloudpickle: the task function is
usually defined in the app's `__main__`, which plain pickle sends by name only. Every rank runs
the task with that config through Hydra's `run_job`, so each sees the same output directory in
`HydraConfig`. Rank 0 alone is the job as Hydra knows it: it writes `.hydra/`, the job's log and
runs the callbacks, then writes its `JobReturn` to `RESULT_FILE`; the other ranks run quietly.

A rank whose task raised prints its traceback and ends the whole MPI job, as an uncaught
exception does under `python -m mpi4py`: the other ranks may be waiting for it in a collective.
A rank other than 0 first gives rank 0 a moment to write its result, so that a task that raises
on every rank comes back as its own exception rather than as a killed job.

The rank is told by the launcher's environment (`runner.training.mpienv`), not by MPI: initialising
MPI is the task's business (it may want its own thread level, or no MPI at all).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import cloudpickle
from hydra._internal.callbacks import Callbacks
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict, read_write

from runner.training.mpienv import detect_mpi_environment

# How long a failed rank other than 0 waits for rank 0's result before it ends the job.
RESULT_WAIT_S = 5.0
POLL_S = 0.05
# Hydra's `hydra/job_logging=none`: Python's logging left as it is.
NO_LOGGING = {"version": 1, "root": None, "disable_existing_loggers": False}


@dataclass(frozen=True)
class RankJob:
    """What every rank of the job needs, as the launcher's process composed it."""

    task_function: TaskFunction
    config: DictConfig
    hydra_context: HydraContext
    singleton_state: Any


def _follower_job(job: RankJob) -> tuple[DictConfig, HydraContext]:
    """The config and context of a rank other than 0: the same job, without writing `.hydra/`,
    configuring logging (as `hydra/job_logging=none`: the job's log file and console lines are
    rank 0's; warnings still reach stderr) or running the callbacks (once per job, as under any
    launcher)."""
    config = job.config
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None
        config.hydra.job_logging = NO_LOGGING
    return config, HydraContext(config_loader=job.hydra_context.config_loader,
                                callbacks=Callbacks())


def _sendable(ret: JobReturn, number: int) -> bytes:
    """`ret` pickled so that the launcher can unpickle it. A value that does not come back from
    pickling (an exception whose constructor takes other arguments than its message is the
    usual one) is replaced by a RuntimeError with its text, and the job counts as failed."""
    try:
        data: bytes = cloudpickle.dumps(ret)
        cloudpickle.loads(data)
        return data
    except Exception as exc:
        problem = RuntimeError(f"job {number}: its result {ret._return_value!r} cannot be sent "
                               f"back to the launcher: {exc}")
        return cloudpickle.dumps(replace(ret, status=JobStatus.FAILED, _return_value=problem))


def _write_result(path: Path, ret: JobReturn, number: int) -> None:
    """Write rank 0's JobReturn whole or not at all (a killed rank leaves no half file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(_sendable(ret, number))
    os.replace(partial, path)


def _report_failure(error: BaseException, number: int, rank: int) -> None:
    """The rank's own traceback: the launcher gets the exception back, but not where it was
    raised. One write, so that the ranks' reports do not interleave."""
    sys.stderr.write(f"job {number}, rank {rank}: the task raised\n"
                     + "".join(traceback.format_exception(error)))
    sys.stderr.flush()


def _await_result(path: Path) -> None:
    deadline = time.monotonic() + RESULT_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


def _end_job() -> NoReturn:
    """End the whole MPI job, as an uncaught exception under `python -m mpi4py` does. A rank that
    simply exits would first finalize MPI (mpi4py does at exit), and MPICH takes a finalized
    rank's exit code for a normal end: the other ranks would wait for it for ever."""
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.COMM_WORLD.Abort(1)
    sys.exit(1)


def main(argv: Sequence[str]) -> bool:
    """Run this rank's part of the job; whether the task completed here."""
    job_file, result_file = (Path(arg) for arg in argv)
    job: RankJob = cloudpickle.loads(job_file.read_bytes())
    mpi = detect_mpi_environment()
    rank = 0 if mpi is None else mpi.rank
    number = int(job.config.hydra.job.num)
    setup_globals()
    Singleton.set_state(job.singleton_state)
    config, context = ((job.config, job.hydra_context) if rank == 0 else _follower_job(job))
    ret = run_job(task_function=job.task_function, config=config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir",
                  hydra_context=context)
    if ret.status != JobStatus.COMPLETED:  # before the result: the other ranks wait for it
        _report_failure(ret._return_value, number, rank)
    if rank == 0:
        _write_result(result_file, ret, number)
    elif ret.status != JobStatus.COMPLETED:
        _await_result(result_file)
    return ret.status == JobStatus.COMPLETED


if __name__ == "__main__":
    try:
        completed = main(sys.argv[1:])
    except BaseException:  # outside the task (or Ctrl-C): the whole job ends too, not this rank
        traceback.print_exc()
        completed = False
    if not completed:
        _end_job()
