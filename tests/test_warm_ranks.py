"""The suite's warm ranks (`tests.warm_ranks`) are what a launcher's fresh interpreters would be:
the same standing, the same end, signals passed on, nothing left when the stub is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm_ranks
from tests.conftest import MPIEXEC, ROOT, wait_until

pytestmark = pytest.mark.skipif(warm_ranks.FRESH_RANKS, reason="no warm ranks in this session")

SHOW = """
import json, os, sys
import torch
from mpi4py import MPI
umask = os.umask(0)
rank = MPI.COMM_WORLD.Get_rank()
with open(f"{sys.argv[2]}-{rank}.json", "w") as file:
    json.dump({"rank": rank, "size": MPI.COMM_WORLD.Get_size(),
                  "threads": torch.get_num_threads(), "cwd": os.getcwd(), "argv": sys.argv,
                  "path0": sys.path[0], "umask": umask, "env": os.environ.get("WARM_PROBE"),
                  "main": __name__, "affinity": sorted(os.sched_getaffinity(0)),
                  "session_leader": os.getsid(0) == os.getpid()}, file)
sys.exit(int(sys.argv[1]))
"""


def _both(command: list[str], cwd: Path,
          env: dict[str, str]) -> list[subprocess.CompletedProcess[str]]:
    """`command` with the warm stub, then with the real interpreter, where `{python}` stands."""
    results = []
    for python in (warm_ranks.python(), sys.executable):
        words = [python if word == "{python}" else word for word in command]
        results.append(subprocess.run(words, cwd=cwd, env={**os.environ, **env},
                                      capture_output=True, text=True, timeout=120))
    return results


def test_the_suite_s_ranks_are_warm() -> None:
    """The server started (the comparisons below would otherwise be of fresh with fresh)."""
    assert warm_ranks.python() != sys.executable, "the warm rank server did not start"


def test_a_warm_rank_has_a_fresh_ones_standing_and_exit(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(SHOW)
    shown, codes = [], []
    for python in (warm_ranks.python(), sys.executable):
        out = tmp_path / ("warm" if python != sys.executable else "fresh")
        result = subprocess.run([MPIEXEC, "-n", "2", python, str(script), "3", str(out)],
                                cwd=tmp_path, env={**os.environ, "WARM_PROBE": "here"},
                                capture_output=True, text=True, timeout=120)
        codes.append(result.returncode)
        shown.append([json.loads(Path(f"{out}-{rank}.json").read_text()) for rank in (0, 1)])
    warm, fresh = shown
    assert codes[0] == codes[1] == 3  # both ranks exited with 3
    for rank in (0, 1):
        assert warm[rank]["argv"][-1].endswith("warm")
        warm[rank]["argv"][-1] = fresh[rank]["argv"][-1]
    assert warm == fresh


def test_a_module_runs_as_with_dash_m(tmp_path: Path) -> None:
    warm, fresh = _both(["{python}", "-m", "runner.export", "--help"], ROOT, {})
    assert warm.returncode == fresh.returncode == 0
    assert warm.stdout == fresh.stdout and warm.stderr == fresh.stderr == ""


@pytest.mark.parametrize("how", ["signal", "exit"])
def test_a_warm_rank_ends_as_it_ended(how: str, tmp_path: Path) -> None:
    script = tmp_path / "end.py"
    script.write_text("import os, signal\n" + (
        "os.kill(os.getpid(), signal.SIGKILL)\n" if how == "signal" else "os._exit(7)\n"))
    warm, fresh = _both(["{python}", str(script)], tmp_path, {})
    assert warm.returncode == fresh.returncode == (-signal.SIGKILL if how == "signal" else 7)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_signals_reach_a_warm_rank_and_killing_its_stub_ends_it(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[2], 'w').close(), os._exit(0)))\n"
        "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "while True:\n    time.sleep(0.05)\n")
    pid_file, stopped = tmp_path / "pid", tmp_path / "stopped"
    stub = subprocess.Popen([warm_ranks.python(), str(script), str(pid_file), str(stopped)])
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the warm rank's start")
    stub.send_signal(signal.SIGTERM)
    assert stub.wait(60) == 0 and stopped.exists()

    pid_file.unlink()
    stub = subprocess.Popen([warm_ranks.python(), str(script), str(pid_file), str(stopped)])
    wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the warm rank's start")
    pid = int(pid_file.read_text())
    assert pid != stub.pid and _alive(pid)
    stub.kill()
    stub.wait(60)
    wait_until(lambda: not _alive(pid), "the warm rank's end after its stub was killed")
