"""How a run gets its processes (docs/design.md, "The way a run flows", step 3). No Hydra here.

- `launcher=slurm`: submit a batch job that starts the ranks with srun, and wait for it
  (`runner.cli.slurm`; inside the job, `runner.cli.slurm_job`);
- P = 1: train in this process (MPI is never initialised);
- already inside an MPI job of size P (`mpiexec -n P python -m runner`, `srun`): rank 0 leads,
  see `runner.training.rank`;
- otherwise: start `mpiexec -n P python -m runner.cli.worker RUN_DIR` and relay its output.

In the last case the head watches its job rather than just waiting for it (`runner.cli.mpijob`).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.cli import slurm
from runner.cli.mpijob import JobResult, MPIJob
from runner.config.schema import ConfigError, LauncherConfig, RunConfig
from runner.records import safe_paths
from runner.records.console import make_console, summary_table
from runner.records.process import start_up_done
from runner.records.rundir import (
    RunDir,
    RunDirInUse,
    earlier_records,
    lock_run_dir,
    release_run_dir,
    set_aside_earlier,
    write_json,
)
from runner.records.safe_paths import PathRefused
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
    """Start the ranks, relay their output (inherited stdout/stderr), watch them to the end.
    A stop goes to srun as SIGUSR1 (on a SIGTERM of its own it kills the ranks at once)."""
    command = mpi_command(run.launcher, run.grid.size, run_dir)
    relay = signal.SIGUSR1 if Path(command[0]).name == "srun" else signal.SIGTERM
    return MPIJob(command, run_dir, child_environment(), relay=relay).run()


def launcher_hint(run: RunConfig) -> tuple[str, str]:
    """The launcher as shown, and where to look when it ended before any rank started."""
    if run.launcher.slurm is not None:
        return f"srun --mpi={run.launcher.slurm.mpi}", "check launcher.slurm.mpi"
    launcher = shlex.join([*launcher_words(run.launcher), *run.launcher.args])
    return launcher, "check launcher.command and launcher.args"


def _failure_message(size: int, code: int, summary: dict[str, Any], logs: Path) -> str:
    rank, error = summary.get("failed_rank"), summary.get("error")
    names_rank = bool(error) and str(error).startswith(f"rank {rank} ")
    where = f" on rank {rank}" if rank is not None and not names_rank else ""
    return (f"the {size}-rank job failed{where} (exit code {code})"
            f"{f': {error}' if error else ''}; logs: {logs}")


def checked_run(cfg: DictConfig, run_dir: Path) -> RunConfig:
    """`cfg` validated, and the machine checked for it: `ConfigError` names every problem."""
    from runner.cli.preflight import machine_problems
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
    if print_dry_run(run, run_dir):
        return {"status": "dry_run", "run_dir": str(run_dir)}
    try:
        lock_run_dir(run_dir)  # held already when the head's precheck took it
    except RunDirInUse as exc:
        raise ConfigError([str(exc)]) from None
    if run.trainer.resume is not None and earlier_records(run_dir):
        set_aside_earlier(run_dir, ("config.yaml", "summary.json"))  # a sweep job's resume
    try:
        if run.launcher.slurm is not None:
            return _execute_slurm(cfg, run, RunDir(run_dir))
        return _execute(cfg, run, RunDir(run_dir))
    finally:
        release_run_dir(run_dir)


def _create(directory: RunDir, cfg: DictConfig) -> None:
    """The run directory and its config written, and an earlier run's outcome in it (resumed,
    or rerun) removed: it is not this run's. A link where they go: `ConfigError` naming it."""
    try:
        directory.create(cfg)
        safe_paths.remove(directory.path, "summary.json")
    except PathRefused as exc:
        raise ConfigError([str(exc)]) from None


def _execute(cfg: DictConfig, run: RunConfig, directory: RunDir) -> dict[str, Any]:
    _create(directory, cfg)
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
    start_up_done()  # from here the head watches the ranks
    return job_outcome(run, directory, run_mpi_job(run, directory.path))


def job_outcome(run: RunConfig, directory: RunDir, result: JobResult) -> dict[str, Any]:
    """The outcome of the ranks' job: the completed run's summary, or `RunInterrupted` (the
    ranks stopped on request: a checkpoint, or none where they could not) or `RunFailed` (in
    the words of the rank that failed first, else what the head saw), written to
    `summary.json` where no rank could."""
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
            launcher, hint = launcher_hint(run)
            failed["error"] = (f"the launcher ({launcher}) exited with code {code} before any "
                               f"rank started (its own output, if any, is above): {hint}")
        if result.killed:
            failed["error"] = f"{failed.get('error', 'a rank failed')}; {result.killed}"
        if summary is None:
            with contextlib.suppress(OSError):  # a full disk: the message still says it all
                write_json(directory.summary, failed)
        summary = failed
    raise RunFailed(_failure_message(run.grid.size, code, summary, directory.logs))


