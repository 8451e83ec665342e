"""The supervisor: who names a rank that died without a word (SIGKILL, the OOM killer, a
segfault).

Under the head, the process the launcher starts forks the rank before MPI is initialised and
waits for it, writing the rank's pid on start and its exit status at the end into
`RUN_DIR/.ranks/rank<k>.json` (read by `runner.cli.mpijob`), then ends the way the rank did, so the
launcher reacts as it would without it. Why not let the head watch pids alone: MPICH ends the
whole job ~40 ms after one rank is killed, and the other ranks die within milliseconds of it
(some even before the dead rank's pid is seen to end), too close to tell which was first; the
PID in MPICH's own message is not the dead rank's either. A parent's `waitpid` is exact.

The head may end without a word too (SIGKILL to its process group): mpiexec is in a session of
its own and MPICH puts each rank in a process group of its own, so nothing of the job goes with
it, and a rank that cannot stop at a step's end (hung, or in a long step) trains on unwatched.
The head names itself in the job's environment (`HEAD_ENV`); a supervisor on its machine watches
it from a thread and, once it is gone, asks the rank to stop (SIGTERM: it checkpoints) and kills
it `HEAD_GONE_GRACE_S` later; the launcher then ends the job, on the other nodes too. A job the
user started (`mpiexec -n P python -m runner`, srun) has no head: nothing is watched.

A rank that fails says how in `RUN_DIR/.ranks/failure-<k>.json` too (`report_failure`), in room
it reserved at its start: on a full disk it cannot write `summary.json`, and its supervisor may be
killed by the launcher before it records anything (MPI_Abort), but the report overwrites bytes
already on disk, so the head still names the rank and the reason. The head also writes there the
signal it got before it forwards SIGTERM (`stop_signal_path`, read by `runner.training.interrupt`).

What a rank leaves running when it ends (a helper process, a daemon of the user's code) would
keep the launcher waiting for its output for ever, and the job with it: the supervisor is a child
subreaper (orphans below it are reparented to it, not to init), and once its rank has ended it
kills every process still below it (`runner.records.process.end_processes`), whether the run
completed or not. It also tells whether the rank finished: the rank says so through a pipe
(`mark_finished`, at the end of the worker), so an exit with code 0 in the middle of training
that no Python code saw (`_exit(0)` from C; `os._exit` is named by the rank itself,
`runner.training.rank`) is recorded as `"finished": false`, a failure.

Light imports only: the supervisor forks before the rank imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runner.records import safe_paths
from runner.records.process import adopt_orphans, descendants, end_processes, reap_children
from runner.records.rundir import write_json

RANKS_DIR = ".ranks"  # the supervisors' records, inside the run directory
STOP_SIGNAL_FILE = "stop-signal"  # the signal the head got, written before it forwards SIGTERM
REPORT_BYTES = 4096  # the room a rank reserves for its failure report
ERROR_CHARS = 2000  # a reported error is cut to this, to fit in that room
# Forwarded by MPICH's mpiexec to every process of each rank's process group: meant for the rank
# (which stops cleanly, see runner.training.interrupt), not for its supervisor.
_RANK_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
HEAD_ENV = "GRIDRUN_HEAD"  # the head that started the job: boot id, pid namespace, pid, start
HEAD_POLL_S = 0.25
HEAD_GONE_GRACE_S = 5.0  # a rank asked to stop after its head went is killed this much later
_supervised = False  # in the rank: forked by a supervisor (a job the head started)
_reported = False
_finished_fd: int | None = None  # in the rank: the pipe on which it tells its supervisor


def supervised() -> bool:
    """Whether this process is a rank under a supervisor, in a job the head started (which
    reads `.ranks/` and removes it at the end)."""
    return _supervised


def mark_finished() -> None:
    """In the rank, once it has done its work (trained, or failed and said so): its supervisor
    then records an exit with code 0 as a finished run, not as a rank that vanished."""
    global _finished_fd
    if _finished_fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(_finished_fd, b"1")
        os.close(_finished_fd)
    _finished_fd = None


def _told_finished(fd: int) -> bool:
    """In the supervisor, after its rank ended: whether the rank wrote to the pipe."""
    try:
        os.set_blocking(fd, False)
        return bool(os.read(fd, 1))
    except OSError:  # nothing written (EAGAIN while a child of the rank still holds it)
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def stop_signal_path(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS_DIR / STOP_SIGNAL_FILE


def _failure_report(rank: int) -> str:
    return f"{RANKS_DIR}/failure-{rank}.json"


def failure_report_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / _failure_report(rank)


def _read_record(path: Path) -> bytes:
    """A record of `.ranks/` (a few hundred bytes), read without following a link or waiting
    on a FIFO."""
    return safe_paths.read_bytes(*safe_paths.locate(path), REPORT_BYTES)


def reserve_failure_report(run_dir: Path, rank: int) -> None:
    """In the rank, at its start: room for its failure report (blank: no report), taken while
    the disk has some."""
    with contextlib.suppress(OSError):  # from the run directory, no link followed
        fd = safe_paths.open_file(run_dir, _failure_report(rank),
                                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, create_dirs=True)
        with os.fdopen(fd, "wb") as file:
            file.write(b" " * (REPORT_BYTES - 1) + b"\n")


def report_failure(run_dir: Path, rank: int, failure: dict[str, Any]) -> None:
    """In the rank: how it failed, written over the room reserved for it (no new block needed
    where that room was taken); the first report stays."""
    global _reported
    if _reported:
        return
    _reported = True
    report = {"at": time.time(), **failure}
    if len(str(report.get("error", ""))) > ERROR_CHARS:
        report["error"] = str(report["error"])[:ERROR_CHARS - 1] + "…"
    if len(json.dumps(report)) >= REPORT_BYTES:  # e.g. a long list of ranks: the words suffice
        report = {k: report[k] for k in ("at", "failed_rank", "error") if k in report}
    while len(json.dumps(report)) >= REPORT_BYTES:  # escaped characters take up to 6 bytes
        error = str(report["error"])
        report["error"] = error[:len(error) // 2] + "…"
    data = json.dumps(report).encode().ljust(REPORT_BYTES - 1) + b"\n"
    path = failure_report_path(run_dir, rank)
    with contextlib.suppress(OSError):
        fd = safe_paths.open_file(run_dir, _failure_report(rank), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        # Written in place, which leaves the folder's time as it was: the head looks for news
        # when that time moves (`runner.cli.mpijob`), so move it.
        os.utime(path.parent)


def read_failure_reports(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The ranks' failure reports by rank (blank reservations and torn reads are skipped)."""
    reports: dict[int, dict[str, Any]] = {}
    try:
        paths = list((Path(run_dir) / RANKS_DIR).glob("failure-*.json"))
    except OSError:
        return reports
    for path in paths:
        try:
            report = json.loads(_read_record(path))
            reports[int(path.stem.split("-", 1)[1])] = report
        except (OSError, ValueError, IndexError):
            continue
    return {rank: r for rank, r in reports.items() if isinstance(r, dict)}


