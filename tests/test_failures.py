"""A job whose rank dies, hangs or is asked to stop ends promptly, says which rank and why, and
leaves no process behind. Real ranks through the real command line (an exception on a rank is
tested in test_cli_runs.py).

Durations are measured from outside, honestly on a busy machine: the clock starts when rank 0's
metrics line of step 2 appears (every rank has then finished step 2's collectives, and the
failure is injected at step 3) and stops when the command returns, so the start-up of the ranks,
however slow, is not counted, and the head's own exit is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.core import CommCounter, CommWatchdog, CountedComm
from runner.core import pace as pace_module
from runner.core.pace import Deadline, Pace
from runner.training.supervisor import stop_signal_path
from tests.conftest import ROOT, TIMEOUT_S, read_summary, wait_until
from tests.gates import Gate

# The process tree itself (who is killed when, what is left behind): fresh interpreters
# as ranks, as a launcher starts them without the suite (tests.warm_ranks).
pytestmark = pytest.mark.fresh_ranks

DATA4 = ["strategy=data", "grid.pr=1", "grid.pc=4", "trainer.batch_size=32",
         "trainer.eval_every=null"]
DATA2 = ["strategy=data", "grid.pr=1", "grid.pc=2", "trainer.batch_size=32",
         "trainer.eval_every=null"]
FAIL_AT_3_ON_2 = ["debug.fail_at_step=3", "debug.fail_on_rank=2"]
KILL_DEADLINE_S = 10.0


def job_processes(run_dir: Path) -> list[str]:
    """Every live process whose command line names this run's directory."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline:
            found.append(f"{proc.name}: {cmdline.replace(chr(0), ' ')}")
    return found


