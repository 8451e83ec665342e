"""A failure names what failed: the rank that did not arrive in a collective (not only the one that
waited), the signal the user sent (not the SIGTERM the head forwards), the file and the reason of
a write that failed (a full disk). In-process units for each piece (a real ENOSPC from
/dev/full), and real runs on a real full disk (a small tmpfs, when this machine lets us mount
one).
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from runner.cli.mpijob import MPIJob
from runner.core import CommCounter
from runner.core.watchdog import (
    CommProgress,
    CommWatchdog,
    ProgressSharing,
    absent_ranks,
    describe_absent,
)
from runner.records.rundir import RunDir
from runner.training import interrupt, rank, supervisor
from tests.conftest import read_summary, wait_until
from tests.gates import Gate
from tests.test_failures import finish, job_processes, start_cli

# The process tree itself (who is killed when, what is left behind): fresh interpreters
# as ranks, as a launcher starts them without the suite (tests.warm_ranks).
pytestmark = pytest.mark.fresh_ranks

NOW = 1_000_000.0
LOSS = ("allreduce", "world", 4, "loss", NOW - 40.0)


def progress(rank: int, completed: int = 57, in_flight: Any = None, last: float = NOW - 31.0,
             written: float = NOW) -> CommProgress:
    return CommProgress(rank, completed, last, in_flight, written)


# -- who did not arrive --------------------------------------------------------------------------

def test_the_ranks_not_in_the_operation_are_named_with_what_they_are_doing() -> None:
    waiting = progress(0, in_flight=LOSS)
    peers = {
        1: progress(1, in_flight=LOSS),  # arrived: not named
        2: progress(2),  # hung outside any collective
        3: progress(3, 55, ("bcast", "world", 4, "weights", NOW - 12.0)),  # elsewhere: deadlock
        4: None,  # never recorded anything
        5: progress(5, written=NOW - 30.0),  # stopped recording
    }
    absent = absent_ranks(waiting, peers, NOW, stale_after=2.5)
    assert [a.rank for a in absent] == [2, 3, 4, 5]
    reasons = {a.rank: a.reason for a in absent}
    assert reasons[2] == "its last collective was #57, 31.0 s ago; it is not in a collective"
    assert reasons[3] == ("it is in bcast 'weights' on group world, for 12.0 s (after #55) "
                          "(2 fewer completed than rank 0)")
    assert reasons[4].startswith("it recorded no progress")
    assert reasons[5].startswith("its progress was last recorded 30.0 s ago (its process may be "
                                 "stopped or gone); then its last collective was #57")
    assert describe_absent(absent, limit=1) == (f"rank 2 did not arrive: {reasons[2]}; "
                                                f"3 more ranks did not arrive")


def test_a_rank_in_the_same_operation_arrived_and_a_rank_that_completed_none_is_said_so() -> None:
    waiting = progress(0, in_flight=LOSS)
    assert absent_ranks(waiting, {1: progress(1, 3, LOSS)}, NOW, 2.5) == []
    [absent] = absent_ranks(waiting, {1: progress(1, 0)}, NOW, 2.5)
    assert absent.reason == ("it has completed no collective; it is not in a collective "
                             "(57 fewer completed than rank 0)")
    assert absent_ranks(progress(0), {1: progress(1)}, NOW, 2.5) == []  # not waiting: nothing


def test_progress_survives_its_json_and_a_malformed_record_raises() -> None:
    record = progress(3, 9, LOSS)
    assert CommProgress.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert CommProgress.from_json(progress(1).to_json()).in_flight is None
    with pytest.raises((KeyError, TypeError, ValueError)):
        CommProgress.from_json({"rank": 1, "completed": "x"})


def test_the_watchdog_publishes_progress_and_names_the_rank_that_did_not_arrive() -> None:
    counter = CommCounter()
    published: list[CommProgress] = []
    fired: list[str] = []

    def peers(in_flight: Any) -> dict[int, CommProgress | None]:
        assert in_flight[:4] == ("allreduce", "world", 3, "loss")
        now = time.time()
        waiting = ("allreduce", "world", 3, "loss", now - 0.3)
        return {0: CommProgress(0, 2, now - 5, None, now),
                2: CommProgress(2, 2, now, waiting, now)}

    sharing = ProgressSharing(publish=published.append, peers=peers, publish_every=0.05)
    watchdog = CommWatchdog(counter, 0.2, 1, lambda message, _: fired.append(message),
                            interval=0.02, sharing=sharing)
    with watchdog:
        wait_until(lambda: published, "the first record")  # before any operation completed
        counter.totals.calls = 2  # two operations completed
        wait_until(lambda: published[-1].completed == 2, "a record of two operations")
        counter.in_flight = ("allreduce", "world", 3, "loss", time.perf_counter())
        wait_until(lambda: fired, "the watchdog's timeout")
    assert [a.rank for a in watchdog.absent] == [0]
    assert fired == [
        "rank 1: allreduce 'loss' on group world (3 ranks) did not complete within 0.2 s (the "
        "communication timeout); a peer may have hung or died; rank 0 did not arrive: its last "
        "collective was #2, 5.0 s ago; it is not in a collective"]
    # every publish_every, no sooner (the last one, at the timeout, is made at once), and what
    # the rank was doing each time
    regular = [p.written for p in published[:-1]]
    assert len(published) >= 3, published
    assert all(later - earlier >= 0.04 for earlier, later in itertools.pairwise(regular)), published
    assert published[0].completed == 0 and published[-1].completed == 2
    assert published[-1].in_flight is not None and published[-1].in_flight[3] == "loss"
    assert all(p.rank == 1 for p in published)


def test_the_progress_records_go_through_the_run_directory(tmp_path: Path) -> None:
    path = rank.progress_path(tmp_path, 3)
    path.parent.mkdir()
    rank._write_progress(path, progress(3, 7, LOSS))
    assert rank._read_progress(path) == progress(3, 7, LOSS)
    assert rank._read_progress(rank.progress_path(tmp_path, 4)) is None
    path.write_text("{")  # never seen: records are renamed into place, but a stray one is
    assert rank._read_progress(path) is None
    grid: Any = SimpleNamespace(size=6, pr=3, pc=2, rank=4, batch_index=1, model_index=1)
    assert rank.group_members(grid, "world") == [0, 1, 2, 3, 4, 5]
    assert rank.group_members(grid, "model") == [3, 4, 5]
    assert rank.group_members(grid, "batch") == [1, 4]
    assert rank.group_members(grid, "self") == [4]


# -- which signal ------------------------------------------------------------------------------

@pytest.mark.parametrize(("relayed", "sent", "named"), [
    ("SIGINT", signal.SIGTERM, "SIGINT"),  # Ctrl-C to the head, forwarded as SIGTERM
    (None, signal.SIGTERM, "SIGTERM"),  # SIGTERM from elsewhere: no file
    ("SIGINT", signal.SIGUSR1, "SIGUSR1"),  # only the forwarded SIGTERM stands for another
])
def test_a_rank_names_the_signal_the_head_got(tmp_path: Path, relayed: str | None,
                                              sent: signal.Signals, named: str) -> None:
    path = supervisor.stop_signal_path(tmp_path)
    if relayed is not None:
        path.parent.mkdir()
        path.write_text(json.dumps({"signal": relayed, "time": time.time()}))
    interrupt.relay_stop_signal_from(path)
    before = {s: signal.getsignal(s) for s in interrupt.STOP_SIGNALS}
    try:
        with interrupt.StopRequest(ends_process=True) as stop:
            assert not stop.requested and stop.signal_name is None
            os.kill(os.getpid(), sent)
            deadline = time.monotonic() + 5
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(0.01)
            assert stop.requested and stop.signal_name == named
        # a rank stopped: a repeated request (srun relaying the head's SIGUSR1 after Slurm's
        # SIGTERM) cannot kill it before it writes its summary; Ctrl-C is as it was
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) \
            == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
        os.kill(os.getpid(), signal.SIGUSR1)  # ignored: the test goes on
        with interrupt.StopRequest() as stop:  # a run in a caller's process: handlers back
            os.kill(os.getpid(), signal.SIGUSR1)
            wait_until(lambda: stop.requested, "the stop noted")
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # what it was before it
    finally:
        interrupt.relay_stop_signal_from(None)
        for signum, handler in before.items():  # this test's process carries on
            signal.signal(signum, handler)


# -- which file, and why -------------------------------------------------------------------------

def test_an_os_error_is_one_line_with_its_file_and_the_system_words() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/a/metrics.jsonl")
    assert rank.describe_error(full) == ("cannot write /runs/a/metrics.jsonl: No space left on "
                                         "device (ENOSPC)")
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/runs/a/x")
    assert rank.describe_error(denied) == "/runs/a/x: Permission denied (PermissionError, EACCES)"
    moved = OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a/tmp", None, "/b/file")
    assert rank.describe_error(moved).startswith("/a/tmp -> /b/file: Invalid cross-device link")
    assert rank.describe_error(OSError(errno.ENOSPC, "No space left on device")) == (
        "OSError: [Errno 28] No space left on device")
    assert rank.describe_error(ValueError("bad")) == "ValueError: bad"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_full_disk_in_the_metrics_is_recorded_with_the_file(tmp_path: Path) -> None:
    """A real ENOSPC (a write to /dev/full: gridrun follows no link to it from a run
    directory), named with the metrics file that met it, through the rank's failure record."""
    metrics = tmp_path / "metrics.jsonl"
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as full:
            os.write(fd, b'{"step": 1, "loss": 2.0}\n')
    finally:
        os.close(fd)
    failed = OSError(full.value.errno, full.value.strerror, str(metrics))
    rank._record_failure(RunDir(tmp_path), 0, failed)
    summary = read_summary(tmp_path)
    assert summary["failed_rank"] == 0
    assert summary["error"] == f"cannot write {metrics}: No space left on device (ENOSPC)"