def rank_record_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank{rank}.json"


def read_rank_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The supervisors' records by rank (records being replaced are read whole or not at all)."""
    records: dict[int, dict[str, Any]] = {}
    folder = Path(run_dir) / RANKS_DIR
    try:
        paths = list(folder.glob("rank*.json"))
    except OSError:
        return records
    for path in paths:
        try:
            record = json.loads(_read_record(path))
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return records


def _die_with_parent(parent: int) -> None:
    """In the rank: be killed if the supervisor goes (Linux), so no rank outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it went before the request was in place
        os._exit(1)


# -- the head's end -----------------------------------------------------------------------------

def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot; a reused pid has another), None when there is
    no such process or it has ended (a zombie)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _machine() -> str | None:
    """Which kernel and pid namespace this process sees pids in (None: no /proc)."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    if boot is None or _start_time(os.getpid()) is None:  # a /proc of another namespace
        return None
    return f"{boot}/{namespace}"


def head_identity() -> str | None:
    """This process, as the supervisors of a job it starts find it (`HEAD_ENV`'s value): a pid
    alone may be reused, a pid with its start time is not; the boot and pid namespace tell
    which supervisors can see it. None where there is no /proc (nothing is watched)."""
    machine, started = _machine(), _start_time(os.getpid())
    if machine is None or started is None:
        return None
    return f"{machine}:{os.getpid()}:{started}"


def watched_head(value: str | None) -> tuple[int, str] | None:
    """The head's pid and start time from `HEAD_ENV`'s value, when this process sees the same
    pids (same boot and pid namespace); else None (not ours to watch)."""
    if not value:
        return None
    try:
        machine, pid, started = value.rsplit(":", 2)
        return (int(pid), started) if machine == _machine() else None
    except ValueError:
        return None