def start_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_step(job: subprocess.Popen[str], run_dir: Path, step: int) -> float:
    """The moment rank 0 logged `step` (polled every 20 ms), or the moment the job ended."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and job.poll() is None:
        if metrics.exists() and any(json.loads(line).get("step", 0) >= step
                                    for line in metrics.read_text().splitlines() if line):
            break
        time.sleep(0.02)
    return time.monotonic()


def finish(job: subprocess.Popen[str], run_dir: Path,
           timeout: float = 120) -> tuple[str, str, float]:
    """The job's output and the moment it ended; a job still running after `timeout` fails the
    test, and is killed with every process of its run."""
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        for line in job_processes(run_dir):
            with contextlib.suppress(OSError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
        raise
    return out, err, time.monotonic()


def test_a_rank_killed_by_sigkill_is_named_and_the_job_ends_within_10_s(tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    job = start_cli(*DATA4, "trainer.steps=100", *FAIL_AT_3_ON_2, "debug.fail_mode=kill",
                    f"hydra.run.dir={run_dir}")
    seen = wait_for_step(job, run_dir, 2)
    out, err, ended = finish(job, run_dir, timeout=KILL_DEADLINE_S + 20)
    assert job.returncode not in (0, 2), f"exit {job.returncode}\n{out}\n{err}"
    # The other ranks wait in step 3's gradient all-reduce for ever, unless something ends it.
    assert ended - seen < KILL_DEADLINE_S, f"{ended - seen:.1f} s after step 2\n{err}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the 4-rank job failed"), last
    assert "rank 2 (pid " in last and "killed by signal 9 (SIGKILL) at step ~3" in last, last
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 2, summary
    assert summary["signal"] == 9 and str(summary["pid"]) in last
    assert not job_processes(run_dir)
    assert not (run_dir / ".ranks").exists()  # the supervisors' records are the head's alone


def test_a_hung_rank_ends_the_job_through_the_watchdog(tmp_path: Path) -> None:
    run_dir = tmp_path / "hung"
    timeout = 3
    job = start_cli(*DATA4, "trainer.steps=100", *FAIL_AT_3_ON_2, "debug.fail_mode=hang",
                    f"trainer.comm_timeout_s={timeout}", f"hydra.run.dir={run_dir}")
    seen = wait_for_step(job, run_dir, 2)
    out, err, ended = finish(job, run_dir, timeout=timeout + KILL_DEADLINE_S + 20)
    assert job.returncode not in (0, 2), f"exit {job.returncode}\n{out}\n{err}"
    assert ended - seen < timeout + KILL_DEADLINE_S, f"{ended - seen:.1f} s after step 2\n{err}"
    # A rank that waited names the operation, its group and the setting; the hung rank 2
    # waits in no collective, so it is not the one that reports: it is named as the one that
    # did not arrive, from the progress its watchdog recorded.
    summary = read_summary(run_dir)
    assert summary["status"] == "failed", summary
    timed_out = summary["timed_out"]
    assert timed_out["rank"] in (0, 1, 3) and timed_out["group"] == "world", timed_out
    assert timed_out["missing_ranks"] == [2], timed_out
    expected = (f"rank {timed_out['rank']}: {timed_out['op']} '{timed_out['label']}' on group "
                f"world (4 ranks) in step 3 did not complete within {timeout} s "
                f"(trainer.comm_timeout_s, the deadline until 3 steps are timed); a peer may "
                f"have hung or died; rank 2 did not arrive: its last collective was #")
    assert summary["error"].startswith(expected), summary["error"]
    assert summary["error"].endswith("s ago; it is not in a collective"), summary["error"]
    assert "rank 0 did not" not in summary["error"] and "rank 3 did not" not in summary["error"]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the 4-rank job failed") and summary["error"] in last, last
    log = (run_dir / "logs" / f"rank{timed_out['rank']}.log").read_text()
    assert "did not complete within" in log
    assert not job_processes(run_dir)  # the hung rank too


def test_a_hung_rank_ends_the_job_at_the_deadline_its_steps_set_by_default(
        tmp_path: Path) -> None:
    """The default trainer.comm_timeout_s (300 s) is only the cap: once steps have been timed,
    a collective's deadline derives from them (here the floor: steps are short), so a rank hung
    in step 8 ends the job at that deadline, in one line that names the rank that waited, what
    in, the deadline and how it was derived, and the rank that did not arrive. The floor (30 s,
    as the pace test below derives it) is lowered to 4 s for the test's time."""
    run_dir = tmp_path / "hung_default"
    job = start_cli(*DATA2, "trainer.steps=1000", "debug.fail_at_step=8", "debug.fail_on_rank=1",
                    "debug.fail_mode=hang", "debug.deadline_floor_s=4",
                    f"hydra.run.dir={run_dir}")
    seen = wait_for_step(job, run_dir, 7)
    out, err, ended = finish(job, run_dir, timeout=60)
    assert job.returncode not in (0, 2), f"exit {job.returncode}\n{out}\n{err}"
    assert ended - seen < 4 + KILL_DEADLINE_S + 10, f"{ended - seen:.1f} s after step 7\n{err}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the 2-rank job failed"), last
    assert re.search(r"rank 0: \w+ '[^']*' on group \w+ \(2 ranks\) in step 8 did not "
                     r"complete within 4 s \(the 4 s floor, above 5 × the slowest step so "
                     r"far \([0-9.]+ s\); at most trainer\.comm_timeout_s=300 s\); a peer "
                     r"may have hung or died; rank 1 did not arrive: ", last), last
    timed_out = read_summary(run_dir)["timed_out"]
    assert timed_out["rank"] == 0 and timed_out["missing_ranks"] == [1], timed_out
    assert timed_out["deadline_s"] == 4 and timed_out["timeout_s"] == 300, timed_out
    assert not job_processes(run_dir)


