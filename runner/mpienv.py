"""Whether this process is one rank of an MPI job, told from the launcher's environment
variables alone: looking must not initialise MPI (in a head process, or in a rank's supervisor,
which forks before MPI is initialised)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


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