def _log_line(run_dir: Path, rank: int, message: str, level: str = "ERROR",
              console: bool = True) -> None:
    """One line in the rank's log (its format) and (`console`) on stderr, from the
    supervisor."""
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank{rank} {level} {message}\n"
    with contextlib.suppress(OSError):  # from the run directory, no link followed
        fd = safe_paths.open_file(run_dir, f"logs/rank{rank}.log",
                                  os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, create_dirs=True)
        with os.fdopen(fd, "a") as file:
            file.write(line)
    if not console:
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"[rank {rank}] {message}\n")
        sys.stderr.flush()


def _watch_head(head: tuple[int, str], child: int, reaped: threading.Event, run_dir: Path,
                rank: int) -> None:
    """In a thread of the supervisor: once the head is gone, stop the rank, then kill it."""
    pid, started = head
    while _start_time(pid) == started:
        if reaped.wait(HEAD_POLL_S):
            return
    _log_line(run_dir, rank, f"the head (pid {pid}) is gone: rank {rank} stops, and is killed "
                             f"if it has not ended {HEAD_GONE_GRACE_S:g} s from now")
    with contextlib.suppress(OSError):
        os.kill(child, signal.SIGTERM)  # the stop the head would have asked for: a checkpoint
    if not reaped.wait(HEAD_GONE_GRACE_S):
        _log_line(run_dir, rank, f"rank {rank} had not stopped {HEAD_GONE_GRACE_S:g} s after "
                                 f"its head went: killed")
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)  # not reaped yet: still this rank's pid


def _exit_like(status: int) -> int:
    """End the supervisor as the rank ended: MPICH cleans up at once after a rank killed by a
    signal (a non-zero exit before MPI init, on the other hand, leaves the others waiting)."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                import resource

                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core of the supervisor
            except (ImportError, ValueError, OSError):
                pass
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum  # the signal is ignored or blocked: say it anyway
    return os.waitstatus_to_exitcode(status)


def supervise(run_dir: Path, rank: int) -> int | None:
    """Fork the rank. Returns None in the rank (go on and train), the exit code in the
    supervisor after the rank ended."""
    global _supervised, _finished_fd
    safe_paths.register_root(run_dir)  # what the rank and this process write stays inside it
    parent = os.getpid()
    adopt_orphans()  # what the rank starts stays below this process, even once orphaned
    finished_r, finished_w = os.pipe()
    child = os.fork()
    if child == 0:
        _supervised = True
        os.close(finished_r)
        _finished_fd = finished_w
        _die_with_parent(parent)
        return None
    os.close(finished_w)
    for signum in _RANK_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    path = rank_record_path(run_dir, rank)
    record: dict[str, Any] = {"rank": rank, "pid": child, "supervisor_pid": parent,
                              "launcher_pid": os.getppid(), "host": socket.gethostname(),
                              "started": time.time()}
    try:
        safe_paths.make_dir(run_dir, RANKS_DIR)
        write_json(path, record)
    except OSError:
        pass  # the head then knows less, nothing more
    reaped = threading.Event()
    head = watched_head(os.environ.get(HEAD_ENV))
    if head is not None:
        threading.Thread(target=_watch_head, args=(head, child, reaped, run_dir, rank),
                         name="gridrun-head-watch", daemon=True).start()
    _, status = os.waitpid(child, 0)  # exact: which rank died first is told from these times
    reaped.set()
    record["ended"] = time.time()
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit_code"] = os.waitstatus_to_exitcode(status)
    record["finished"] = _told_finished(finished_r)
    left = _end_left_behind(run_dir, rank)
    if left:
        record["left_behind"] = left
    with contextlib.suppress(OSError):
        write_json(path, record)
    return _exit_like(status)


def _end_left_behind(run_dir: Path, rank: int) -> list[int]:
    """Kill what the rank left running (its orphans were reparented here), and say so in the
    rank's log; the pids killed."""
    left = descendants([os.getpid()])
    if not left:
        return []
    shown = ", ".join(f"{pid} ({_command(pid)})" for pid in left[:5])
    more = f" and {len(left) - 5} more" if len(left) > 5 else ""
    killed = end_processes(left)
    reap_children()
    _log_line(run_dir, rank, f"rank {rank} ended and left processes running: {shown}{more}: "
                              f"killed", level="WARNING", console=False)
    return killed


def _command(pid: int) -> str:
    """A process's command line, short, for a log line."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = " ".join(w.decode(errors="replace") for w in words if w)
    return text if len(text) <= 80 else text[:79] + "…"
