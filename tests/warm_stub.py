"""The interpreter the suite's ranks run (`tests.warm_ranks`): `STUB -m MODULE ARGS` or
`STUB SCRIPT ARGS` as `python` would run them, the process forked from the warm server instead.

Standard library only, started with `-I -S` (a few milliseconds). This process stays where the
launcher started it, as the launcher's child: it hands the server its whole standing (open file
descriptors, environment, directory, umask, ignored signals, CPU affinity), passes on every signal
it can catch to the forked process's group, and ends exactly as that process ended (its exit code,
or killed by its signal). Where the server is not there, or the process would not run as it does
here (another namespace, cgroup, uid or limit; a Slurm job; interpreter options), this becomes
the real interpreter (`exec`) and runs the command from the start.

The generated copy's first lines name REAL (the interpreter) and SOCKET (the server).
"""

import contextlib
import json
import os
import resource
import signal
import socket
import struct
import sys
from typing import NoReturn

REAL = "/usr/bin/python3"  # replaced in the generated copy
SOCKET = ""  # replaced in the generated copy

# What a launcher sends a rank's process group, passed on to the forked one's.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGQUIT, signal.SIGCONT, signal.SIGALRM)
MAX_FDS = 250  # what one message can carry (SCM_MAX_FD is 253)


def fallback() -> NoReturn:
    os.execv(REAL, [REAL, *sys.argv[1:]])


def runnable(args: list[str]) -> bool:
    """`-m MODULE ...` or `SCRIPT ...`: no interpreter option, which the server could not honour."""
    if not args:
        return False
    return (args[0] == "-m" and len(args) >= 2) or not args[0].startswith("-")


def standing(conn: socket.socket) -> tuple[dict, list[int]]:
    """What a process started here would have: the request and the descriptors it sends."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd != conn.fileno():
            try:
                os.fstat(fd)  # not the directory listdir had open
            except OSError:
                continue
            fds.append(fd)
    with open("/proc/self/status") as file:
        status = file.read()
    ignored = int(status.split("SigIgn:")[1].split()[0], 16)
    umask = os.umask(0)
    os.umask(umask)
    request = {"argv": sys.argv[1:], "executable": os.path.abspath(sys.argv[0]),
               "cwd": os.getcwd(), "env": dict(os.environ), "fds": sorted(fds),
               "umask": umask, "ignored": ignored, "affinity": sorted(os.sched_getaffinity(0)),
               **kept_standing()}
    return request, sorted(fds)


def kept_standing() -> dict:
    """What a process forked by the server keeps of the server's rather than takes from the
    request (its namespaces, cgroup, limits and ids): the server forks only where the stub's
    are the same (`tests.warm_ranks` calls this for its own)."""
    namespaces = {}
    for kind in ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup"):
        try:
            namespaces[kind] = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            namespaces[kind] = ""
    with open("/proc/self/cgroup") as file:
        cgroup = file.read()
    limits = {name: list(resource.getrlimit(getattr(resource, name)))
              for name in dir(resource) if name.startswith("RLIMIT_")}
    return {"namespaces": namespaces, "cgroup": cgroup, "limits": limits,
            "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(),
                    sorted(os.getgroups())]}


def read_message(conn: socket.socket) -> dict | None:
    header = b""
    while len(header) < 4:
        part = conn.recv(4 - len(header))
        if not part:
            return None
        header += part
    (size,) = struct.unpack("!I", header)
    body = b""
    while len(body) < size:
        part = conn.recv(size - len(body))
        if not part:
            return None
        body += part
    return json.loads(body)


def end_like(status: int) -> None:
    """End as the forked process ended."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


def main() -> None:
    args = sys.argv[1:]
    if (not runnable(args) or "SLURM_JOB_ID" in os.environ
            or len(os.listdir("/proc/self/fd")) > MAX_FDS):
        fallback()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError:
        conn.close()
        fallback()
    request, fds = standing(conn)
    # held until the forked process's pid is known: a signal sent once it runs (it may run
    # before the reply arrives) is forwarded, not taken by this process's default action
    forwarded = [s for s in FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)
    body = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], fds)
    reply = read_message(conn)
    if reply is None or "pid" not in reply:
        conn.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)  # exec keeps a blocked mask
        fallback()
    pid = reply["pid"]

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(pid, signum)  # the forked process leads a session and group of its own
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)  # before it made its group

    for signum in forwarded:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
    ended = read_message(conn)
    if ended is None:
        sys.stderr.write("warm rank server: gone before the process it forked ended\n")
        os._exit(1)
    end_like(ended["status"])


if __name__ == "__main__":
    main()
