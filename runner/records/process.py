"""A gridrun process's start and end, without the interpreter's overheads at either; and the
ending of what a run leaves running (below, "the processes a run leaves behind").

The start: importing torch and the plugins makes some 190,000 objects that the cyclic collector
tracks and that live as long as the process; at CPython's default thresholds each full
collection walks all of them again while they arrive: 0.3 s of the 2.1 s a rank or a head takes
to import (measured on 2 cores). `defer_full_collections` raises the full collection's
threshold while the process starts (the young generations are collected as usual, so cyclic
garbage is still freed); `start_up_done` moves what start-up made out of the collector's sight
(`gc.freeze`) and restores the thresholds, so that the full collections of a long run do not
walk torch's and the model's objects either. A process that never reaches `start_up_done` (bad
input, a dry run) ends soon, having collected its oldest objects less often.

The end: tearing down an interpreter that has imported torch costs 0.5–1 s (measured here:
1.5–1.7 s to exit after the imports of a head, 2.0–2.6 s with the teardown), paid by every rank
and by the head of every run and sweep job. By the time a gridrun process ends, everything it
wrote is closed or flushed (metrics, checkpoints, the summary), so `end_process` flushes the
standard streams, runs the `atexit` handlers (logging's flush among them), finalises MPI if this
process started it, and leaves through C's `exit`, which also flushes C's stdio (MPICH's
connection to its launcher: `os._exit` there makes mpiexec kill the job). Under a profiler or
tracer (cProfile, coverage) or with GRIDRUN_FULL_EXIT=1 the process exits normally, so their
reports are written.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from types import CodeType
from typing import Any, NoReturn


def exit_code(code: object) -> int:
    """What `sys.exit(code)` would exit with (a message is printed, as it would be)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# -- the user's code ending the process --------------------------------------------------------

class UserExit(BaseException):
    """`os._exit(code)` called by the user's code in the process that trains (`where`: the
    call's place), raised in its stead so that `run_rank` records it; a BaseException, as
    SystemExit is: the code's own `except Exception` does not stop it."""

    def __init__(self, code: int, where: str) -> None:
        super().__init__(code, where)
        self.code, self.where = code, where


# gridrun's own packages: a frame elsewhere runs the user's code (or a library's it calls)
_PACKAGE_DIRS = tuple(str(Path(__file__).resolve().parents[2] / name) + os.sep
                      for name in ("runner", "strategies"))


def code_place(code: CodeType, line: int | None) -> str:
    """'at FILE:LINE in NAME' (FILE relative to the working directory when it is below it)."""
    path = Path(code.co_filename)
    with contextlib.suppress(ValueError, OSError):
        path = path.resolve().relative_to(Path.cwd())
    name = getattr(code, "co_qualname", code.co_name)
    return f"at {path}:{line} in {name}"


def whose_code(code: CodeType) -> str:
    """Whose code a frame runs: the user's, or gridrun's own."""
    return "gridrun's code" if code.co_filename.startswith(_PACKAGE_DIRS) else "the user's code"


def _exit_status(code: object) -> tuple[int, str]:
    """What `sys.exit(code)` exits with, and a word on a code that is not a number."""
    if code is None:
        return 0, ""
    if isinstance(code, int):
        return code, ""
    text = str(code)
    return 1, f": {text[:200]!r}"


def exit_words(exc: SystemExit | UserExit) -> tuple[int, str]:
    """The exit status and what the user's code did, where: (5, "exited with code 5 (sys.exit
    in the user's code at nets.py:12 in Net.__init__)"); for any caller that ran the user's
    code and caught its exit."""
    if isinstance(exc, UserExit):
        status, said, how, where = exc.code, "", "os._exit", exc.where
    else:
        status, said = _exit_status(exc.code)
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None:
            how, where = "sys.exit", "in the user's code"
        else:
            source = traceback.extract_tb(tb, limit=1)[0].line or ""
            how = "raise SystemExit" if source.lstrip().startswith("raise") else "sys.exit"
            code = tb.tb_frame.f_code
            where = f"in {whose_code(code)} {code_place(code, tb.tb_lineno)}"
    return status, f"exited with code {status} ({how}{said} {where})"


# The full collection's threshold while a process starts: collections of the middle generation
# before the oldest is collected (CPython's default: 10).
_START_UP_FULL_THRESHOLD = 1000
_thresholds: tuple[int, int, int] | None = None


