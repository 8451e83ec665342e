"""The run directory: the contract other tools read (docs/design.md, "Run directory").

    config.yaml        the fully resolved config the ranks ran
    metrics.jsonl      one JSON object per logged step
    summary.json       the outcome
    logs/rank<k>.log   each rank's log
    checkpoints/       sharded checkpoints
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import functools
import json
import os
import platform
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.records import safe_paths
from runner.records.rundir_files import load_json
from runner.records.safe_paths import PathRefused

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self) -> None:
        # what is written under it is reached from it without following links out of it
        safe_paths.register_root(self.path)

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def create(self, cfg: DictConfig) -> None:
        """Make the directory and write the resolved config (once, by the head or rank 0)."""
        safe_paths.make_dir(self.path, "logs")
        atomic_write_text(self.config, OmegaConf.to_yaml(cfg, resolve=True))

    def read_summary(self) -> dict[str, Any] | None:
        try:  # within bounds, and no FIFO waited on: it may be anyone's
            summary = load_json(self.summary)
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None


LOCK_FILE = ".lock"


class RunDirInUse(RuntimeError):
    """Another live run holds the run directory."""


class RunDirRefused(RunDirInUse):
    """The run directory holds a link (or a FIFO, a device) where the run would write: it is
    not taken, as one held by another run is not."""


# Where a run, a resume, a report or a replay writes in a run directory: folders (each entry
# inside them too) and files. A link there would lead the write out of the directory.
WRITTEN_FOLDERS = (".hydra", "logs", "checkpoints", ".ranks", "tensorboard", "report", "replays")
WRITTEN_FILES = (LOCK_FILE, "config.yaml", "metrics.jsonl", "summary.json", "slurm-job.sh",
                 "slurm-job.json")


def unsafe_place(run_dir: Path) -> str | None:
    """The first place in `run_dir` where a run would write through a link or into a file
    that is not a regular one, as the one line that refuses it (None: there is none). Checked
    before anything is written; the writes themselves never follow a link either
    (`runner.records.safe_paths`), this only says so before a rank has started."""
    def problem(path: Path, folder: bool) -> str | None:
        try:
            mode = path.lstat().st_mode
        except OSError:
            return None  # missing: made by the run
        if stat.S_ISLNK(mode):
            return str(safe_paths.LinkRefused(path))
        if not folder and not stat.S_ISREG(mode):
            return str(safe_paths.NotRegularRefused(path))
        return None

    run_dir = Path(run_dir)
    found = [problem(run_dir / name, False) for name in WRITTEN_FILES]
    for name in WRITTEN_FOLDERS:
        found.append(problem(run_dir / name, True))
        if found[-1] is None and (run_dir / name).is_dir():
            with contextlib.suppress(OSError):
                found.extend(problem(entry, entry.is_dir())
                             for entry in sorted((run_dir / name).iterdir())[:10_000])
    return next((line for line in found if line is not None), None)


class RunDirLock:
    """A run directory belongs to one run at a time: `RUN_DIR/.lock` holds the owner's pid,
    host and start time, under an exclusive `flock` that the kernel drops when the owner dies,
    however it dies (so a lock left by a killed run is stale and is taken over). Where the file
    system cannot `flock`, the pid is checked instead (on the same host; a lock of another host
    is honoured until it is removed by hand, but for one an earlier start of the same Slurm batch
    job left)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        self._made_directory = False

    def acquire(self) -> None:
        """Take the lock or raise `RunDirInUse` naming its owner (makes the directory); a
        link in the lock's place: `safe_paths.LinkRefused`."""
        self._made_directory = not self.path.parent.exists()
        safe_paths.make_dir(self.path.parent, "")
        while True:
            fd = safe_paths.open_file(self.path.parent, LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirInUse(self._in_use_message()) from None
            except OSError:  # no flock here (some network file systems): judge by pid, host
                owner = self._owner()
                if owner and not self._stale(owner):
                    os.close(fd)
                    raise RunDirInUse(self._in_use_message()) from None
            try:  # the owner may have removed the file between our open and our lock
                if os.lstat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
              **slurm_start()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        owner = self._owner()
        if owner is not None and owner.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                safe_paths.remove(self.path.parent, LOCK_FILE)
        os.close(self._fd)  # drops the flock
        self._fd = None
        if self._made_directory:  # nothing was run in it after all: leave nothing behind
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()  # only when empty

    def _owner(self) -> dict[str, Any] | None:
        try:
            owner = json.loads(safe_paths.read_bytes(self.path.parent, LOCK_FILE, 1 << 16)
                               or b"null")
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    @staticmethod
    def _stale(owner: dict[str, Any]) -> bool:
        mine = slurm_start()
        if (mine and owner.get("slurm_job") == mine["slurm_job"]
                and isinstance(owner.get("slurm_start"), int)
                and owner["slurm_start"] < mine["slurm_start"]):
            return True  # an earlier start of this Slurm job, which Slurm ended (a requeue)
        if owner.get("host") != socket.gethostname():
            return False
        try:
            os.kill(int(owner.get("pid", 0)), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, ValueError, OverflowError):
            return False
        return False

    def _in_use_message(self) -> str:
        owner = self._owner() or {}
        since = owner.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
            if isinstance(since, (int, float)) else ""
        return (f"the run directory {self.path.parent} is in use by another run (pid "
                f"{owner.get('pid', '?')} on {owner.get('host', '?')}{when}): choose another "
                f"hydra.run.dir, or wait for that run to end")


def slurm_start() -> dict[str, Any]:
    """Which start of which Slurm batch job this process belongs to (empty outside one): a
    lock an earlier start of the same job left is stale, on whichever node it ran."""
    job, restarts = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
    if not job or not restarts.isdigit():
        return {}
    return {"slurm_job": job, "slurm_start": int(restarts)}


_held: dict[Path, RunDirLock] = {}


def lock_run_dir(run_dir: Path) -> None:
    """Hold `run_dir` for this process until it exits (idempotent; `RunDirInUse` when another
    live run holds it)."""
    key = Path(run_dir).resolve()
    if key in _held:
        return
    safe_paths.register_root(run_dir)
    problem = unsafe_place(Path(run_dir))
    if problem is not None:
        raise RunDirRefused(problem)
    # made and written as named: inside an enclosing run directory (a replay's), no link on
    # the way is followed
    lock = RunDirLock(Path(os.path.abspath(run_dir)))
    try:
        lock.acquire()
    except PathRefused as exc:  # put there since it was checked
        raise RunDirRefused(str(exc)) from None
    if not _held:
        atexit.register(release_run_dirs)
    _held[key] = lock


def release_run_dir(run_dir: Path) -> None:
    lock = _held.pop(Path(run_dir).resolve(), None)
    if lock is not None:
        lock.release()


def release_run_dirs() -> None:
    for key in list(_held):
        release_run_dir(key)


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be a run's own directory (None: it can): the current directory
    (an empty `hydra.run.dir=`), or a directory that holds something other than a run."""
    if str(run_dir) in ("", "."):
        return ("hydra.run.dir is empty: the run would write into the current directory; name "
                "a directory of its own")
    too_long = _name_too_long(Path(run_dir))
    if too_long:
        return too_long
    resolved = Path(run_dir).resolve()
    for what, place in (("the current directory", Path.cwd().resolve()),
                        ("the file system root", Path(resolved.anchor))):
        if resolved == place:
            return f"hydra.run.dir={run_dir} is {what}: name a directory of its own for the run"
    if resolved.is_dir() and any(resolved.iterdir()) and not any(
            (resolved / name).exists() for name in ("config.yaml", ".hydra", LOCK_FILE)):
        return (f"hydra.run.dir={run_dir} holds files that are not a run's: name a new or an "
                f"earlier run's directory")
    return None


def _name_too_long(path: Path) -> str | None:
    """Why the file system cannot name `path` (None: it can): a part longer than its longest
    file name, or a whole path longer than its longest path (with room for the run's files)."""
    existing = nearest_existing(path.absolute())
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            return (f"hydra.run.dir: the name {part[:40]}... is {len(os.fsencode(part))} bytes "
                    f"long; this file system takes at most {name_max}")
    room = 64  # the longest name the run writes inside: checkpoints/step-…/rank-….pt
    if len(os.fsencode(str(path.absolute()))) + room > path_max:
        return (f"hydra.run.dir is {len(os.fsencode(str(path.absolute())))} bytes long; this "
                f"file system takes paths of at most {path_max} (with {room} for the run's "
                f"own files)")
    return None


def unwritable(path: Path) -> str | None:
    """Why a run directory cannot be made or written at `path` (None: it can): tried for real
    in its nearest existing ancestor, with a file made and removed again."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        return f"cannot make the run directory {path}: {existing} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"cannot write the run directory {path}: {exc.strerror or exc} ({existing})"
    return None


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a new directory would be made)."""
    while path != path.parent:
        try:
            if path.exists():
                break
        except OSError:  # a name too long to look up
            pass
        path = path.parent
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary name, flush it to disk, then rename: readers never see a
    half-written file, and a crash never leaves a complete name over incomplete contents. A
    failed write (a full disk) removes its temporary file and raises an `OSError` naming
    `path`; a link on the way inside its run directory, or in its place, is refused
    (`safe_paths.LinkRefused`)."""
    try:
        safe_paths.replace_file(*safe_paths.locate(path), text.encode())
    except PathRefused:
        raise
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


class MetricsWriter:
    """One JSON line per record, flushed, so a crash loses at most the last line. A new run
    starts a new file: rerunning into the same directory must not mix two runs' lines. A run
    resumed at step s keeps the lines up to s and continues after them (the lines of steps
    after s are dropped: those steps run again)."""

    def __init__(self, path: Path, continue_after: int | None = None) -> None:
        self.path = path
        root, relative = safe_paths.locate(path)  # no link followed, no FIFO opened
        if continue_after is not None and os.path.lexists(path):
            text = safe_paths.read_bytes(root, relative, -1).decode(errors="replace")
            kept = [line for line in text.splitlines()
                    if (step := _line_step(line)) is not None and step <= continue_after]
            atomic_write_text(path, "".join(f"{line}\n" for line in kept))
            self._fd = safe_paths.open_file(root, relative, os.O_WRONLY | os.O_APPEND)
        else:
            self._fd = safe_paths.open_file(root, relative,
                                            os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        """One line, whole or not at all: a write the disk cannot take whole is cut back to
        the end of the last line, and the error names the file."""
        line = (json.dumps(record) + "\n").encode()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = os.write(self._fd, line)
            if written != len(line):  # a short write: the disk filled up mid-line
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, end)
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from exc

    def close(self) -> None:
        os.close(self._fd)


def _line_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a crash


@functools.cache
def git_commit() -> str | None:
    """The project's commit, with '+dirty' when the working tree has changes: as this process
    first found it (the code it runs is the code it imported then; asked once, it spares each
    later run in the process two `git` processes, ~80 ms)."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(PROJECT_ROOT), *args], capture_output=True,
                                  text=True, timeout=5, check=True).stdout.strip()

        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    import torch

    info: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import mpi4py

        info["mpi4py"] = mpi4py.__version__
        if "mpi4py.MPI" in sys.modules:  # only ask a library that this process initialised
            from mpi4py import MPI

            info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        else:
            info["mpi"] = None  # a 1-process run does not use MPI
    except ImportError:
        info["mpi4py"] = info["mpi"] = None
    return info


def held_by_live_run(run_dir: Path) -> bool:
    """Whether a live run holds `run_dir`'s lock now (its `flock` is taken)."""
    try:  # neither a link followed nor a FIFO waited on
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops a lock taken here
    return False


COUNTED_BYTES = 64 << 20  # a metrics file up to this size is counted in lines


def earlier_records(run_dir: Path) -> list[str]:
    """What in `run_dir` records a run that trained (empty: nothing a new start could lose),
    each as a short phrase: metrics lines, an outcome, checkpoints."""
    directory, found = RunDir(Path(run_dir)), []
    try:  # a link or a FIFO in its place is no record (and is refused where it is written)
        fd = safe_paths.open_file(directory.path, "metrics.jsonl", os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if 0 < size <= COUNTED_BYTES:
                found.append(f"metrics.jsonl ({sum(1 for _ in f)} lines)")
            elif size:
                found.append(f"metrics.jsonl ({size / (1 << 20):,.0f} MiB)")
    except OSError:
        pass
    if directory.summary.is_file():
        summary: Any = None
        with contextlib.suppress(OSError, ValueError):  # within bounds: it may be anyone's
            summary = load_json(directory.summary)
        status = summary.get("status") if isinstance(summary, dict) else None
        found.append(f"summary.json ({status})" if isinstance(status, str) else "summary.json")
    for place in sorted(directory.path.glob("checkpoints*")):
        if place.is_dir() and any(place.iterdir()):
            found.append(f"{place.name}/")
    return found


def set_aside_earlier(run_dir: Path, names: tuple[str, ...] = ("config.yaml", "summary.json",
                                                              ".hydra")) -> Path | None:
    """Move what an earlier start left under `names` into `run_dir/earlier-<time>/` (a resume
    rewrites them: the earlier ones stay readable there). Returns that folder, or None when
    there was nothing to move."""
    present = [name for name in names if os.path.lexists(Path(run_dir) / name)]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with safe_paths.opened_dir(run_dir) as fd:  # renamed, never followed
        suffix = 1
        while True:
            name = f"earlier-{stamp}" + (f"-{suffix}" if suffix > 1 else "")
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
                break
            except FileExistsError:  # a folder, or anything else, of that name
                suffix += 1
        for moved in present:
            safe_paths.move(run_dir, moved, f"{name}/{moved}")
    return Path(run_dir) / name
