"""`hydra/launcher=mpi` for a Hydra app other than gridrun: a tiny app of the test's own, whose
task uses mpi4py, run as real multiruns with real ranks. Every job is an MPI job of the size its
own config names; the launcher's list of results is observed through Hydra's Optuna sweeper,
which pairs each result with its trial by position. gridrun's own sweeps: test_cli_runs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import assert_ok

TIMEOUT_S = 90  # a hung job must end the test

APP = '''
import logging
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from mpi4py import MPI

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def task(cfg):
    comm = MPI.COMM_WORLD
    if cfg.die and comm.rank == 1:
        os._exit(3)  # before the collective: rank 0 is left waiting in it
    world = comm.allreduce(1)
    Path(HydraConfig.get().runtime.output_dir, f"rank{comm.rank}").write_text(str(world))
    log.info(f"world {world}")
    if cfg.fail:
        raise ValueError(f"n={cfg.n} fails on purpose")
    return 10.0 * world + 0.5


if __name__ == "__main__":
    task()
'''
CONFIG = "n: 1\nfail: false\ndie: false\n"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("app")
    (folder / "config.yaml").write_text(CONFIG)
    (folder / "app.py").write_text(APP)
    return folder / "app.py"


def run_app(app: Path, sweep: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """`python app.py -m hydra/launcher=mpi hydra.launcher.ranks=${n} OVERRIDES`, from the
    app's own folder."""
    command = [sys.executable, str(app), "-m", "hydra/launcher=mpi", "hydra.launcher.ranks=${n}",
               f"hydra.sweep.dir={sweep}", *overrides]
    return subprocess.run(command, cwd=app.parent, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def ranks_seen(job_dir: Path) -> dict[int, int]:
    """Each rank's world size, as the ranks wrote it into the job's output directory."""
    return {int(p.name.removeprefix("rank")): int(p.read_text()) for p in job_dir.glob("rank*")}


def test_each_job_is_an_mpi_job_of_the_size_its_config_names(app: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_app(app, sweep, "n=1,2")
    assert_ok(result)
    assert "Launching 2 jobs" in result.stdout and "#1 : n=2" in result.stdout
    for job, size in ((0, 1), (1, 2)):
        job_dir = sweep / str(job)
        # Every rank saw the job's size and the same output directory.
        assert ranks_seen(job_dir) == dict.fromkeys(range(size), size)
        assert yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) == [f"n={size}"]
        # The job's log is rank 0's alone: the other ranks neither write nor truncate it.
        assert (job_dir / "app.log").read_text().count(f"world {size}") == 1
    assert not (sweep / "sweep_summary.csv").exists()  # gridrun's sweep table is gridrun's
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml"]


def test_the_jobs_return_values_come_back_untouched_and_in_job_order(app: Path,
                                                                      tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    # Both trials in one launch: had the launcher changed their values or their order, n=1
    # would get 20.5, or the best value would not be the task's float.
    result = run_app(app, sweep, "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid",
                     "n=choice(1,2)", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2",
                     "hydra.sweeper.direction=maximize")
    assert_ok(result)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_params"] == {"n": 2} and best["best_value"] == 20.5
    assert ranks_seen(sweep / "0").keys() | ranks_seen(sweep / "1").keys() == {0, 1}


def test_a_job_whose_task_raises_fails_with_its_own_error(app: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = run_app(app, sweep, "n=2", "fail=true,false")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Error executing job with overrides: ['n=2', 'fail=True']" in result.stderr
    assert result.stderr.rstrip().endswith("ValueError: n=2 fails on purpose")
    assert "job 0, rank 1: the task raised" in result.stderr  # where, from the ranks
    assert ranks_seen(sweep / "1") == {0: 2, 1: 2}  # the next job still ran


def test_a_rank_that_dies_fails_its_job_naming_the_exit_code_and_command(app: Path,
                                                                         tmp_path: Path) -> None:
    result = run_app(app, tmp_path / "sweep", "n=2", "die=true")
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith("hydra_plugins.gridrun_launcher.app_jobs.MPIJobFailed: job 0: the MPI "
                           "job ended before rank 0 returned a result (exit code 3; command: ")
    assert " -n 2 " in last and "-m hydra_plugins.gridrun_launcher.app_rank " in last
