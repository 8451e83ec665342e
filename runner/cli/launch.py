"""How a run gets its processes (docs/design.md, "The way a run flows", step 3). No Hydra here.

- P = 1: train in this process (MPI is never initialised);
- already inside an MPI job of size P (`mpiexec -n P python -m runner`, `srun`): rank 0 leads,
  see `runner.training.rank`;
- otherwise: start `mpiexec -n P python -m runner.cli.worker RUN_DIR` and relay its output.

In the last case the head watches its job rather than just waiting for it (`runner.cli.mpijob`).
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.cli.mpijob import JobResult, MPIJob
from runner.cli.preflight import machine_problems
from runner.config.schema import ConfigError, LauncherConfig, RunConfig
from runner.records.rundir import (
    RunDir,
    RunDirInUse,
    earlier_records,
    lock_run_dir,
    release_run_dir,
    set_aside_earlier,
    write_json,
)
from runner.training.mpienv import bundled_mpiexec, child_environment


class RunFailed(RuntimeError):
    """The training job ended without completing (a rank failed, or the launcher did)."""


class RunInterrupted(RuntimeError):
    """The run stopped on request (SIGINT/SIGTERM); the message says what was kept and how to
    continue."""


def launcher_words(launcher: LauncherConfig) -> list[str]:
    """The launcher command as words: `launcher.command`, else the bundled mpiexec."""
    return launcher.argv or [bundled_mpiexec() or "mpiexec"]


def mpi_command(launcher: LauncherConfig, nprocs: int, run_dir: Path) -> list[str]:
    return [*launcher_words(launcher), launcher.nproc_flag, str(nprocs), *launcher.args,
            sys.executable, "-m", "runner.cli.worker", str(run_dir)]


def run_mpi_job(run: RunConfig, run_dir: Path) -> JobResult:
    """Start the ranks, relay their output (inherited stdout/stderr), watch them to the end."""
    return MPIJob(mpi_command(run.launcher, run.grid.size, run_dir), run_dir,
                  child_environment()).run()


def _failure_message(size: int, code: int, summary: dict[str, Any], logs: Path) -> str:
    rank, error = summary.get("failed_rank"), summary.get("error")
    names_rank = bool(error) and str(error).startswith(f"rank {rank} ")
    where = f" on rank {rank}" if rank is not None and not names_rank else ""
    return (f"the {size}-rank job failed{where} (exit code {code})"
            f"{f': {error}' if error else ''}; logs: {logs}")


def checked_run(cfg: DictConfig, run_dir: Path) -> RunConfig:
    """`cfg` validated, and the machine checked for it: `ConfigError` names every problem."""
    from runner.cli.validation import validate_parts

    run, parts = validate_parts(cfg)
    problems = machine_problems(run, parts, run_dir)
    if problems:
        raise ConfigError(problems)
    return run


def execute(cfg: DictConfig, run_dir: Path, run: RunConfig | None = None) -> dict[str, Any]:
    """The head's whole job for one run: write the run directory, train, summarise. `run` is
    `cfg` already validated (`checked_run`); without it, it is validated here.

    Raises `ConfigError` before anything is started, `RunFailed` when training failed, or
    `RunInterrupted` when it was stopped on request.
    """
    if run is None:
        run = checked_run(cfg, run_dir)
    try:
        lock_run_dir(run_dir)  # held already when the head's precheck took it
    except RunDirInUse as exc:
        raise ConfigError([str(exc)]) from None
    if run.trainer.resume is not None and earlier_records(run_dir):
        set_aside_earlier(run_dir, ("config.yaml", "summary.json"))  # a sweep job's resume
    try:
        return _execute(cfg, run, RunDir(run_dir))
    finally:
        release_run_dir(run_dir)


def _execute(cfg: DictConfig, run: RunConfig, directory: RunDir) -> dict[str, Any]:
    directory.create(cfg)
    # An earlier run's outcome in this directory (resumed, or rerun) is not this run's.
    directory.summary.unlink(missing_ok=True)
    if run.grid.size == 1:
        from runner.training.rank import run_rank

        try:
            run_rank(directory.path, mpi_comm=None)
        except Exception as exc:  # its traceback is printed and its summary written
            from runner.training.rank import describe_error

            # on a full disk no summary could be written: the error says it all
            failed = directory.read_summary() or {"status": "failed", "failed_rank": 0,
                                                  "error": describe_error(exc)}
            raise RunFailed(_failure_message(1, 1, failed, directory.logs)) from None
        outcome = directory.read_summary()
        assert outcome is not None
        if outcome.get("status") == "interrupted":
            raise RunInterrupted(outcome["message"])
        return outcome
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
        with contextlib.suppress(OSError):  # a full disk: the message still says it all
            write_json(directory.summary, {"status": "interrupted", "message": message,
                                           "checkpoint": None, "resume_command": None,
                                           "exit_code": code, "run_dir": str(directory.path)})
        raise RunInterrupted(message)
    if summary is None or summary.get("status") != "failed":
        # No rank could say what happened (or rank 0 had finished, and one died after it):
        # what the head saw.
        failed = {"status": "failed", "exit_code": code, **(result.failure or {}),
                  "run_dir": str(directory.path)}
        if "error" not in failed and not any(directory.logs.glob("rank*.log")):
            launcher = shlex.join([*launcher_words(run.launcher), *run.launcher.args])
            failed["error"] = (f"the launcher ({launcher}) exited with code {code} before any "
                               f"rank started (its own output, if any, is above): check "
                               f"launcher.command and launcher.args")
        if result.killed:
            failed["error"] = f"{failed.get('error', 'a rank failed')}; {result.killed}"
        if summary is None:
            with contextlib.suppress(OSError):  # a full disk: the message still says it all
                write_json(directory.summary, failed)
        summary = failed
    raise RunFailed(_failure_message(run.grid.size, code, summary, directory.logs))
