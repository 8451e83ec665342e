"""Shared helpers: run the real command line, read run directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import warm_ranks
from tests.heads import run_heads

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
# Generous: 4 ranks on 2 cores; a hang must still end the test rather than the CI job.
TIMEOUT_S = 240

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist gives its workers COLUMNS=80 and LINES=24, which the runs the tests start
    # would take for a terminal's width (a shell exports neither): their tables and lines are
    # checked as a run writes them to a file or pipe.
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

# The suite's slowest files (seconds on 2 cores, one file at a time), started first: with a
# file to a worker (`make test`), the workers then finish together rather than one waiting on
# the last long file.
SLOWEST_FIRST = ("test_mpi_checks.py", "test_cli_runs.py", "test_compile.py", "test_failures.py",
                 "test_bad_values.py", "test_hangs.py", "test_checkpoint.py",
                 "test_token_file.py", "test_user_code.py", "test_image_folder.py")


def run_module(module: str, *args: str, timeout: float = TIMEOUT_S,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` from the checkout (a forked head, `tests.heads`)."""
    return run_heads(module, [list(args)], ROOT, timeout, env)[0]


def run_cli(*args: str, mpi_ranks: int | None = None, timeout: float = TIMEOUT_S,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m runner ARGS` (a head forked with its imports done, `tests.heads`), or
    `mpiexec -n N python -m runner ARGS` (N ranks, forked warm: `tests.warm_ranks`)."""
    if mpi_ranks is None:
        return run_module("runner", *args, timeout=timeout, env=env)
    command = [MPIEXEC, "-n", str(mpi_ranks), warm_ranks.python(), "-m", "runner", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_cli_together(*jobs: list[str],
                     timeout: float = TIMEOUT_S) -> list[subprocess.CompletedProcess[str]]:
    """`python -m runner ARGS` for every job at once (independent runs: their start-ups
    overlap), waiting for all of them; a job still running when another times out is stopped."""
    return run_heads("runner", list(jobs), ROOT, timeout)


class RunCache:
    """Named runs, each launched once per session on first use (several tests read its
    directory): `runs[name]` is (overrides, ranks of a user-started mpiexec or None for the
    runner's own launch); `common` goes before every run's overrides."""

    def __init__(self, root: Path, runs: dict[str, tuple[list[str], int | None]],
                 common: list[str]) -> None:
        self.root, self.runs, self.common = root, runs, common
        self.results: dict[str, subprocess.CompletedProcess[str]] = {}

    def __call__(self, name: str) -> Path:
        run_dir = self.root / name
        if name not in self.results:
            overrides, mpi_ranks = self.runs[name]
            self.results[name] = run_cli(*self.common, *overrides, f"hydra.run.dir={run_dir}",
                                         mpi_ranks=mpi_ranks)
        assert_ok(self.results[name])
        return run_dir


def run_mpi_script(script: str, ranks: int, *args: str,
                   timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`mpiexec -n RANKS python SCRIPT ARGS`, through tests/mpi/start.py (start-up without
    the collector's repeated walks, as a gridrun rank's)."""
    return subprocess.run([MPIEXEC, "-n", str(ranks), warm_ranks.python(),
                           str(ROOT / "tests" / "mpi" / "start.py"), str(ROOT / script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def wait_until(condition: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Until `condition()` is true, polled every 10 ms: for a test that waits on another thread
    or process, rather than sleeping for a time it trusts to be enough. `timeout` is a safety
    net against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.01)


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "split" not in r]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first (`SLOWEST_FIRST`), each file's tests in their own order."""
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep the order they were collected in


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `fresh_ranks` (one of the process tree itself: who is killed when, what
    is left behind) starts its ranks as a launcher does without the suite: fresh interpreters,
    its module's fixtures too (set up with its first test, after this)."""
    warm_ranks.use_fresh_ranks(item.get_closest_marker("fresh_ranks") is not None)


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")
