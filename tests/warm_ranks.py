"""The suite's ranks without an interpreter start and torch's import per rank.

A rank spends 3.5-6 s of CPU on 2 cores importing torch, the runner and the transformers
library before it does anything, and the suite starts some 350 of them (a command-line run has
2 or 4, a check script 2 to 4): most of the suite's time. Here one server per session imports
those modules once; every rank is forked from it, fresh, as `tests.heads` forks the heads.

How a rank gets here: the heads the suite forks (`tests.heads`), its user-started jobs
(`run_cli(mpi_ranks=...)`) and its check scripts (`run_mpi_script`) name `python()` as the
interpreter; for a head, that is its `sys.executable`, which it gives the launcher (beside it
lies the bundled `mpiexec`). `python()` is a stub (`tests.warm_stub`): the launcher starts it as
it would start Python, and it asks this server to fork the process with the stub's standing
(descriptors, environment, directory, signals), relays signals to it and ends as it ended. So a
launcher, a head and a supervisor see the process tree they would (the stub is the rank's
process to them), with one difference: the forked process is not below the stub but below the
server, in a session of its own. The tests of that tree itself (who is killed when, what is left
behind) mark themselves `fresh_ranks` and get real interpreters.

GRIDRUN_TEST_FRESH_RANKS=1: every rank a fresh interpreter, as a launcher starts it without the
suite.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from runner.records.process import adopt_orphans, children_by_parent, end_process, exit_code
from tests.warm_stub import kept_standing

FRESH_RANKS = os.environ.get("GRIDRUN_TEST_FRESH_RANKS") == "1"
ROOT = Path(__file__).resolve().parents[1]
STUB_SOURCE = Path(__file__).with_name("warm_stub.py")

# What a rank or a check script imports before it trains (a module not installed is skipped).
# Not a module a command runs itself (`-m runner.cli.worker`): runpy would warn that it was
# imported already.
PRELOAD = ["torch", "mpi4py", "numpy", "runner.records.process", "runner.training.mpienv",
           "runner.training.supervisor", "runner.training.rank",
           "runner.training.loop", "runner.training.assembly", "runner.training.devices",
           "runner.core", "runner.core.torchdist", "runner.checkpoint.write",
           "runner.config.schema",
           "runner.zoo", "strategies", "omegaconf",
           "transformers", "transformers.conversion_mapping",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.vit.modeling_vit", "transformers.models.bert.modeling_bert"]
_started: tuple[subprocess.Popen[bytes], str] | None = None
_fresh_default = False
_unavailable = False  # the server could not start: every rank fresh


def use_fresh_ranks(fresh: bool) -> None:
    """From now on (a `fresh_ranks` test, until its end), ranks started by fresh interpreters."""
    global _fresh_default
    _fresh_default = fresh


def python() -> str:
    """The interpreter the suite's ranks are started with: the stub, the server started on
    first use; the real one under GRIDRUN_TEST_FRESH_RANKS=1 or in a `fresh_ranks` test."""
    global _started, _unavailable
    if FRESH_RANKS or _fresh_default or _unavailable:
        return sys.executable
    if _started is None:
        _started = _start_server()
        if _started is None:
            _unavailable = True
            return sys.executable
    return _started[1]


def _start_server() -> tuple[subprocess.Popen[bytes], str] | None:
    """The server and its stub; None, said on standard error, where it cannot be (a path a
    shebang or a socket cannot hold, a server that did not start): ranks are then fresh."""
    if any(c.isspace() for c in sys.executable) or len(sys.executable) > 200:
        sys.stderr.write(f"warm ranks: {sys.executable!r} cannot be a shebang's interpreter; "
                         f"every rank is a fresh interpreter\n")
        return None
    folder = Path(tempfile.mkdtemp(prefix="gridrun-warm-", dir="/tmp"))  # a socket's path is
    sock = folder / "server.sock"  # at most 107 bytes
    stub = folder / "python"
    source = STUB_SOURCE.read_text()
    source = source.replace('REAL = "/usr/bin/python3"', f"REAL = {sys.executable!r}", 1)
    source = source.replace('SOCKET = ""', f"SOCKET = {str(sock)!r}", 1)
    stub.write_text(f"#!{sys.executable} -IS\n{source}")
    stub.chmod(0o755)
    # the bundled MPI beside it, as beside the real interpreter (mpiexec finds its proxy beside
    # itself)
    beside = [path for path in Path(sys.executable).parent.iterdir()
              if path.name.startswith(("mpiexec", "mpirun", "hydra_"))]
    for path in beside:
        (folder / path.name).symlink_to(path)
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no thread pool in the process that forks
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.warm_ranks", str(sock), str(torch.get_num_threads())],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert server.stdout is not None
    line = server.stdout.readline()
    if line.strip() != b"ready":
        sys.stderr.write(f"warm ranks: the server did not start ({line!r}); every rank is a "
                         f"fresh interpreter\n")
        server.kill()
        server.wait()
        return None

    def stop() -> None:
        assert server.stdin is not None
        server.stdin.close()  # the server ends on its standard input's end
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        for path in (stub, sock, *(folder / path.name for path in beside)):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()

    atexit.register(stop)
    return server, str(stub)


# -- the server ----------------------------------------------------------------------------------

def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    with contextlib.suppress(OSError):
        conn.sendall(struct.pack("!I", len(body)) + body)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 256)
    if len(data) < 4:
        raise OSError("short request")
    (size,) = struct.unpack("!I", data[:4])
    body = data[4:]
    while len(body) < size:
        part = conn.recv(size - len(body))
        if not part:
            raise OSError("request cut short")
        body += part
    return json.loads(body), fds


def _refusal(request: dict[str, Any], own: dict[str, Any]) -> str | None:
    for key in ("namespaces", "cgroup", "limits", "ids"):
        if request.get(key) != own[key]:
            return f"another {key}"
    return None


def _positive(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _fresh_threads(default: int) -> int:
    """The threads torch's import gives a fresh process in this environment: OMP_NUM_THREADS,
    else one under an MPI launcher that says how many ranks share the node (MPI_LOCALNRANKS),
    else the machine's default."""
    configured = _positive("OMP_NUM_THREADS")
    if configured is not None:
        return configured
    return 1 if _positive("MPI_LOCALNRANKS") is not None else default


