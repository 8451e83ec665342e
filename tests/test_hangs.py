"""A hang, or the user's code ending a rank or leaving processes behind, ends the whole job
promptly, in one line, with nothing of the job left running. Real ranks through the real command
line, with a user's model (`Misbehaving`, below) that misbehaves on one rank once it has trained a
few steps: it sleeps, holds the GIL in a C call, forks a child that leaves its session, exits, or
starts a helper that outlives it. The head owns the end (`runner.cli.mpijob`): tested also alone,
under a launcher of the test's own that never ends by itself.

Times are measured from the command's start to its end, which includes the ranks' start-up:
the bound (60 s) is loose on purpose; `trainer.comm_timeout_s` is short so that it holds.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.cli.mpijob import KILL_GRACE_S, MPIJob
from runner.records.process import alive
from runner.records.rundir import held_by_live_run
from tests.conftest import read_summary, run_cli_together
from tests.test_failures import job_processes

# The process tree itself (who is killed when, what is left behind): fresh interpreters
# as ranks, as a launcher starts them without the suite (tests.warm_ranks).
pytestmark = pytest.mark.fresh_ranks

COMM_TIMEOUT_S = 8
BOUND_S = 60.0  # from the command's start to the job's end, start-up included
SMALL = ["strategy=data", "grid.pr=1", "trainer.batch_size=16", "trainer.eval_every=null",
         "dataset=synthetic", "dataset.shape=[8]", "dataset.samples=256",
         f"trainer.comm_timeout_s={COMM_TIMEOUT_S}"]
TWO_RANKS = [*SMALL, "grid.pc=2", "trainer.steps=30"]
MODEL = "model._target_=tests.test_hangs.Misbehaving"
HERE = "tests/test_hangs.py"


# -- the user's model ------------------------------------------------------------------------------

def _rank() -> int | None:
    """This process's rank in an MPI job (None: the head, which builds the model to validate)."""
    rank = os.environ.get("PMI_RANK")
    return None if rank is None else int(rank)


def _note_pid(pidfile: str, pid: int) -> None:
    with open(pidfile, "a") as file:
        file.write(f"{pid}\n")


