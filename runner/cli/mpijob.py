"""The head's watch over an MPI job it started: the ranks' supervisors
(`runner.training.supervisor`) record each rank's pid and how it ended, so a rank that died without
a word (SIGKILL, the OOM killer, a segfault) is named with its signal; a job the launcher does not
end by itself after a rank died is killed; no rank process outlives the job.

The head, not a rank, owns the job's end: once a rank reports a failure (its watchdog's timeout
among them, `runner.training.supervisor.report_failure`), the rank aborts the job itself, and
where that does not end it `KILL_GRACE_S` later (an MPI_Abort from a watchdog's thread can wait
minutes under MPICH while a peer is stuck, and a rank holding the GIL or sleeping in C is deaf to
any request), the head kills every process of the job: mpiexec and what is below it, supervisors,
ranks and whatever the user's code started, each stopped first so that none can fork or slip
out of reach (`runner.records.process.end_processes`). The head is a child subreaper while the
job runs, so orphans of a process that died are reparented to it and ended with the rest.

SIGINT or SIGTERM to the head asks the ranks to stop cleanly (they checkpoint); a second one
kills them. No Hydra here.

The head forwards SIGTERM whatever it got: mpiexec passes SIGTERM on to the ranks, SIGINT not
always (Slurm's srun only reports the job's state at a first Ctrl-C; MPICH's mpiexec passes it on,
with lines of its own). srun is the exception: on a SIGTERM of its own it kills the tasks at once
(Slurm 22.05), while it passes SIGUSR1 on: a job under srun is relayed SIGUSR1 (`relay`). So that
the ranks still say which signal the user sent, the head first writes its name to
`RUN_DIR/.ranks/stop-signal` (read by `runner.training.interrupt`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from runner.records import safe_paths
from runner.records.process import adopt_orphans, alive, descendants, end_processes, reap
from runner.records.rundir import RunDir, atomic_write_text
from runner.training.supervisor import (
    HEAD_ENV,
    RANKS_DIR,
    head_identity,
    read_failure_reports,
    read_rank_records,
    stop_signal_path,
)

POLL_S = 0.1
# After a rank died, the launcher's own clean-up gets this long before the head kills the job
# (MPICH needs ~40 ms after a SIGKILL; it never ends a job whose rank exited non-zero before
# MPI init: the others wait in MPI_Init for ever).
KILL_GRACE_S = 3.0
STOP_MESSAGE = "stopping: the ranks finish their step and write a checkpoint"
# The launchers of the jobs this process watches now: another job's launcher and what is below it
# are never taken for what one job left behind.
_LAUNCHERS: set[int] = set()
SECOND_STOP_KILLS = " (press Ctrl-C again to kill the job)"
WORKER_MODULE = "runner.cli.worker"  # how every rank is started: python -m runner.cli.worker RUN


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _workers_of(run_dir: Path) -> list[int]:
    """Every process on this host started as a rank of this run (`runner.cli.worker RUN_DIR`),
    and every fork of one that kept its command line, wherever it was reparented to (a fork
    that left its session while its ancestors were being killed is below none of them)."""
    if not Path("/proc").is_dir():
        return []
    marker, found = str(run_dir), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            argv = _cmdline(int(entry.name))
            if WORKER_MODULE in argv and marker in argv and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _last_logged_step(log: Path) -> int | None:
    """The last training step a rank logged (its log's `step N loss ...` lines)."""
    try:
        # from the run directory, no link followed, no FIFO waited on
        with os.fdopen(safe_paths.open_file(*safe_paths.locate(log), os.O_RDONLY), "rb") as file:
            file.seek(max(0, os.fstat(file.fileno()).st_size - 65536))
            tail = file.read().decode(errors="replace")
    except OSError:
        return None
    steps = re.findall(r"\bstep (\d+) loss\b", tail)
    return int(steps[-1]) if steps else None


def _unfinished(record: dict[str, Any]) -> bool:
    """A rank that exited with code 0 without having finished (`os._exit(0)` mid-run)."""
    return record.get("exit_code") == 0 and record.get("finished") is False


def _abnormal(record: dict[str, Any]) -> bool:
    return "ended" in record and (record.get("signal") is not None
                                  or record.get("exit_code", 0) != 0 or _unfinished(record))


@dataclass
class JobResult:
    """How an MPI job ended, as far as the head could tell."""

    exit_code: int
    failure: dict[str, Any] | None = None  # the rank that died first (failed_rank, error, ...)
    stop_signal: str | None = None  # the head was asked to stop (SIGINT/SIGTERM)
    killed: str | None = None  # why the head killed the job itself


class MPIJob:
    """One `mpiexec` job and its ranks, watched from the head. `relay`: the signal the launcher
    gets when the head is asked to stop (srun: SIGUSR1, which it forwards to the tasks; on a
    SIGTERM of its own it kills them). `second_kills`: a second stop request kills the job (in a
    Slurm job, Slurm ends it after its KillWait by itself)."""

    def __init__(self, command: list[str], run_dir: Path, env: dict[str, str],
                 relay: int = signal.SIGTERM, second_kills: bool = True) -> None:
        self.command, self.run_dir, self.env = command, Path(run_dir), env
        self.relay, self.second_kills = relay, second_kills
        self.records: dict[int, dict[str, Any]] = {}
        self.reports: dict[int, dict[str, Any]] = {}  # the ranks' failure reports
        self.vanished: list[dict[str, Any]] = []  # supervisors gone without a record
        self.stop_signal: str | None = None
        self.kill_requested = False
        self.process: subprocess.Popen[bytes] | None = None
        self._host = socket.gethostname()
        self._records_mtime: int | None = None
        self._read_at = 0.0

    def run(self) -> JobResult:
        self._remove_records()  # an earlier run's
        previous: dict[int, Any] = {}
        before = set(descendants([os.getpid()]))  # not this job's
        adopted = adopt_orphans()
        try:
            # Its own session: the terminal's Ctrl-C reaches the head alone, which asks the job
            # to stop once (mpiexec forwards SIGTERM to every rank) instead of the terminal and
            # the head both signalling it.
            # the ranks' supervisors watch it (runner.training.supervisor)
            identity = head_identity()
            env = self.env if identity is None else {**self.env, HEAD_ENV: identity}
            self.process = subprocess.Popen(self.command, env=env,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=stop_with_parent())
            _LAUNCHERS.add(self.process.pid)
            previous = self._install_handlers()
            if self.stop_signal is not None:  # asked (`on_signal`) before mpiexec started
                self._relay(self.stop_signal)
            killed = self._watch()
            code = self.process.returncode
            self._refresh(force=True)
            self._reap_leftovers(before)
        except BaseException:
            self.kill()  # whatever stops the head must not leave the job behind
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if self.process is not None:
                _LAUNCHERS.discard(self.process.pid)
            if not adopted and not _LAUNCHERS:
                adopt_orphans(False)
        failure = self._diagnose()
        self._remove_records()
        return JobResult(code, failure, self.stop_signal, killed)

    def _remove_records(self) -> None:
        """The supervisors' `.ranks/`, removed from the run directory without following a link
        (a link in its place is left alone: nothing outside is emptied)."""
        with contextlib.suppress(OSError):
            safe_paths.remove_tree(self.run_dir, RANKS_DIR)

    def _watch(self) -> str | None:
        assert self.process is not None
        failed_at: float | None = None
        while True:
            try:
                self.process.wait(timeout=POLL_S)
                return None
            except subprocess.TimeoutExpired:
                pass
            if self.kill_requested:
                self.kill()
                return f"killed at a second {self.stop_signal}"
            if failed_at is None and self._failure_seen():
                failed_at = time.monotonic()
            elif failed_at is not None and time.monotonic() - failed_at > KILL_GRACE_S:
                self.kill()
                return (f"the launcher had not ended the job {KILL_GRACE_S:g} s later: killed by "
                        f"gridrun")

    # -- what the supervisors say ----------------------------------------------------------

    def _refresh(self, force: bool = False) -> None:
        """Re-read the records and the failure reports when their directory changed (records
        are replaced by renames; a report moves the folder's time), and at least once a second
        (a file system whose times are coarse may not show a change)."""
        try:
            mtime = (self.run_dir / RANKS_DIR).stat().st_mtime_ns
        except OSError:
            return
        now = time.monotonic()
        if force or mtime != self._records_mtime or now - self._read_at > 1.0:
            self._records_mtime, self._read_at = mtime, now
            self.records = read_rank_records(self.run_dir)
            self.reports = read_failure_reports(self.run_dir)

    def _local(self, record: dict[str, Any]) -> bool:
        return record.get("host") == self._host  # pids on other nodes are not ours to check

    def _failure_seen(self) -> bool:
        self._refresh()
        # A report comes first: a rank that timed out reports, then aborts the job, which may
        # not end it (see the module's words).
        if self.reports or any(_abnormal(r) for r in self.records.values()):
            return True
        gone = [r for r in self.records.values() if "ended" not in r and self._local(r)
                and not alive(int(r["supervisor_pid"]))]
        if gone:
            self._refresh(force=True)  # it may have recorded its end just before exiting
            # Several at once: the launcher's clean-up came first, which of them went first is
            # not known (all are named).
            self.vanished = [r for r in gone if "ended" not in self.records.get(r["rank"], {})]
        return bool(self.vanished)

    def _diagnose(self) -> dict[str, Any] | None:
        """The rank that ended first without finishing, in the words of a summary: the first
        rank that reported how it failed, in its own words, unless another rank died before
        (the head needs those words when that rank could not write `summary.json`: a full
        disk)."""
        ended = sorted((r for r in self.records.values() if _abnormal(r)),
                       key=lambda r: r["ended"])
        reports = sorted(read_failure_reports(self.run_dir).values(),
                         key=lambda r: float(r.get("at", 0.0)))
        if reports and (not ended or float(reports[0].get("at", 0.0)) <= ended[0]["ended"]):
            return {k: v for k, v in reports[0].items() if k != "at"}
        if not ended and len(self.vanished) > 1:
            ranks = sorted(int(r["rank"]) for r in self.vanished)
            return {"failed_ranks": ranks, "error": (
                f"ranks {', '.join(map(str, ranks))} ended without a trace (their supervisors "
                f"were killed)")}
        record = ended[0] if ended else (self.vanished[0] if self.vanished else None)
        if record is None:
            return None
        rank, pid = int(record["rank"]), int(record["pid"])
        last = _last_logged_step(RunDir(self.run_dir).rank_log(rank))
        when = " before its first step" if last is None else f" at step ~{last + 1}"
        failure: dict[str, Any] = {"failed_rank": rank, "pid": pid}
        if "ended" not in record:
            what = (f"ended without a trace (its supervisor, pid {record['supervisor_pid']}, "
                    f"was killed)")
        elif record.get("signal") is not None:
            failure["signal"] = int(record["signal"])
            what = f"was killed by signal {failure['signal']} ({_signal_name(failure['signal'])})"
        else:
            failure["exit_code"] = int(record["exit_code"])
            what = f"exited with code {failure['exit_code']}"
        unfinished = " without finishing" if _unfinished(record) else ""
        failure["error"] = f"rank {rank} (pid {pid}) {what}{when}{unfinished}"
        return failure

    # -- signals and killing ---------------------------------------------------------------

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may; a head elsewhere is not at a terminal
        return {signum: signal.signal(signum, self.on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """A request to stop (a signal handler while the job runs)."""
        if self.stop_signal is not None:
            # asked twice: the poll loop kills the job at once
            self.kill_requested = self.second_kills
            return
        self.stop_signal = _signal_name(signum)
        self._relay(self.stop_signal)

    def _relay(self, name: str) -> None:
        print(STOP_MESSAGE + (SECOND_STOP_KILLS if self.second_kills else ""), file=sys.stderr,
              flush=True)
        if self.process is not None and self.process.poll() is None:
            self._tell_ranks(name)
            self.process.send_signal(self.relay)  # the launcher passes it on to every rank

    def _tell_ranks(self, name: str) -> None:
        """The signal the head got, for the ranks that get SIGTERM in its place (written before
        the SIGTERM is sent: a rank that gets it finds the file)."""
        path = stop_signal_path(self.run_dir)
        try:
            safe_paths.make_dir(self.run_dir, RANKS_DIR)
            atomic_write_text(path, json.dumps({"signal": name, "time": time.time(),
                                                "relayed_as": _signal_name(self.relay)}) + "\n")
        except OSError:
            pass  # the ranks then name the SIGTERM they got

    def _rank_pids(self) -> list[int]:
        """This job's rank processes on this host, supervisors first (so that none of them
        outlives its rank to record a death the head caused)."""
        local = [r for r in self.records.values() if self._local(r)]
        pids = [int(r[key]) for key in ("supervisor_pid", "pid") for r in local if key in r]
        marker = str(self.run_dir)
        recorded = [pid for pid in pids if alive(pid) and marker in _cmdline(pid)]
        return recorded + [pid for pid in _workers_of(self.run_dir) if pid not in recorded]

    def kill(self) -> None:
        """SIGKILL mpiexec and every process below it, and every rank process of this job on
        this host with what is below it (MPICH's Hydra puts each rank in a process group of its
        own: mpiexec's group is not enough; the user's code may leave any group)."""
        if self.process is None:
            return
        self._refresh(force=True)
        roots = [self.process.pid] if self.process.poll() is None else []
        killed = end_processes(roots + self._rank_pids())
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        reap(killed)

    def _reap_leftovers(self, before: set[int]) -> None:
        """After mpiexec ended: no process of this job may still run, neither a rank nor what
        a rank left (reparented to the head where its supervisor could not end it)."""
        others = _LAUNCHERS - {self.process.pid if self.process is not None else -1}
        theirs = set(others) | set(descendants(others))
        orphans = [pid for pid in descendants([os.getpid()])
                   if pid not in before and pid not in theirs]
        leftovers = end_processes(self._rank_pids() + orphans)
        reap(leftovers)


def stop_with_parent() -> Any:
    """A preexec function giving mpiexec SIGTERM when the head dies, however it dies (Linux):
    the ranks then stop cleanly rather than train on unwatched."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return preexec