def _become(request: dict[str, Any], fds: list[int], threads: int) -> None:
    """In the forked process: the stub's standing, then its command, to the end."""
    os.setsid()
    # the stub's descriptors at their numbers, nothing of the server's
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 4096) for fd in fds]
    os.closerange(0, 4096)
    for target, fd in zip(request["fds"], moved, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.sched_setaffinity(0, request["affinity"])
    for signum in range(1, signal.NSIG):
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        ignored = bool(request["ignored"] & (1 << (signum - 1)))
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_IGN if ignored else default)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    import torch

    torch.set_num_threads(_fresh_threads(threads))
    if os.environ.get("PYTHONUNBUFFERED") and isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(write_through=True)  # as -u: every write passed on
    sys.executable = request["executable"]
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    end_process(code)  # as the interpreter's exit: atexit, MPI finalised, C's exit


class _Server:
    def __init__(self, path: str, threads: int) -> None:
        self.threads = threads
        self.own = kept_standing()  # the stub's own must equal it
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(64)
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_w, False)
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "reap")
        self.selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
        self.by_pid: dict[int, socket.socket | None] = {}

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    self._accept()
                elif key.data == "reap":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_r, 4096)
                    self._reap()
                elif key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        self._end()
                        return
                else:
                    self._client_event(key.fileobj, key.data)  # type: ignore[arg-type]

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            return
        refusal = _refusal(request, self.own)
        if refusal is not None:
            for fd in fds:
                os.close(fd)
            _send(conn, {"refused": refusal})
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                self.selector.close()
                self.listener.close()
                for other in self.by_pid.values():
                    if other is not None:
                        other.close()
                conn.close()
                os.close(self.wakeup_r)
                os.close(self.wakeup_w)
                _become(request, fds, self.threads)
            finally:
                os._exit(70)
        for fd in fds:
            os.close(fd)
        _send(conn, {"pid": pid})
        self.by_pid[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _client_event(self, conn: socket.socket, pid: int) -> None:
        """The stub ended (its launcher killed it): so does what it asked for."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if data:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        self.selector.unregister(conn)
        conn.close()
        self.by_pid[pid] = None

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid not in self.by_pid:
                continue  # an orphan ended below
            conn = self.by_pid.pop(pid)
            if conn is not None:
                _send(conn, {"status": status})
                self.selector.unregister(conn)
                conn.close()
            self._end_orphans()

    def _end_orphans(self) -> None:
        """What a forked process left running once it ended (reparented here: this process
        adopts orphans), as a head ends what a job left."""
        for pid in children_by_parent().get(os.getpid(), []):
            if pid not in self.by_pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    def _end(self) -> None:
        for pid in list(self.by_pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _serve(path: str, threads: int) -> None:
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # MPI is initialised by each forked process (importing mpi4py.MPI does it)
    assert "mpi4py.MPI" not in sys.modules, "a preloaded module imports mpi4py.MPI"
    gc.collect()
    gc.freeze()  # what the imports made stays out of the forked processes' collections
    adopt_orphans()
    server = _Server(path, threads)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    server.serve()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
