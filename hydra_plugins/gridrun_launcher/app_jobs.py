"""`hydra/launcher=mpi` for a Hydra app other than gridrun: each job of the sweep is an MPI job
of the size its own config names (`hydra.launcher.ranks`), run to its end before the next starts.

For each job the launcher composes the job's config as Hydra's own launcher does, pickles what
the ranks need into a file in the sweep directory (which a cluster's nodes share, where /tmp is
each node's own), starts `<command> <nproc_flag> <ranks> <args> python -m
hydra_plugins.gridrun_launcher.app_rank JOB_FILE RESULT_FILE` and waits for it; rank 0 writes the
job's `JobReturn` to `RESULT_FILE` (`app_rank`). The JobReturns come back in job order, each
return value as the task returned it; a job whose MPI job ended without a result, or with an
exit code that says another rank failed, is a failed job naming the exit code and the command.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import cloudpickle
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

from hydra_plugins.gridrun_launcher.app_rank import RankJob

log = logging.getLogger(__name__)

RANK_MODULE = "hydra_plugins.gridrun_launcher.app_rank"


class MPIJobFailed(RuntimeError):
    """A job's MPI job ended without rank 0's result, or with a rank failed after it."""


def launch_app_jobs(config: DictConfig, hydra_context: HydraContext,
                    task_function: TaskFunction, job_overrides: Sequence[Sequence[str]],
                    initial_job_idx: int) -> list[JobReturn]:
    """Run the jobs one after another, each as its own MPI job; their JobReturns in job order."""
    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    log.info(f"Launching {len(job_overrides)} jobs, one MPI job each")
    returns = []
    with tempfile.TemporaryDirectory(prefix=".mpi-launcher-", dir=sweep_dir) as exchange:
        for offset, overrides in enumerate(job_overrides):
            number = initial_job_idx + offset
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
            job_config = _job_config(config, hydra_context, overrides, number)
            job = RankJob(task_function, job_config, hydra_context, Singleton.get_state())
            returns.append(_run_mpi_job(job, list(overrides), number, Path(exchange)))
    return returns


def _job_config(config: DictConfig, hydra_context: HydraContext, overrides: Sequence[str],
                number: int) -> DictConfig:
    """The job's config, composed as Hydra's own launcher composes it."""
    job_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(job_config):
        job_config.hydra.job.id = number
        job_config.hydra.job.num = number
    return job_config


def _run_mpi_job(job: RankJob, overrides: list[str], number: int, exchange: Path) -> JobReturn:
    """Start the job's ranks, wait for them, and return rank 0's result."""
    job_file, result_file = exchange / f"job{number}", exchange / f"job{number}.result"
    job_file.write_bytes(cloudpickle.dumps(job))
    command = mpi_command(job.config.hydra.launcher, job_file, result_file)
    from runner.cli.mpijob import stop_with_parent

    # mpiexec gets SIGTERM when the sweep's head dies, and passes it on to the ranks
    code = subprocess.run(command, env=rank_environment(), check=False,
                          preexec_fn=stop_with_parent()).returncode
    return _job_return(result_file, overrides, number, code, command)


def mpi_command(launcher: DictConfig, job_file: Path, result_file: Path) -> list[str]:
    """The job's command line; `launcher` is the job's own `hydra.launcher`, so that `ranks`
    resolves against the job's config."""
    base = shlex.split(launcher.command) if launcher.command else [_default_mpiexec()]
    return [*base, launcher.nproc_flag, str(launcher.ranks), *(str(a) for a in launcher.args),
            sys.executable, "-m", RANK_MODULE, str(job_file), str(result_file)]


def _default_mpiexec() -> str:
    from runner.training.mpienv import bundled_mpiexec

    return bundled_mpiexec() or "mpiexec"


def rank_environment() -> dict[str, str]:
    """This process's environment without its own MPI identity (as for gridrun's ranks), and
    with its import path: the ranks import the task function's module and what it imports, the
    app's own directory included."""
    from runner.training.mpienv import child_environment

    env = child_environment()
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(os.path.abspath(p) for p in sys.path))
    return env


def _job_return(result_file: Path, overrides: list[str], number: int, code: int,
                command: list[str]) -> JobReturn:
    """Rank 0's JobReturn; a failed one, naming the exit code and the command, where there is
    none or where another rank failed after rank 0 completed."""
    where = f"(exit code {code}; command: {shlex.join(command)})"
    if not result_file.exists():
        return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=MPIJobFailed(
            f"job {number}: the MPI job ended before rank 0 returned a result {where}"))
    ret: JobReturn = cloudpickle.loads(result_file.read_bytes())
    if ret.status == JobStatus.COMPLETED and code != 0:
        return dataclasses.replace(ret, status=JobStatus.FAILED, _return_value=MPIJobFailed(
            f"job {number}: rank 0 completed, but another rank failed {where}"))
    return ret
