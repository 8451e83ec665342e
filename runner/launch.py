"""How a run gets its processes (DESIGN.md, "The way a run flows", step 3). No Hydra here.

- P = 1: train in this process (MPI is never initialised);
- already inside an MPI job of size P (`mpiexec -n P python -m runner`, `srun`): rank 0 leads,
  see `runner.worker`;
- otherwise: start `mpiexec -n P python -m runner.worker RUN_DIR` and relay its output.

In the last case the head watches its job rather than just waiting for it (`runner.mpijob`).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.config import ConfigError, LauncherConfig, RunConfig, validate
from runner.console import FORCE_TERMINAL_ENV
from runner.mpijob import JobResult, MPIJob
from runner.rundir import RunDir, write_json
from runner.worker import MPIEnvironment, detect_mpi_environment

__all__ = ["MPIEnvironment", "RunFailed", "RunInterrupted", "detect_mpi_environment",
           "execute", "run_mpi_job"]

_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "HYDRA_", "MPI_LOCAL")


class RunFailed(RuntimeError):
    """The training job ended without completing (a rank failed, or the launcher did)."""


class RunInterrupted(RuntimeError):
    """The run stopped on request (SIGINT/SIGTERM); the message says what was kept and how to
    continue."""


def bundled_mpiexec() -> str | None:
    """The mpiexec installed beside this Python (the `mpich` wheel), else one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def mpi_command(launcher: LauncherConfig, nprocs: int, run_dir: Path) -> list[str]:
    base = list(launcher.command) or [bundled_mpiexec() or "mpiexec"]
    return [*base, launcher.nproc_flag, str(nprocs), *launcher.args,
            sys.executable, "-m", "runner.worker", str(run_dir)]


def check_launcher(launcher: LauncherConfig) -> list[str]:
    command = launcher.command[0] if launcher.command else bundled_mpiexec()
    if command is None:
        return ["no mpiexec found: install the bundled MPI (pip install mpich) or set "
                "launcher.command to your site's launcher"]
    if shutil.which(command) is None:
        return [f"launcher.command={command}: not found or not executable"]
    return []


def _child_environment() -> dict[str, str]:
    # A head that is itself a singleton MPI process must not hand its PMI identity to the job.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"  # relay rank output as it comes
    if sys.stdout.isatty():
        env[FORCE_TERMINAL_ENV] = "1"
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    return env


def run_mpi_job(run: RunConfig, run_dir: Path) -> JobResult:
    """Start the ranks, relay their output (inherited stdout/stderr), watch them to the end."""
    return MPIJob(mpi_command(run.launcher, run.grid.size, run_dir), run_dir,
                  _child_environment()).run()


def _failure_message(size: int, code: int, summary: dict[str, Any], logs: Path) -> str:
    rank, error = summary.get("failed_rank"), summary.get("error")
    names_rank = bool(error) and str(error).startswith(f"rank {rank} ")
    where = f" on rank {rank}" if rank is not None and not names_rank else ""
    return (f"the {size}-rank job failed{where} (exit code {code})"
            f"{f': {error}' if error else ''}; logs: {logs}")


def execute(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """The head's whole job for one run: validate, write the run directory, train, summarise.

    Raises `ConfigError` before anything is started, `RunFailed` when training failed, or
    `RunInterrupted` when it was stopped on request.
    """
    run = validate(cfg)
    if run.grid.size > 1:
        problems = check_launcher(run.launcher)
        if problems:
            raise ConfigError(problems)
    directory = RunDir(run_dir)
    directory.create(cfg)
    # An earlier run's outcome in this directory (resumed, or rerun) is not this run's.
    directory.summary.unlink(missing_ok=True)
    if run.grid.size == 1:
        from runner.worker import run_rank

        try:
            run_rank(directory.path, mpi_comm=None)
        except Exception:  # its traceback is printed and its summary written
            summary = directory.read_summary() or {"status": "failed"}
            raise RunFailed(_failure_message(1, 1, summary, directory.logs)) from None
        summary = directory.read_summary()
        assert summary is not None
        if summary.get("status") == "interrupted":
            raise RunInterrupted(summary["message"])
        return summary
    result = run_mpi_job(run, directory.path)
    code = result.exit_code
    summary = directory.read_summary()
    if summary is not None and summary.get("status") == "interrupted":
        raise RunInterrupted(summary["message"])
    if code == 0 and summary is not None and summary.get("status") == "completed":
        return summary
    if result.stop_signal is not None and (summary is None or result.killed):
        # Stopped on request before the ranks could write their checkpoint (a second signal,
        # or the first came while they were still starting).
        how = result.killed or f"ended by {result.stop_signal} before its ranks could stop cleanly"
        message = (f"the {run.grid.size}-rank job was {how}: no checkpoint was written for this "
                   f"stop; logs: {directory.logs}")
        write_json(directory.summary, {"status": "interrupted", "message": message,
                                       "checkpoint": None, "resume_command": None,
                                       "exit_code": code, "run_dir": str(directory.path)})
        raise RunInterrupted(message)
    if summary is None or summary.get("status") != "failed":
        # No rank could say what happened (or rank 0 had finished, and one died after it):
        # what the head saw.
        failed = {"status": "failed", "exit_code": code, **(result.failure or {}),
                  "run_dir": str(directory.path)}
        if result.killed:
            failed["error"] = f"{failed.get('error', 'a rank failed')}; {result.killed}"
        if summary is None:
            write_json(directory.summary, failed)
        summary = failed
    raise RunFailed(_failure_message(run.grid.size, code, summary, directory.logs))