def test_a_failure_report_needs_no_new_block_and_the_head_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report overwrites the room reserved at the start (same size: no new block on a full
    disk); the first stays; a blank reservation is no report; the head takes the first report,
    in the rank's words, over the deaths it caused."""
    monkeypatch.setattr(supervisor, "_reported", False)
    supervisor.reserve_failure_report(tmp_path, 0)
    supervisor.reserve_failure_report(tmp_path, 1)
    path = supervisor.failure_report_path(tmp_path, 0)
    assert path.stat().st_size == supervisor.REPORT_BYTES
    assert supervisor.read_failure_reports(tmp_path) == {}
    failure = {"failed_rank": 0, "error": "cannot write /r/metrics.jsonl: No space left on device"}
    supervisor.report_failure(tmp_path, 0, failure)
    supervisor.report_failure(tmp_path, 0, {"failed_rank": 0, "error": "a consequence"})
    assert path.stat().st_size == supervisor.REPORT_BYTES
    [(reported_rank, report)] = supervisor.read_failure_reports(tmp_path).items()
    assert reported_rank == 0 and {k: report[k] for k in failure} == failure

    job = MPIJob(["true"], tmp_path, {})
    killed = {"rank": 1, "pid": 12, "supervisor_pid": 10, "host": "h", "started": 1.0,
              "ended": report["at"] + 0.5, "signal": 9}
    job.records = {1: killed}
    assert job._diagnose() == failure  # rank 1 was killed after it, because of it
    job.records = {1: {**killed, "ended": report["at"] - 0.5}}  # rank 1 died first: the cause
    diagnosed = job._diagnose()
    assert diagnosed is not None and diagnosed["failed_rank"] == 1 and diagnosed["signal"] == 9


