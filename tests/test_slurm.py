"""Runs on a real single-node Slurm (`tests/slurm_cluster.py`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_cluster


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    with slurm_cluster() as cluster:
        yield cluster


def test_the_cluster_starts_the_mpich_wheels_ranks_under_srun(slurm: SlurmCluster,
                                                            tmp_path: Path) -> None:
    """`srun --mpi=pmi2` gives the bundled MPICH's ranks their size (what `launcher=slurm`'s
    batch scripts rely on)."""
    script = tmp_path / "size.py"
    script.write_text("from mpi4py import MPI\nprint(MPI.COMM_WORLD.Get_size())\n")
    result = slurm.run("srun", "--mpi=pmi2", "-n", "2", sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "2"]
