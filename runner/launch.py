"""How a run gets its processes (DESIGN.md, "The way a run flows", step 3). No Hydra here.

- P = 1: train in this process (MPI is never initialised);
- already inside an MPI job of size P (`mpiexec -n P python -m runner`, `srun`): rank 0 leads,
  see `runner.worker`;
- otherwise: start `mpiexec -n P python -m runner.worker RUN_DIR` and relay its output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.config import ConfigError, LauncherConfig, RunConfig, validate
from runner.console import FORCE_TERMINAL_ENV
from runner.rundir import RunDir, write_json


class RunFailed(RuntimeError):
    """The training job ended without completing (a rank failed, or the launcher did)."""


@dataclass(frozen=True)
class MPIEnvironment:
    rank: int
    size: int
    source: str


# (rank variable, size variable, who sets them). Checked without importing mpi4py, so that
# merely looking does not initialise MPI in a head process.
_MPI_ENV_VARS = (
    ("PMI_RANK", "PMI_SIZE", "MPICH/Intel MPI"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MVAPICH2"),
    ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "srun"),
)
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "HYDRA_", "MPI_LOCAL")


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


def run_mpi_job(run: RunConfig, run_dir: Path) -> int:
    """Start the ranks, relay their output (inherited stdout/stderr), return the exit code."""
    command = mpi_command(run.launcher, run.grid.size, run_dir)
    process = subprocess.Popen(command, env=_child_environment())
    try:
        return process.wait()
    except KeyboardInterrupt:
        # The terminal sent SIGINT to the whole process group; give the job a moment to stop.
        try:
            return process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
            raise


def execute(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """The head's whole job for one run: validate, write the run directory, train, summarise.

    Raises `ConfigError` before anything is started, or `RunFailed` when training failed.
    """
    run = validate(cfg)
    if run.grid.size > 1:
        problems = check_launcher(run.launcher)
        if problems:
            raise ConfigError(problems)
    directory = RunDir(run_dir)
    directory.create(cfg)
    if run.grid.size == 1:
        from runner.worker import run_rank

        run_rank(directory.path, mpi_comm=None)
        summary = directory.read_summary()
        assert summary is not None
        return summary
    code = run_mpi_job(run, directory.path)
    summary = directory.read_summary()
    if code != 0 or summary is None or summary.get("status") != "completed":
        if summary is None:
            summary = {"status": "failed", "exit_code": code, "run_dir": str(directory.path)}
            write_json(directory.summary, summary)
        where = f" on rank {summary['failed_rank']}" if "failed_rank" in summary else ""
        error = f": {summary['error']}" if summary.get("error") else ""
        raise RunFailed(f"the {run.grid.size}-rank job failed{where} (exit code {code}){error}; "
                        f"logs: {directory.logs}")
    return summary