def test_a_head_killed_with_its_process_group_takes_its_ranks_along(tmp_path: Path) -> None:
    """SIGKILL to the head's process group leaves mpiexec (its own session) and the ranks (a
    process group each, under MPICH's hydra) behind; here rank 1 hangs outside any collective
    and no watchdog is set, so nothing but the head's end can stop them. Killed once rank 0
    logged step 2: every rank has then passed step 2's collectives, so rank 1 reaches its hang
    in step 3 whether the head is gone by then or not (a stop is agreed in a step's last
    collective, after the forward that hangs)."""
    run_dir, stderr = tmp_path / "headless", tmp_path / "head.err"
    with stderr.open("w") as err:
        job = subprocess.Popen(
            [sys.executable, "-m", "runner", *DATA2, "trainer.steps=1000", "debug.fail_at_step=3",
             "debug.fail_on_rank=1", "debug.fail_mode=hang", "trainer.comm_timeout_s=null",
             f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True)
    try:
        wait_for_step(job, run_dir, 2)
        assert job.poll() is None, stderr.read_text()
        os.killpg(job.pid, signal.SIGKILL)
        killed = time.monotonic()
        job.wait(timeout=30)  # its output's pipes are the job's too: not read here
        while job_processes(run_dir) and time.monotonic() - killed < 20:
            time.sleep(0.1)
        left, took = job_processes(run_dir), time.monotonic() - killed
        assert not left and took < KILL_DEADLINE_S, (f"{took:.1f} s after the head's SIGKILL: "
                                                     f"{left}\n{stderr.read_text()}")
        logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank*.log"))
        assert f"the head (pid {job.pid}) is gone" in logs, logs[-2000:]
    finally:
        with contextlib.suppress(OSError):
            os.killpg(job.pid, signal.SIGKILL)
        for line in job_processes(run_dir):
            with contextlib.suppress(OSError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)


def test_a_second_signal_kills_the_job_at_once(tmp_path: Path) -> None:
    """The ranks are held in step 2 (`tests.gates`, not released by the stop), so they cannot
    finish their step before the second signal; that one is sent once the head has taken the
    first (it wrote the signal for the ranks)."""
    run_dir = tmp_path / "killed_twice"
    gate = Gate(tmp_path / "gate", hold_at=2, release_on_stop=False)
    job = start_cli(*DATA2, "trainer.steps=200", *gate.overrides, f"hydra.run.dir={run_dir}")
    gate.wait_held(2, job=job)
    job.send_signal(signal.SIGINT)
    taken = stop_signal_path(run_dir)
    wait_until(lambda: taken.exists() or job.poll() is not None, "the head's note of the stop",
               timeout=TIMEOUT_S)
    assert job.poll() is None, job.communicate()
    job.send_signal(signal.SIGINT)
    second = time.monotonic()
    out, err, ended = finish(job, run_dir)
    assert job.returncode == 130, f"exit {job.returncode}\n{out}\n{err}"
    assert ended - second < 3.0, f"{ended - second:.1f} s after the second signal"
    assert err.count("stopping: the ranks finish their step") == 1, err
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["checkpoint"] is None, summary
    assert "killed at a second SIGINT" in summary["message"]
    assert not job_processes(run_dir)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_names_the_signal_the_head_got(tmp_path: Path, signum: signal.Signals) -> None:
    """The head forwards SIGTERM to the job whatever it got; the ranks still name the signal
    the user sent (Ctrl-C is SIGINT), in the summary and the message."""
    run_dir = tmp_path / f"stopped_{signum.name}"
    gate = Gate(tmp_path / "gate", hold_at=2)  # held in step 2 until the stop reaches them
    job = start_cli(*DATA2, "trainer.steps=200", *gate.overrides, f"hydra.run.dir={run_dir}")
    gate.wait_held(2, job=job)
    job.send_signal(signum)
    out, err, _ = finish(job, run_dir)
    assert job.returncode == 130, f"exit {job.returncode}\n{out}\n{err}"
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["signal"] == signum.name, summary
    assert summary["message"].startswith(f"interrupted by {signum.name} after step "), summary
    assert summary["message"] in err
    assert "Sending Ctrl-C" not in err  # MPICH's own lines: the head forwarded SIGTERM
    assert not job_processes(run_dir)
    assert not (run_dir / ".ranks").exists()


def test_replicas_that_meet_every_4th_step_stop_together_on_one(tmp_path: Path) -> None:
    """`sync_easgd` with τ = 4: between exchanges the replicas make no collective with each
    other, so a stop request is held until the next exchange step, where they all stop. The
    ranks get it in step 2 (held there by `tests.gates` until it reaches them)."""
    run_dir = tmp_path / "held_stop"
    gate = Gate(tmp_path / "gate", hold_at=2)
    job = start_cli(*DATA2, "optimizer=sync_easgd", "optimizer.period=4", "trainer.steps=200",
                    *gate.overrides, f"hydra.run.dir={run_dir}")
    gate.wait_held(2, job=job)
    job.send_signal(signal.SIGTERM)
    out, err, _ = finish(job, run_dir)
    assert job.returncode == 130, f"exit {job.returncode}\n{out}\n{err}"
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["step"] == 4, summary
    assert summary["checkpoint"].endswith(f"step-{summary['step']:08d}"), summary


# -- the watchdog alone (no MPI) ----------------------------------------------------------------

class FakeComm:
    """Enough of an mpi4py communicator to see what the watchdog sees during a call."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter, self.seen = counter, []

    def Get_rank(self) -> int:
        return 1

    def Get_size(self) -> int:
        return 4

    def Bcast(self, tensor: object, root: int) -> None:
        self.seen.append(self.counter.in_flight)

    def Barrier(self) -> None:
        self.seen.append(self.counter.in_flight)


def test_collectives_mark_themselves_in_flight_while_they_block() -> None:
    import torch

    counter = CommCounter()
    fake = FakeComm(counter)
    comm = CountedComm(fake, counter, "model")
    comm.bcast_(torch.zeros(2), label="weights")
    comm.barrier()
    assert [s[:4] for s in fake.seen] == [("bcast", "model", 4, "weights"),
                                          ("barrier", "model", 4, "")]
    assert counter.in_flight is None


def test_the_watchdog_fires_once_on_an_operation_past_its_timeout() -> None:
    counter = CommCounter()
    fired: list[str] = []
    with CommWatchdog(counter, 0.2, 3, lambda message, _: fired.append(message),
                      interval=0.02):
        counter.in_flight = ("allreduce", "world", 4, "loss", time.perf_counter())
        counter.in_flight = None  # done in time: nothing
        time.sleep(0.3)
        assert not fired
        counter.in_flight = ("allreduce", "world", 4, "loss", time.perf_counter())
        wait_until(lambda: fired, "the watchdog's timeout")
    assert fired == ["rank 3: allreduce 'loss' on group world (4 ranks) did not complete "
                     "within 0.2 s (the communication timeout); a peer may have hung or died"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc")
def test_the_head_is_watched_only_where_its_pid_means_it() -> None:
    from runner.training import supervisor

    identity = supervisor.head_identity()
    assert identity is not None
    started = supervisor._start_time(os.getpid())
    assert supervisor.watched_head(identity) == (os.getpid(), started)
    # another machine or pid namespace: not ours to watch; nor is a garbled value
    assert supervisor.watched_head(f"another-boot/pid:[1]:{os.getpid()}:{started}") is None
    assert supervisor.watched_head("garbled") is None and supervisor.watched_head(None) is None
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert supervisor._start_time(ended.pid) is None  # gone: what the watch waits for


def test_a_deadline_derives_from_the_pace_of_the_steps_within_the_cap() -> None:
    now = [0.0]
    pace = Pace(clock=lambda: now[0])

    def after(seconds: float, step: int, ends_round: bool = True) -> Deadline:
        now[0] += seconds
        pace.begin_step(step, ends_round)
        return pace.deadline(300, "trainer.comm_timeout_s")

    setting = "trainer.comm_timeout_s"
    assert pace.deadline(300, setting) == Deadline(300, f"{setting}, the deadline outside "
                                                        f"training steps")
    assert pace.where() == " during start-up"
    assert after(20, 1).how == f"{setting}, the deadline of the first steps after start-up"
    assert after(9.0, 2).how == f"{setting}, the deadline until 3 steps are timed"  # 1: warm-up
    after(0.5, 3)
    after(1.2, 4)
    assert after(0.5, 5) == Deadline(30, f"the 30 s floor, above 5 × the slowest step so far "
                                         f"(1.20 s); at most {setting}=300 s")
    assert pace.where() == " in step 5"
    assert after(8.01, 6) == Deadline(41, f"5 × the slowest step so far (8.01 s); at most "
                                          f"{setting}=300 s")
    assert pace.deadline(20, setting) == Deadline(20, f"{setting}, below 41 s: 5 × the slowest "
                                                      f"step so far (8.01 s)")
    # evaluation, and the step right after it (a peer may still be evaluating): the cap
    now[0] += 1
    pace.begin("evaluation", 6)
    assert pace.deadline(300, setting).seconds == 300
    assert pace.where() == " during evaluation after step 6"
    assert after(60, 7).how == f"{setting}, the deadline of the first steps after evaluation"
    assert after(1, 8).seconds == 41  # the rounds timed before still count

    # replicas that meet every 4th step wait at most the stretch between two meetings
    pace = Pace(clock=lambda: now[0])
    for step in range(1, 21):
        after(3.0, step, ends_round=step % 4 == 0)
    assert pace.deadline(300, setting) == Deadline(60, (
        f"5 × the slowest stretch between the replicas' meetings so far (12.00 s); at most "
        f"{setting}=300 s"))


def test_a_paced_watchdog_fires_at_the_derived_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pace_module, "FLOOR_S", 0.2)  # seconds are long for a unit test
    counter = CommCounter()
    for step in range(1, 6):
        counter.pace.begin_step(step)
    fired: list[str] = []
    watchdog = CommWatchdog(counter, 10, 3, lambda message, _: fired.append(message),
                            interval=0.02, setting="trainer.comm_timeout_s", paced=True)
    with watchdog:
        counter.in_flight = ("allreduce", "world", 4, "loss", time.perf_counter())
        wait_until(lambda: fired, "the watchdog's timeout")
    assert watchdog.deadline is not None and watchdog.deadline.seconds == 0.2
    assert fired == ["rank 3: allreduce 'loss' on group world (4 ranks) in step 5 did not "
                     "complete within 0.2 s (the 0.2 s floor, above 5 × the slowest step so far "
                     "(0.00 s); at most trainer.comm_timeout_s=10 s); a peer may have hung or "
                     "died"]