def defer_full_collections() -> None:
    """At the start of a gridrun process, before its heavy imports: full collections seldom
    until `start_up_done`."""
    global _thresholds
    if _thresholds is None:
        _thresholds = gc.get_threshold()
        gc.set_threshold(_thresholds[0], _thresholds[1], _START_UP_FULL_THRESHOLD)


def start_up_done() -> None:
    """What the process made to start (imports, the model) stays out of later collections;
    the collector's thresholds are CPython's again. Once per process; later calls do nothing."""
    global _thresholds
    if _thresholds is not None:
        gc.freeze()
        gc.set_threshold(*_thresholds)
        _thresholds = None


def end_process(code: object = 0) -> NoReturn:
    """End this process with `code` (as `sys.exit` takes it), skipping the teardown."""
    status = exit_code(code)
    if (sys.gettrace() is not None or sys.getprofile() is not None
            or os.environ.get("GRIDRUN_FULL_EXIT") == "1"):
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # mpi4py would at teardown, from a hook C's exit does not run
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        import ctypes

        ctypes.CDLL(None).exit(status)
    except (OSError, AttributeError):
        pass
    os._exit(status)


# -- the processes a run leaves behind ----------------------------------------------------------
#
# A rank's code may start processes of its own (a data server, a helper that daemonises), and a
# hung rank must be ended whatever it is doing. Signals to a process group miss whatever left the
# group (`setsid`), and a process whose parent dies is reparented to init, out of reach: so the
# processes that watch others (the head, each rank's supervisor) are made child subreapers, where
# orphans below them are reparented, and end what is below them by walking /proc (Linux; nothing
# is found elsewhere).

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
END_WAIT_S = 5.0  # how long processes ended with SIGKILL are waited for (and reaped)


def _prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def adopt_orphans(adopt: bool = True) -> bool:
    """Make this process (or no longer, `adopt=False`) the one that orphaned processes below it
    are reparented to, so that they stay below it (Linux's child subreaper). Returns whether
    it was one before; False where this is not supported."""
    prctl = _prctl()
    if prctl is None or not sys.platform.startswith("linux"):
        return False
    import ctypes

    was = ctypes.c_int(0)
    prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    prctl(_PR_SET_CHILD_SUBREAPER, int(adopt), 0, 0, 0)
    return bool(was.value)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie has)."""
    if Path("/proc/self").exists():
        fields = _stat_fields(pid)
        return fields is not None and fields[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's pid by its parent's, from one walk of /proc (empty without it)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return children
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None or len(fields) < 2 or fields[0] in ("Z", "X"):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(roots: Iterable[int]) -> list[int]:
    """Every live process below `roots`, from one walk of /proc."""
    children = children_by_parent()
    found: dict[int, None] = {}  # in the order found, each once
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = None
                todo.append(child)
    return list(found)


def end_processes(pids: Iterable[int], below: bool = True) -> list[int]:
    """SIGKILL `pids` and (`below`) every process below them. Each is stopped first (SIGSTOP)
    and the tree read again until nothing new appears: a stopped process neither forks nor
    leaves its children to be reparented out of reach while the others are found. Never this
    process. Returns the processes signalled."""
    me = os.getpid()
    stopped: list[int] = []
    roots = [pid for pid in pids if pid != me]
    for _ in range(50):  # a process forking as fast as it can is stopped within a few rounds
        found = roots + (descendants(roots + stopped) if below else [])
        new = [pid for pid in dict.fromkeys(found) if pid != me and pid not in stopped
               and alive(pid)]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        stopped += new
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return stopped


def reap(pids: Iterable[int], wait_s: float = END_WAIT_S) -> None:
    """Wait (up to `wait_s`) until `pids` have ended; those that are this process's children are
    reaped (no zombie left)."""
    waiting = list(pids)
    deadline = time.monotonic() + wait_s
    while waiting:
        still = []
        for pid in waiting:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    still.append(pid)
            except ChildProcessError:  # not a child of this process: watched in /proc
                if alive(pid):
                    still.append(pid)
            except OSError:
                continue
        waiting = still
        if not waiting or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def reap_children(wait_s: float = END_WAIT_S) -> None:
    """Wait (up to `wait_s`) for every child of this process to end, reaping each: for a process
    whose only children are those it ended (a supervisor at its end)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