# -- launcher=slurm: a batch job -------------------------------------------------------------

def print_dry_run(run: RunConfig, run_dir: Path, label: str = "") -> bool:
    """Under `launcher.slurm.dry_run`: print the job's batch script and the sbatch command
    that would submit it (and do nothing else)."""
    if run.launcher.slurm is None or not run.launcher.slurm.dry_run:
        return False
    print(slurm.dry_run_text(run, run_dir, label), end="", flush=True)
    return True


def submit_slurm(cfg: DictConfig, run: RunConfig, directory: RunDir) -> str:
    """Write the run directory and its batch script, and submit it: the job id. `RunFailed`
    quotes sbatch where it refused."""
    _create(directory, cfg)
    script = slurm.write_batch_script(run, directory.path)
    try:
        job_id = slurm.submit(script)
    except slurm.SlurmError as exc:
        raise RunFailed(str(exc)) from None
    slurm.write_job_record(directory.path, job_id)
    return job_id


def submit_checked(cfg: DictConfig, run_dir: Path) -> tuple[RunConfig, str | None]:
    """A sweep job's submission (`hydra/launcher=slurm`): `cfg` validated and checked, its run
    directory and batch script written and submitted (`submit_slurm`); its job id (None: a dry
    run, printed). `ConfigError` before anything is written."""
    run = checked_run(cfg, run_dir)
    if run.launcher.slurm is None:
        raise ConfigError(["hydra/launcher=slurm submits every job as a batch job: drop "
                           "launcher= from the sweep (launcher=slurm is then implied)"])
    if print_dry_run(run, run_dir, f"job {run_dir.name}"):
        return run, None
    try:
        lock_run_dir(run_dir)
    except RunDirInUse as exc:
        raise ConfigError([str(exc)]) from None
    try:
        if run.trainer.resume is not None and earlier_records(run_dir):
            set_aside_earlier(run_dir, ("config.yaml", "summary.json"))
        return run, submit_slurm(cfg, run, RunDir(run_dir))
    finally:
        release_run_dir(run_dir)  # the job takes it when it starts (runner.cli.slurm_job)


def _execute_slurm(cfg: DictConfig, run: RunConfig, directory: RunDir) -> dict[str, Any]:
    """Submit the run's batch job, show its state while it runs, and return its summary."""
    start_up_done()  # from here the head watches the job
    job_id = submit_slurm(cfg, run, directory)
    release_run_dir(directory.path)  # the job holds it while it runs (runner.cli.slurm_job)
    console = make_console()
    console.print(f"slurm job {job_id}: {run.grid.size} rank(s), batch script "
                  f"{directory.path / slurm.BATCH_SCRIPT}, output "
                  f"{directory.path / slurm.OUTPUT_NAME.replace('%j', job_id)}")
    job = slurm.WatchedJob("run", job_id, directory.path)
    slurm.JobWatch([job], slurm.options_of(run).poll_s, console).wait()
    summary = slurm_outcome(run, job)
    console.print(summary_table(summary))
    return summary


def slurm_outcome(run: RunConfig, job: slurm.WatchedJob) -> dict[str, Any]:
    """An ended job's run: its summary when it completed, else `RunInterrupted` (stopped with
    a checkpoint, or cancelled) or `RunFailed`, with Slurm's last word on it."""
    directory = RunDir(job.run_dir)
    summary = directory.read_summary()
    state = job.state.shown() if job.state is not None else "gone"
    if summary is not None and summary.get("status") == "completed":
        return summary
    if summary is not None and summary.get("status") == "interrupted":
        raise RunInterrupted(f"slurm job {job.job_id}: {summary['message']}")
    if job.state is not None and job.state.state == "CANCELLED" and summary is None:
        raise RunInterrupted(f"slurm job {job.job_id} was cancelled before its run wrote a "
                             f"checkpoint; output: {job.run_dir}")
    error = (summary or {}).get("error")
    said = slurm.output_tail(job.run_dir, job.job_id)
    why = f": {error}" if error else (f"; its output ends: {said}" if said else "")
    raise RunFailed(f"slurm job {job.job_id} {state} ({run.grid.size} rank(s)){why}; logs: "
                    f"{directory.logs}, output: "
                    f"{job.run_dir / slurm.OUTPUT_NAME.replace('%j', job.job_id)}")
