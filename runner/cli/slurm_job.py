"""`python -m runner.cli.slurm_job RUN_DIR SRUN_COMMAND...`: the run's side inside its Slurm
batch job (the batch script `runner.cli.slurm` writes runs it).

It holds the run directory's lock while the job runs (the head released it once the job was
submitted; a later start of the same job takes over the lock an earlier start left), goes on
from the run's newest checkpoint when Slurm starts the job again (a requeue), starts the ranks
with the srun command it was given and watches them as the head watches an MPI job
(`runner.cli.mpijob`: a stop it is asked for goes to srun as SIGUSR1), and records the job in
the run's `summary.json` (`slurm`: the job id and how many times it was requeued). Its exit code
tells the batch script what to do next: `REQUEUE_EXIT` when the ranks stopped on Slurm's warning
signal and wrote their checkpoint, so that the job is requeued and the run goes on.

Light imports only (no torch): the ranks import it, this process only waits for them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.cli.mpijob import MPIJob
    from runner.records.rundir import RunDir

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM)
LOCK_WAIT_S = 30.0  # the head releases the lock right after sbatch returns: wait that long
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

_noted: str | None = None  # a stop asked for before the ranks' job existed
_job: MPIJob | None = None  # then the job, which relays it to the ranks


def _note(signum: int, frame: FrameType | None) -> None:
    global _noted
    if _job is not None:
        _job.on_signal(signum, frame)
    else:
        _noted = _noted or signal.Signals(signum).name


def _lock(run_dir: Path) -> str | None:
    """Take the run directory's lock (waiting for the head to let go of it); why not."""
    from runner.records.rundir import RunDirInUse, lock_run_dir

    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            lock_run_dir(run_dir)
            return None
        except RunDirInUse as exc:
            if time.monotonic() > deadline:
                return str(exc)
        time.sleep(0.2)


def _resume_own_checkpoints(run_dir: Path, restarts: int) -> None:
    """A job Slurm started again goes on from the run's own newest checkpoint, whatever
    `trainer.resume` its first start had (null, or another run's checkpoint)."""
    from omegaconf import OmegaConf

    from runner.checkpoint.layout import latest_checkpoint
    from runner.records.rundir import RunDir, atomic_write_text

    directory = RunDir(run_dir)
    if restarts == 0 or latest_checkpoint(directory.checkpoints) is None:
        return
    config = OmegaConf.load(directory.config)
    if OmegaConf.select(config, "trainer.resume") != "auto":
        OmegaConf.update(config, "trainer.resume", "auto")
        atomic_write_text(directory.config, OmegaConf.to_yaml(config))


def _newest_step(run_dir: Path) -> int:
    """The step of the run's newest complete checkpoint (0: none)."""
    from runner.checkpoint.layout import STEP_PREFIX, latest_checkpoint
    from runner.records.rundir import RunDir

    newest = latest_checkpoint(RunDir(run_dir).checkpoints)
    return int(newest.name.removeprefix(STEP_PREFIX)) if newest is not None else 0


def _no_progress(run_dir: Path, started_at: int) -> str | None:
    """Why a start that stopped on Slurm's warning must not requeue the job: it kept no step
    beyond where it began (the warning came before it could train: the next start, with the
    same time limit, would do no better)."""
    if _newest_step(run_dir) > started_at:
        return None
    return (f"Slurm's warning came before this start of the job kept a step beyond step "
            f"{started_at}: not requeued (launcher.slurm.time leaves too little time after "
            f"launcher.slurm.signal_s; Slurm may send the warning up to a minute early)")


def _not_requeued(directory: RunDir, why: str | None) -> None:
    """Say why the job is not requeued, in its output and in the run's summary (where the
    head reads it)."""
    if why is None:
        return
    print(f"error: {why}", file=sys.stderr, flush=True)
    summary = directory.read_summary()
    if summary is not None and summary.get("message"):
        from runner.records.rundir import write_json

        summary["message"] = f"{summary['message']}; {why}"
        with contextlib.suppress(OSError):
            write_json(directory.summary, summary)


