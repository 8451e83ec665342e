"""Writing inside a run directory without following links out of it.

A run directory may come from anyone (a colleague's, an archive, a sweep on a shared disk), and
a symbolic link in it where gridrun writes (`logs/`, `metrics.jsonl`, `report/`, ...) would
make gridrun write, truncate or create what the link points to. So every file gridrun writes
under a run directory is reached from the directory's own descriptor, one component at a time,
each opened with `O_NOFOLLOW` (the `openat` way: nothing can swap a component for a link
between a check and the write), and a link met on the way is refused by name (`LinkRefused`).
A file written in place must be a regular file (a FIFO would block the writer), checked on the
open descriptor before a byte is written; one with other hard links (another name for it may
lie outside) is first made the directory's own copy.

The root itself may be a link the user gave (`outputs/latest`): it is resolved once, when it
is first named (`register_root`); only what is inside it must not lead out. A path under no
registered root is reached through its parent directory as given.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path, PurePath

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

# absolute path as given -> its real path, resolved when it was registered (or first opened)
_roots: dict[str, str | None] = {}


class PathRefused(OSError):
    """A place in a run directory that gridrun does not write through; the message is the one
    line shown: the path and why."""

    def __init__(self, path: Path | str, why: str, code: int) -> None:
        super().__init__(code, why, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class LinkRefused(PathRefused):
    """A symbolic link where gridrun would write or make a folder."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(path, "a symbolic link: refused (gridrun writes only inside the run "
                               "directory)", errno.ELOOP)


class NotRegularRefused(PathRefused):
    """A FIFO, socket, device or directory where gridrun would write or read back a file."""

    def __init__(self, path: Path | str, what: str = "not a regular file") -> None:
        super().__init__(path, f"{what}: refused", errno.EINVAL)


def register_root(path: Path | str) -> None:
    """Make `path` a run directory root: files under it are reached from it without following
    links. Its own links are followed, once: later writes go where it led then."""
    key = os.path.abspath(path)
    if _roots.get(key) is None:
        _roots[key] = os.path.realpath(key) if os.path.isdir(key) else None


def locate(path: Path | str) -> tuple[Path, PurePath]:
    """The registered root `path` lies under (the deepest one) and the path inside it; a path
    under none: its parent directory and its name."""
    absolute = os.path.abspath(path)
    root = _enclosing(absolute)
    if root is None or root == absolute:
        return Path(absolute).parent, PurePath(Path(absolute).name)
    return Path(root), PurePath(os.path.relpath(absolute, root))


def _enclosing(absolute: str) -> str | None:
    """The deepest registered root that holds `absolute` (or is it)."""
    best = None
    for root in _roots:
        if (absolute == root or absolute.startswith(root.rstrip(os.sep) + os.sep)) \
                and (best is None or len(root) > len(best)):
            best = root
    return best


def _open_root(root: str, create: bool) -> int:
    """A descriptor of the root directory: walked from an enclosing root where one is
    registered (a sweep's job inside its sweep, a replay inside its run), else opened where it
    was resolved."""
    outer = _enclosing(os.path.dirname(root)) if root != os.path.dirname(root) else None
    if outer is not None:
        return _walk(_open_root(outer, create), Path(outer),
                     PurePath(os.path.relpath(root, outer)).parts, create)
    target = _roots.get(root) or root
    if create:
        os.makedirs(target, exist_ok=True)
    fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if root in _roots and _roots[root] is None:  # made just now: where it leads, from now on
        _roots[root] = os.path.realpath(target)
    return fd


def _refusal(parent: int, name: str, shown: Path, exc: OSError) -> OSError:
    """What an open of `name` in `parent` that failed means: a link met, or the system's own
    error naming the whole path."""
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            return LinkRefused(shown)
    if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing without blocking
        return NotRegularRefused(shown)
    return OSError(exc.errno, exc.strerror or str(exc), str(shown))