def test_a_long_report_still_fits_its_room(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "_reported", False)
    supervisor.reserve_failure_report(tmp_path, 3)
    error = "rank 3: é" * 3000  # escaped in JSON: 6 bytes a character
    supervisor.report_failure(tmp_path, 3, {"error": error, "timed_out": {
        "missing_ranks": list(range(2000))}})
    assert supervisor.failure_report_path(tmp_path, 3).stat().st_size == supervisor.REPORT_BYTES
    report = supervisor.read_failure_reports(tmp_path)[3]
    assert error.startswith(report["error"][:-1]) and "timed_out" not in report


# -- real ranks on a real full disk --------------------------------------------------------------

DATA2 = ["strategy=data", "grid.pr=1", "grid.pc=2", "trainer.batch_size=32",
         "trainer.eval_every=null"]
PAGE = 4096


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 20 MiB tmpfs of our own (skipped where this machine does not let us mount one)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(disk: Path, name: str) -> None:
    """Every free page of `disk` taken, a page at a time."""
    fd = os.open(disk / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            os.write(fd, b"x" * PAGE)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


def test_a_disk_that_fills_up_during_training_is_named_by_the_head(small_disk: Path) -> None:
    """The disk fills up while the ranks are held in step 2 (`tests.gates`), metrics.jsonl's
    first page part written: the line that needs the next page fails on rank 0, with the disk
    still full, so rank 0 cannot write summary.json either; the head names the rank, the file
    and the reason all the same (the rank told its supervisor, whose record was reserved at the
    start), and writes the summary once the job's records are gone."""
    run_dir = small_disk / "run"
    metrics, ranks = run_dir / "metrics.jsonl", run_dir / ".ranks"
    gate = Gate(small_disk.parent / "gate", hold_at=2)  # off the small disk: it is filled
    job = start_cli(*DATA2, "trainer.steps=300", *gate.overrides, f"hydra.run.dir={run_dir}")
    gate.wait_held(2, job=job)
    assert 0 < metrics.stat().st_size < PAGE
    # The watchdogs' progress records go too: a rank removes its own as it ends, and the page
    # that frees would take rank 0's summary. Once the disk is full with none left (nor one
    # being written: a new record's file), none can be written again.
    for attempt in itertools.count():
        for record in [*ranks.glob("progress-*"), *ranks.glob(".progress-*")]:
            record.unlink(missing_ok=True)
        _fill(small_disk, f"filler{attempt}")
        if not [*ranks.glob("progress-*"), *ranks.glob(".progress-*")]:
            break
    gate.release()
    out, err, _ = finish(job, run_dir)
    assert job.returncode not in (0, 2), f"exit {job.returncode}\n{out}\n{err}"
    reason = f"cannot write {metrics}: No space left on device (ENOSPC)"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the 2-rank job failed on rank 0 (exit code ") and reason in last
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 0, summary
    assert summary["error"] == reason
    assert "exit_code" in summary  # written by the head: the rank could not
    assert metrics.read_text().endswith("\n")  # whole lines only
    assert not job_processes(run_dir)
