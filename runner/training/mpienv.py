"""Whether this process is one rank of an MPI job, told from the launcher's environment
variables alone: looking must not initialise MPI (in a head process, or in a rank's supervisor,
which forks before MPI is initialised). And the other side: the mpiexec a job is started with,
and the environment its ranks get. No torch, no mpi4py: the MPI launcher imports this for any
Hydra app.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from runner.records.console import FORCE_TERMINAL_ENV

# Variables that give a process its identity in an MPI job (or the launcher's own).
_LAUNCHER_ENV_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MV2_", "HYDRA_", "MPI_LOCAL")


def bundled_mpiexec() -> str | None:
    """The mpiexec installed beside this Python (the `mpich` wheel), else one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def child_environment() -> dict[str, str]:
    """This process's environment for the ranks of a job it starts."""
    # A head that is itself a singleton MPI process must not hand its PMI identity to the job.
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"  # relay rank output as it comes
    if sys.stdout.isatty():
        env[FORCE_TERMINAL_ENV] = "1"
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    return env


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