def _walk(fd: int, shown: Path, parts: tuple[str, ...], create: bool) -> int:
    """From the directory `fd` (closed here) down `parts`, each a directory that is no link
    (made where missing, when `create`): the last one's descriptor."""
    for part in parts:
        if part in ("", "."):
            continue
        shown = shown / part
        if part == "..":
            os.close(fd)
            raise PathRefused(shown, "'..': refused (gridrun writes only inside the run "
                                     "directory)", errno.EINVAL)
        try:
            try:
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: opened below
                    os.mkdir(part, 0o777, dir_fd=fd)
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            error = _refusal(fd, part, shown, exc)
            os.close(fd)
            raise error from None
        os.close(fd)
        fd = below
    return fd


def open_dir(root: Path | str, relative: PurePath | str = "", create: bool = False) -> int:
    """A descriptor of the directory `root/relative`, every component below `root` a directory
    that is no link (`LinkRefused` naming the first link); missing ones made when `create`.
    The caller closes it."""
    key = os.path.abspath(root)
    return _walk(_open_root(key, create), Path(key), PurePath(relative).parts, create)


@contextlib.contextmanager
def opened_dir(root: Path | str, relative: PurePath | str = "",
               create: bool = False) -> Iterator[int]:
    """`open_dir` as a context: the descriptor is closed on leaving."""
    fd = open_dir(root, relative, create)
    try:
        yield fd
    finally:
        os.close(fd)


def check_regular(fd: int, shown: Path | str) -> None:
    """`NotRegularRefused` (the descriptor closed) unless `fd` is a regular file."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularRefused(shown)


def open_file(root: Path | str, relative: PurePath | str, flags: int, mode: int = 0o666,
              create_dirs: bool = False) -> int:
    """`root/relative` opened with `flags` (`os.O_WRONLY | os.O_APPEND | os.O_CREAT`, ...),
    reached without following a link and refused unless it is a regular file (checked before
    it is truncated: `O_TRUNC` is applied once it passed). A file opened for writing that has
    other hard links (another name for it may lie outside the run directory, say a snapshot
    copied with `cp -al`) is first made this directory's own: copied and renamed over its
    name, the other names left as they were. The caller closes the descriptor."""
    relative = PurePath(relative)
    shown = Path(os.path.abspath(root)) / relative
    name, writes = relative.name, bool(flags & (os.O_WRONLY | os.O_RDWR))
    with opened_dir(root, relative.parent, create_dirs) as parent:
        for attempt in range(2):
            try:
                fd = os.open(name, (flags & ~os.O_TRUNC) | _FILE_FLAGS, mode, dir_fd=parent)
            except OSError as exc:
                raise _refusal(parent, name, shown, exc) from None
            check_regular(fd, shown)
            if not writes or os.fstat(fd).st_nlink == 1:
                break
            if attempt:  # linked again meanwhile
                os.close(fd)
                raise NotRegularRefused(shown, "a file with other hard links")
            _own_copy(fd, parent, name, shown, keep=not flags & os.O_TRUNC)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    if flags & os.O_TRUNC:
        os.ftruncate(fd, 0)
    return fd


def _own_copy(fd: int, parent: int, name: str, shown: Path, keep: bool) -> None:
    """Replace `name` in `parent` by a file of its own with the contents of `fd` (none unless
    `keep`), closing `fd`: the other names of the file keep theirs, untouched."""
    tmp = f".{name}.own{os.getpid()}"
    try:
        source = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=parent)  # fd may not read
        try:
            if (os.fstat(source).st_ino, os.fstat(source).st_dev) != \
                    (os.fstat(fd).st_ino, os.fstat(fd).st_dev):
                raise NotRegularRefused(shown, "replaced while it was opened")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)
            copy = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                           | os.O_CLOEXEC, stat.S_IMODE(os.fstat(fd).st_mode), dir_fd=parent)
            try:
                copied = 0
                while keep and (chunk := os.pread(source, 1 << 20, copied)):
                    _write_all(copy, chunk)
                    copied += len(chunk)
            finally:
                os.close(copy)
        finally:
            os.close(source)
        os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=parent)
        if isinstance(exc, PathRefused):
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(shown)) from exc
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd` (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_bytes(root: Path | str, relative: PurePath | str, limit: int) -> bytes:
    """At most `limit` bytes of the regular file `root/relative`, reached as `open_file`
    reaches it (for the few files gridrun reads back to rewrite them)."""
    fd = open_file(root, relative, os.O_RDONLY)
    with os.fdopen(fd, "rb") as file:
        return file.read(limit)


def replace_file(root: Path | str, relative: PurePath | str, data: bytes,
                 create_dirs: bool = False, sync: bool = True) -> None:
    """Write `data` to a new file beside `root/relative`, flush it to disk (unless not `sync`:
    a record that matters only while the job runs), and rename it over that name (readers
    never see a half-written file). A link in its place is refused, not replaced; a failed
    write removes the new file and raises an `OSError` naming the path."""
    relative = PurePath(relative)
    shown = Path(os.path.abspath(root)) / relative
    name, tmp = relative.name, f".{relative.name}.tmp{os.getpid()}"
    with opened_dir(root, relative.parent, create_dirs) as parent:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                raise LinkRefused(shown)
        try:
            with contextlib.suppress(FileNotFoundError):  # an earlier process's, same pid
                os.unlink(tmp, dir_fd=parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o666, dir_fd=parent)
            try:
                _write_all(fd, data)
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise OSError(exc.errno, exc.strerror or str(exc), str(shown)) from exc


def make_dir(root: Path | str, relative: PurePath | str) -> None:
    """The directory `root/relative` and any missing above it, none of them a link."""
    os.close(open_dir(root, relative, create=True))


def move(root: Path | str, source: PurePath | str, target: PurePath | str) -> None:
    """Rename `root/source` to `root/target` (a link is moved as the link itself, never
    followed); each one's folder reached without following links."""
    source, target = PurePath(source), PurePath(target)
    with opened_dir(root, source.parent) as src, opened_dir(root, target.parent) as dst:
        os.replace(source.name, target.name, src_dir_fd=src, dst_dir_fd=dst)