class Misbehaving(nn.Module):
    """A linear model whose rank `on` (0 in a 1-process run) does `act` in its forward once it
    has trained `after` steps (backward passes: never while the head validates it). `pidfile`
    gets the pid of every process it starts."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, act: str = "sleep",
                 on: int = 1, after: int = 3, pidfile: str = "") -> None:
        super().__init__()
        if act == "exit-in-init" and _rank() == on:
            sys.exit(5)
        self.linear = nn.Linear(input_shape[0], num_classes)
        self.act, self.on, self.after, self.pidfile = act, on, after, pidfile
        self.steps = 0
        self.helper_started = False

    def _stepped(self, grad: torch.Tensor) -> None:
        self.steps += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.steps >= self.after and (_rank() or 0) == self.on:
            self.misbehave()
        out = self.linear(x)
        if out.requires_grad:
            out.register_hook(self._stepped)
        return out

    def misbehave(self) -> None:
        if self.act == "sleep":
            time.sleep(600)
        elif self.act == "hold-the-gil":
            ctypes.PyDLL(None).sleep(600)  # a C call that keeps the GIL: no thread of it runs
        elif self.act == "fork-and-sleep":
            child = os.fork()
            if child == 0:  # leaves the rank's session and group, and never exits
                os.setsid()
                while True:
                    time.sleep(1)
            _note_pid(self.pidfile, child)
            time.sleep(600)
        elif self.act == "os-exit-0":
            os._exit(0)
        elif self.act == "c-exit-0":
            ctypes.CDLL(None)._exit(0)  # past Python altogether
        elif self.act in ("helper", "helper-then-os-exit-0") and not self.helper_started:
            self.helper_started = True
            helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                      start_new_session=True)
            _note_pid(self.pidfile, helper.pid)
            if self.act == "helper-then-os-exit-0":
                self.act, self.after = "os-exit-0", self.after + 2  # two steps later


# -- checks ----------------------------------------------------------------------------------------

def pids_in(pidfile: Path) -> list[int]:
    return [int(line) for line in pidfile.read_text().split()] if pidfile.exists() else []


def assert_nothing_left(run_dir: Path, pidfile: Path | None = None) -> None:
    """No process of the job runs: none names the run directory, none the user's code started
    (a zombie has ended), the run directory's lock is free and the supervisors' records gone."""
    left = job_processes(run_dir)
    started = [pid for pid in (pids_in(pidfile) if pidfile else []) if alive(pid)]
    for pid in started:  # the test's own mess, not left for the next test
        os.kill(pid, 9)
    assert not left and not started, f"still running: {left} {started}"
    assert not held_by_live_run(run_dir)
    assert not (run_dir / ".ranks").exists()


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    return result.stderr.strip().splitlines()[-1]


# -- hangs -------------------------------------------------------------------------------------

HANGS = {
    # a rank that sleeps in the user's forward, after forking a child that leaves its session
    "fork-and-sleep": [MODEL, "model.act=fork-and-sleep"],
    # a rank in a C call that holds the GIL: its own threads (its watchdog) are stopped too
    "hold-the-gil": [MODEL, "model.act=hold-the-gil"],
    # an asynchronous optimizer's rank, stuck while the other trains on alone
    "async": ["optimizer=async_easgd", "debug.fail_at_step=4", "debug.fail_on_rank=1",
              "debug.fail_mode=hang"],
    # a rank that hangs right after the job wrote a checkpoint
    "after-a-checkpoint": ["trainer.checkpoint_every=4", "debug.fail_at_step=5",
                           "debug.fail_on_rank=1", "debug.fail_mode=hang"],
}


@pytest.fixture(scope="module")
def hangs(tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, tuple[subprocess.CompletedProcess[str], Path, Path, float]]:
    """Each kind of hang in its own run, all at once (most of each is the watchdog's wait):
    the result, the run directory, the pid file and the seconds from the start of the runs to
    the end of the last."""
    root = tmp_path_factory.mktemp("hangs")
    jobs = []
    for kind, overrides in HANGS.items():
        run_dir, pidfile = root / kind / "run", root / kind / "pids"
        args = [*TWO_RANKS, *overrides, f"hydra.run.dir={run_dir}"]
        if MODEL in args:
            args.append(f"model.pidfile={pidfile}")
        jobs.append(args)
    started = time.monotonic()
    results = run_cli_together(*jobs, timeout=BOUND_S + 60)
    took = time.monotonic() - started
    return {kind: (result, root / kind / "run", root / kind / "pids", took)
            for kind, result in zip(HANGS, results, strict=True)}


@pytest.mark.parametrize("kind", HANGS)
def test_a_hang_ends_the_whole_job_within_a_minute_naming_the_operation(
        kind: str, hangs: dict[str, tuple[subprocess.CompletedProcess[str], Path, Path, float]]
        ) -> None:
    result, run_dir, pidfile, took = hangs[kind]
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    # every run had ended when the last did
    assert took < BOUND_S, f"the jobs ended {took:.0f} s after the commands started"
    last = last_line(result)
    assert last.startswith("error: the 2-rank job failed (exit code "), last
    assert "on group world (2 ranks)" in last and (
        f"did not complete within {COMM_TIMEOUT_S} s (trainer.comm_timeout_s") in last, last
    assert "rank 1 did not arrive" in last, last
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["error"] in last, summary
    assert summary["timed_out"]["rank"] == 0 and summary["timed_out"]["missing_ranks"] == [1]
    if kind == "fork-and-sleep":
        assert len(pids_in(pidfile)) == 1  # the child was there to be ended
    if kind == "after-a-checkpoint":
        assert (run_dir / "checkpoints" / "step-00000004" / "manifest.json").is_file()
    assert_nothing_left(run_dir, pidfile)


SCRIPT = '''
import os, sys, time, signal
from runner.training.supervisor import report_failure, reserve_failure_report

run_dir, pids = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf to a request to stop, as a stuck launcher

def note(pid):
    with open(pids, "a") as file:
        file.write(f"{pid}\\n")

def forever():  # long past the bound of the test, which must not hang where the head does
    time.sleep(90)
    os._exit(0)

note(os.getpid())
child = os.fork()
if child == 0:  # a "rank" in a session of its own, with a daemon below it that is orphaned
    os.setsid()
    note(os.getpid())
    if os.fork() == 0:
        if os.fork() == 0:
            note(os.getpid())
            forever()
        os._exit(0)
    forever()
os.makedirs(os.path.join(run_dir, ".ranks"), exist_ok=True)
reserve_failure_report(run_dir, 1)
while len(open(pids).read().split()) < 3:
    time.sleep(0.01)
report_failure(run_dir, 1, {"failed_rank": 1, "error": "rank 1: stuck on purpose"})
forever()
'''


def test_the_head_ends_a_job_whose_rank_reported_a_failure_that_the_launcher_does_not_end(
        tmp_path: Path) -> None:
    """A rank reported how it failed (as a watchdog's timeout does), and its abort did not end
    the job: the head kills every process of it, the launcher, a process in a session of its
    own and an orphaned daemon below it (reparented to the head), within the grace."""
    script, pids, run_dir = tmp_path / "launcher.py", tmp_path / "pids", tmp_path / "run"
    script.write_text(SCRIPT)
    run_dir.mkdir()
    job = MPIJob([sys.executable, str(script), str(run_dir), str(pids)], run_dir,
                 {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    started = time.monotonic()
    result = job.run()
    took = time.monotonic() - started
    assert result.killed is not None and "killed by gridrun" in result.killed, result
    assert result.failure is not None and result.failure["error"] == "rank 1: stuck on purpose"
    assert took < KILL_GRACE_S + 10, f"{took:.1f} s"
    assert len(pids_in(pids)) == 3 and not [pid for pid in pids_in(pids) if alive(pid)]


# -- the user's code ending a rank, or leaving processes behind ----------------------------------

@pytest.fixture(scope="module")
def exits(tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, tuple[subprocess.CompletedProcess[str], Path, Path, float]]:
    """Independent runs, all at once: sys.exit(5) in a rank's model constructor, an exit with
    code 0 straight through C on a rank, a completed 2-rank run whose rank 1 leaves a helper
    running, a 1-process run whose forward starts a helper, then calls os._exit(0), and a sweep
    whose first job exits in a rank's constructor."""
    root = tmp_path_factory.mktemp("exits")
    runs = {
        "exit-in-init": [*TWO_RANKS, MODEL, "model.act=exit-in-init"],
        "c-exit-0": [*TWO_RANKS, MODEL, "model.act=c-exit-0"],
        "helper": [*SMALL, "grid.pc=2", "trainer.steps=8", MODEL, "model.act=helper"],
        "one-process": [*SMALL, "grid.pc=1", "trainer.steps=30", MODEL,
                        "model.act=helper-then-os-exit-0", "model.on=0"],
        # a sweep of two jobs, the first of which exits in a rank's constructor
        "sweep": ["-m", *SMALL, "grid.pc=2", "trainer.steps=4", MODEL,
                  "model.act=exit-in-init,none"],
    }
    started = time.monotonic()
    results = run_cli_together(*[[*args, f"model.pidfile={root / name}.pids",
                                  f"hydra.{'sweep' if '-m' in args else 'run'}.dir={root / name}"]
                                 for name, args in runs.items()], timeout=BOUND_S + 120)
    took = time.monotonic() - started
    return {name: (result, root / name, root / f"{name}.pids", took)
            for name, result in zip(runs, results, strict=True)}


def test_sys_exit_in_a_ranks_model_constructor_is_one_line_naming_it(exits: dict) -> None:
    result, run_dir, pids, _ = exits["exit-in-init"]
    assert result.returncode == 1, result.stderr[-3000:]
    last = last_line(result)
    line = (f"rank 1 exited with code 5 (sys.exit in the user's code at {HERE}:")
    assert last.startswith(f"error: the 2-rank job failed (exit code 1): {line}"), last
    assert last.endswith(f" in Misbehaving.__init__) during start-up; logs: {run_dir}/logs"), last
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 1, summary
    assert summary["error"].startswith(line), summary
    assert_nothing_left(run_dir, pids)


def test_a_sweep_job_whose_rank_exits_is_one_failed_job_and_the_sweep_goes_on(
        exits: dict) -> None:
    result, sweep, _, _ = exits["sweep"]
    assert result.returncode == 1, result.stderr[-3000:]
    [failed] = [line for line in result.stderr.splitlines() if line.startswith("error: job ")]
    assert failed.startswith("error: job 0 (") and (
        "): the 2-rank job failed (exit code 1): rank 1 exited with code 5 (sys.exit in the "
        f"user's code at {HERE}:") in failed, failed
    assert read_summary(sweep / "0")["status"] == "failed"
    assert read_summary(sweep / "1")["status"] == "completed"
    assert_nothing_left(sweep / "0")
    assert_nothing_left(sweep / "1")


def test_an_exit_with_code_0_in_the_middle_of_training_is_a_failure(exits: dict) -> None:
    """`_exit(0)` from C: nothing of Python runs, the rank's supervisor tells the head it did
    not finish."""
    result, run_dir, pids, _ = exits["c-exit-0"]
    assert result.returncode == 1, result.stderr[-3000:]
    last = last_line(result)
    assert last.startswith("error: the 2-rank job failed (exit code "), last
    assert "rank 1 (pid " in last and "exited with code 0 at step ~" in last, last
    assert "without finishing" in last, last
    assert read_summary(run_dir)["status"] == "failed"
    assert_nothing_left(run_dir, pids)


def test_a_completed_run_whose_ranks_left_helpers_running_ends_and_kills_them(
        exits: dict) -> None:
    result, run_dir, pids, took = exits["helper"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(run_dir)["status"] == "completed"
    assert len(pids_in(pids)) == 1, pids_in(pids)  # rank 1's helper, in a session of its own
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert f"rank 1 ended and left processes running: {pids_in(pids)[0]} (" in log, log
    assert took < BOUND_S + 60, f"{took:.0f} s"  # it did not wait for the helpers
    assert_nothing_left(run_dir, pids)


def test_os_exit_0_in_a_one_process_run_fails_in_one_line_and_ends_its_helper(
        exits: dict) -> None:
    result, run_dir, pids, _ = exits["one-process"]
    assert result.returncode == 1, result.stderr[-3000:]
    line = "rank 0 exited with code 0 (os._exit in the user's code at "
    last = last_line(result)
    assert last.startswith(f"error: the 1-rank job failed (exit code 1): {line}{HERE}:"), last
    assert " in Misbehaving.misbehave) in step " in last, last
    assert last.endswith(f", before the run completed; logs: {run_dir}/logs"), last
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["error"].startswith(line), summary
    assert len(pids_in(pids)) == 1
    assert_nothing_left(run_dir, pids)


def test_an_exit_with_code_0_that_did_not_finish_is_abnormal_and_named(tmp_path: Path) -> None:
    """A supervisor's record as the head reads it."""
    from runner.cli import mpijob

    record = {"rank": 1, "pid": 42, "supervisor_pid": 41, "ended": 1.0, "exit_code": 0}
    assert not mpijob._abnormal({**record, "finished": True})
    assert not mpijob._abnormal(record)  # a supervisor that could not tell
    assert mpijob._abnormal({**record, "finished": False})
    job = MPIJob(["true"], tmp_path, {})
    job.records = {1: {**record, "finished": False}}
    failure = job._diagnose()
    assert failure is not None
    assert failure["error"] == ("rank 1 (pid 42) exited with code 0 before its first step "
                                "without finishing")


def _quits(code: str | int | None) -> None:
    sys.exit(code)


def test_an_exit_is_named_with_its_code_how_and_where() -> None:
    from runner.training import rank

    for code, status, said in ((5, 5, ""), (None, 0, ""), ("no data", 1, ": 'no data'")):
        with pytest.raises(SystemExit) as exited:
            _quits(code)
        line = _quits.__code__.co_firstlineno + 1
        assert rank.exit_words(exited.value) == (status, (
            f"exited with code {status} (sys.exit{said} in the user's code at {HERE}:{line} in "
            f"_quits)"))
    assert rank.describe_exit(2, exited.value, " in step 4") == (
        f"rank 2 exited with code 1 (sys.exit: 'no data' in the user's code at {HERE}:{line} in "
        f"_quits) in step 4")


def test_os_exit_raises_in_the_process_that_trains_and_exits_in_a_child_it_forked() -> None:
    from runner.training import rank

    recorded: list[str] = []
    real = os._exit
    with rank._exits_recorded(0, recorded.append):
        with pytest.raises(rank.UserExit) as exited:
            os._exit(3)
        child = os.fork()
        if child == 0:
            os._exit(7)  # the guard lets a forked child exit as asked
        _, status = os.waitpid(child, 0)
    assert os._exit is real and not recorded
    assert os.waitstatus_to_exitcode(status) == 7
    assert exited.value.code == 3 and exited.value.where.startswith(
        f"in the user's code at {HERE}:")
    assert rank.describe_exit(0, exited.value, " during start-up") == (
        f"rank 0 exited with code 3 (os._exit {exited.value.where}) during start-up")