def _record_job(run_dir: Path, job_id: str | None, restarts: int) -> None:
    """The job in the run's summary: which one, and how many times it was requeued."""
    from runner.records.rundir import RunDir, write_json

    directory = RunDir(run_dir)
    summary = directory.read_summary()
    if summary is None:
        return
    summary["slurm"] = {"job_id": job_id, "requeued": restarts}
    with contextlib.suppress(OSError):
        write_json(directory.summary, summary)


def run_job(run_dir: Path, srun: list[str]) -> int:
    """The job's whole work; its exit code for the batch script."""
    global _job
    from runner.cli.launch import RunFailed, RunInterrupted, job_outcome
    from runner.cli.mpijob import MPIJob
    from runner.cli.slurm import REQUEUE_EXIT, WARNING_SIGNAL
    from runner.config.schema import load_run_config
    from runner.records.rundir import RunDir, release_run_dir, write_json
    from runner.training.mpienv import child_environment

    job_id = os.environ.get("SLURM_JOB_ID")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    warning = f"SIG{WARNING_SIGNAL}"
    directory = RunDir(run_dir)
    problem = _lock(run_dir)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    try:
        _resume_own_checkpoints(run_dir, restarts)
        run = load_run_config(directory.config)
        directory.summary.unlink(missing_ok=True)  # an earlier start's outcome
        started_at = _newest_step(run_dir)
        _job = MPIJob(srun, run_dir, child_environment(), relay=signal.SIGUSR1,
                      second_kills=False)
        if _noted is not None:
            print(f"slurm job {job_id}: {_noted} before the ranks started: not starting them",
                  file=sys.stderr, flush=True)
            _write_stopped(directory, _noted, job_id)
            if _noted == warning:
                _not_requeued(directory, _no_progress(run_dir, started_at))
                return EXIT_FAILED
            return EXIT_INTERRUPTED
        print(f"slurm job {job_id}, start {restarts + 1}: {' '.join(srun)}", flush=True)
        result = _job.run()
        try:
            job_outcome(run, directory, result)
            code = 0
        except RunInterrupted as exc:
            print(str(exc), file=sys.stderr, flush=True)
            code = EXIT_INTERRUPTED
            if result.stop_signal == warning:
                stuck = _no_progress(run_dir, started_at)
                _not_requeued(directory, stuck)
                code = REQUEUE_EXIT if stuck is None else EXIT_FAILED
        except RunFailed as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            code = EXIT_FAILED
        _record_job(run_dir, job_id, restarts)
        return code
    except Exception as exc:  # the job's output is where this is read: its traceback follows
        with contextlib.suppress(OSError):
            write_json(directory.summary, {"status": "failed", "error": str(exc),
                                           "run_dir": str(run_dir)})
        raise
    finally:
        release_run_dir(run_dir)


def _write_stopped(directory: RunDir, name: str, job_id: str | None) -> None:
    """The summary of a job stopped before its ranks started (no checkpoint of this start)."""
    from runner.checkpoint.resume import resume_command
    from runner.records.rundir import write_json

    message = (f"slurm job {job_id} was stopped by {name} before its ranks started; to go on: "
               f"{resume_command(directory.path)}")
    with contextlib.suppress(OSError):
        write_json(directory.summary, {"status": "interrupted", "message": message,
                                       "signal": name, "checkpoint": None,
                                       "run_dir": str(directory.path)})


def main(argv: list[str]) -> int:
    for signum in STOP_SIGNALS:  # first, so that none ends this process before it can stop
        signal.signal(signum, _note)
    if len(argv) < 3:
        print("usage: python -m runner.cli.slurm_job RUN_DIR SRUN_COMMAND...", file=sys.stderr)
        return 2
    return run_job(Path(argv[1]), argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