def remove(root: Path | str, relative: PurePath | str) -> None:
    """Remove the file (or link: the link, not what it points to) `root/relative`, if any."""
    relative = PurePath(relative)
    try:
        with opened_dir(root, relative.parent) as parent:
            os.unlink(relative.name, dir_fd=parent)
    except FileNotFoundError:
        pass


def remove_tree(root: Path | str, relative: PurePath | str) -> None:
    """Remove the directory `root/relative` and everything in it, without following a link
    (the links inside are removed as links; a link in its own place is refused). Missing:
    nothing to do."""
    relative = PurePath(relative)
    shown = Path(os.path.abspath(root)) / relative
    try:
        with opened_dir(root, relative.parent) as parent:
            if stat.S_ISLNK(os.stat(relative.name, dir_fd=parent,
                                    follow_symlinks=False).st_mode):
                raise LinkRefused(shown)
            with opened_dir(root, relative) as fd:
                _empty(fd)
            os.rmdir(relative.name, dir_fd=parent)
    except FileNotFoundError:
        pass


def _empty(fd: int) -> None:
    """Remove everything in the directory `fd`, links as links (as `shutil.rmtree` with
    `dir_fd` does from Python 3.11)."""
    with os.scandir(fd) as entries:
        names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, folder in names:
        if folder:
            below = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                _empty(below)
            finally:
                os.close(below)
            os.rmdir(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)


def fd_path(fd: int) -> str:
    """A path naming the open directory `fd` itself, for a library that takes only paths (a
    link swapped in under its name later is not followed: the path leads to this
    directory)."""
    return f"/proc/self/fd/{fd}"


def is_link(path: Path) -> bool:
    """Whether `path` is a symbolic link (not followed)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def refusal_on_the_way(root: Path | str, relative: PurePath | str) -> PathRefused | None:
    """The refusal a write to `root/relative` would meet on its existing part (a link on the
    way, or in its place), before anything is made; None when there is none."""
    fd = os.open(os.path.abspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = Path(os.path.abspath(root))
    try:
        for part in PurePath(relative).parts:
            shown = shown / part
            try:
                info = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if stat.S_ISLNK(info.st_mode):
                return LinkRefused(shown)
            if not stat.S_ISDIR(info.st_mode):
                return None  # the write itself says what it is
            below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)
    return None
