"""Reading a checkpoint, checked before anything is loaded from it (`Checkpoint`).

Only what the manifest names is read, and only within bounds: a shard is opened without
following a symlink, must be a regular file of the size recorded, and is hashed from the very
bytes that are then unpickled (`weights_only`, onto the host: `map_location="cpu"`). Damage is
one line naming the checkpoint, the file and the reason (`DamagedCheckpoint`). A checkpoint of
format 1 (before hashes) still loads, with a note that its contents were not verified.

Loading copies into each local tensor the intersection of its block with each stored block, so
a checkpoint written on one grid (rows, blocks, columns) resumes on another.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from runner.checkpoint.format import (
    BUFFERS,
    WHOLE_KINDS,
    Entry,
    Scalar,
    ShardRecord,
    block_text,
    manifest_problem,
    tensor_placement,
    tiling_problem,
)
from runner.checkpoint.layout import (
    MANIFEST,
    CheckpointError,
    DamagedCheckpoint,
    shard_file,
    short_name,
)
from runner.core.placement import Placement
from strategies.exchange.sparse_gradients import is_hot_row_tensor

_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))


# -- reading what a manifest names -----------------------------------------------------------

class _Refused(Exception):
    """Why a file of a checkpoint is not read (the caller names the checkpoint and the file)."""


def _not_regular(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    kind = next((name for test, name in kinds if test(mode)), "of an unknown type")
    return f"not a regular file ({kind}): refused"


def _open_regular(path: Path, size: int | None) -> tuple[BinaryIO, os.stat_result]:
    """The regular file `path`, opened without following a symlink and without waiting (a FIFO
    or a device in its place is refused at once, never read), and its status. `size`: the size
    the manifest records (a file of another size is refused before it is read)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise _Refused("missing") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # Linux, the BSDs: the last part links
            raise _Refused("a symbolic link: refused (only regular files inside the "
                           "checkpoint directory are read)") from None
        if exc.errno == errno.ENXIO:
            raise _Refused("not a regular file (a socket): refused") from None
        raise _Refused(f"cannot be opened ({exc.strerror})") from None
    file = open(fd, "rb", closefd=True)  # noqa: SIM115 (the caller's `with` closes it)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _Refused(_not_regular(status.st_mode))
        if size is not None and status.st_size < size:
            raise _Refused(f"truncated: {status.st_size} of {size} bytes")
        if size is not None and status.st_size > size:
            raise _Refused(f"{status.st_size} bytes where {size} were written: altered")
    except BaseException:
        file.close()
        raise
    return file, status


def _read_regular(path: Path, size: int | None = None) -> bytes:
    """The bytes of the regular file `path` (`_open_regular`), read whole."""
    file, _ = _open_regular(path, size)
    with file:
        data = file.read() if size is None else file.read(size + 1)
    if size is not None and len(data) != size:
        raise _Refused(f"{len(data)} bytes read where {size} were written: changed while read")
    return data


ShardIdentity = tuple[int, int, int]  # a file's inode, size and modification time (ns)


def _hash_regular(path: Path, size: int | None) -> tuple[ShardIdentity, str]:
    """The sha256 of the regular file `path` (`_open_regular`), read in pieces of 16 MiB, and
    its inode, size and time as it was hashed."""
    digest = hashlib.sha256()
    file, status = _open_regular(path, size)
    with file:
        while piece := file.read(16 << 20):
            digest.update(piece)
    return (status.st_ino, status.st_size, status.st_mtime_ns), digest.hexdigest()


def _load_problem(exc: Exception) -> str:
    """torch.load's multi-paragraph errors as the one reason that matters."""
    text = str(exc)
    if "Weights only load failed" in text:
        detail = (text.rsplit("WeightsUnpickler error:", 1)[-1]
                  if "WeightsUnpickler error:" in text else text.split("\n\n", 1)[-1])
        line = next((x.strip() for x in detail.splitlines() if x.strip()), "")
        return f"refused by weights_only loading: {line.split('. ')[0].rstrip('.')}"
    first = text.strip().split(". ")[0] or type(exc).__name__
    return f"not a readable shard ({type(exc).__name__}: {first})"


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(_read_regular(path / MANIFEST))
    except _Refused as exc:
        raise DamagedCheckpoint(path, MANIFEST, str(exc)) from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise DamagedCheckpoint(path, MANIFEST, f"not JSON ({exc})") from None
    problem = manifest_problem(manifest)
    if problem is not None:
        raise DamagedCheckpoint(path, MANIFEST, problem)
    return cast("dict[str, Any]", manifest)


# -- loading ---------------------------------------------------------------------------------

class Checkpoint:
    """A complete checkpoint whose manifest has been checked (its format, shard names confined
    to the directory, entries within their tensors' extents). Shard files are read when first
    needed, each verified as it is read (`read_shard`), and only the rows a rank asks for are
    copied out of them. Raises `DamagedCheckpoint` for a manifest that is not one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest: dict[str, Any] = _read_manifest(path)
        self.files: dict[str, list[Entry]] = {
            name: [Entry.from_json(item) for item in items]
            for name, items in self.manifest["files"].items()}
        self.entries = [(file, entry) for file, entries in self.files.items()
                        for entry in entries]
        self.scalars = [Scalar.from_json(item) for item in self.manifest.get("scalars", [])]
        self.records: dict[str, ShardRecord] = {
            name: ShardRecord(record["bytes"], record["sha256"])
            for name, record in self.manifest.get("shards", {}).items()}
        self._open: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def hashed(self) -> bool:
        """Its manifest records its shards' sizes and hashes (format 2 onwards)."""
        return int(self.manifest["format"]) >= 2

    @property
    def notes(self) -> list[str]:
        """What a resume from it should say besides where it starts."""
        if self.hashed:
            return []
        return [f"{short_name(self.path)}: format {self.manifest['format']} (written before shard "
                f"hashes): no hashes, its contents are not verified"]

    def _damaged(self, file: str, reason: str) -> DamagedCheckpoint:
        return DamagedCheckpoint(self.path, file, reason)

    def look_at_shards(self) -> None:
        """Cheap: every shard is there as a regular file of its recorded size (nothing read).
        Raises `DamagedCheckpoint`."""
        for name in self.files:
            record = self.records.get(name)
            try:
                status = os.lstat(self.path / name)
            except FileNotFoundError:
                raise self._damaged(name, "missing") from None
            except OSError as exc:
                raise self._damaged(name, f"cannot be examined ({exc.strerror})") from None
            if stat.S_ISLNK(status.st_mode):
                raise self._damaged(name, "a symbolic link: refused (only regular files "
                                          "inside the checkpoint directory are read)")
            if not stat.S_ISREG(status.st_mode):
                raise self._damaged(name, _not_regular(status.st_mode))
            if record is not None and status.st_size != record.size:
                how = "truncated: " if status.st_size < record.size else ""
                raise self._damaged(name, f"{how}{status.st_size} of {record.size} bytes")

    def read_shard(self, name: str) -> dict[str, torch.Tensor]:
        """One shard, verified: read whole (a regular file, no symlink), its bytes hashed
        against the manifest, unpickled from those same bytes with `weights_only` (tensors
        and plain containers, never arbitrary objects), and its tensors checked against the
        manifest's entries. Not kept (`_file` keeps what a rank loads from)."""
        if name not in self.files:
            raise self._damaged(name, "not a shard of this checkpoint")
        record = self.records.get(name)
        try:
            data = _read_regular(self.path / name, record.size if record else None)
        except _Refused as exc:
            raise self._damaged(name, str(exc)) from None
        if record is not None and hashlib.sha256(data).hexdigest() != record.sha256:
            raise self._damaged(name, "sha256 mismatch (damaged or altered since written)")
        try:
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises anything from pickle, zip and its own checks
            raise self._damaged(name, _load_problem(exc)) from None
        problem = self._payload_problem(name, payload)
        if problem is not None:
            raise self._damaged(name, problem)
        return cast("dict[str, torch.Tensor]", payload)

    def verify_shard(self, name: str) -> ShardIdentity:
        """One shard's bytes hashed against the manifest in pieces of 16 MiB (never held
        whole), for a tool that then maps the tensors it needs (`map_verified`): export.
        Raises `DamagedCheckpoint`."""
        if name not in self.files:
            raise self._damaged(name, "not a shard of this checkpoint")
        record = self.records.get(name)
        try:
            identity, digest = _hash_regular(self.path / name, record.size if record else None)
        except _Refused as exc:
            raise self._damaged(name, str(exc)) from None
        if record is not None and digest != record.sha256:
            raise self._damaged(name, "sha256 mismatch (damaged or altered since written)")
        return identity

    def map_verified(self, name: str, identity: ShardIdentity) -> dict[str, torch.Tensor]:
        """The tensors of a shard `verify_shard` checked, mapped from the file (`mmap`:
        pages are read as a tensor is touched, and given back when the mapping is dropped),
        `weights_only`; a file changed since it was hashed (another inode, size or time) is
        refused."""
        try:
            payload = torch.load(self.path / name, map_location="cpu", weights_only=True,
                                 mmap=True)
        except Exception as exc:  # torch raises anything from pickle, zip and its own checks
            raise self._damaged(name, _load_problem(exc)) from None
        after = os.lstat(self.path / name)
        if (after.st_ino, after.st_size, after.st_mtime_ns) != identity:
            raise self._damaged(name, "changed since it was verified")
        problem = self._payload_problem(name, payload)
        if problem is not None:
            raise self._damaged(name, problem)
        return cast("dict[str, torch.Tensor]", payload)

    def _payload_problem(self, name: str, payload: Any) -> str | None:
        if not isinstance(payload, dict):
            return f"holds a {type(payload).__name__}, not a dict of tensors"
        for key, value in payload.items():
            if not (isinstance(key, str) and isinstance(value, torch.Tensor)
                    and value.layout == torch.strided):
                return f"item {key!r} is not a dense tensor"
        needed = ["rng", *(["sampler/generator", "sampler/order"]
                           if name == shard_file(0) else [])]
        for key in needed:
            if key not in payload:
                return f"no {key!r} tensor"
        rng = payload["rng"]
        if rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
            return "its 'rng' is not a random state of this PyTorch"
        for entry in self.files[name]:
            tensor = payload.get(entry.key)
            if tensor is None:
                return f"no tensor {entry.key}, which the manifest lists"
            if tuple(tensor.shape) != entry.stored_shape:
                return (f"tensor {entry.key} has shape {list(tensor.shape)}, the manifest "
                        f"says {list(entry.stored_shape)}")
        for scalar in self.scalars if name == shard_file(0) else ():
            tensor = payload.get(scalar.key)
            if tensor is None:
                return f"no tensor {scalar.key}, which the manifest lists"
            if tensor.dim() != 0:
                return (f"tensor {scalar.key} has shape {list(tensor.shape)}, the manifest "
                        f"says one value")
        return None

    def verify(self) -> None:
        """Every shard read and verified (`read_shard`), nothing kept. Raises
        `DamagedCheckpoint`."""
        for name in self.files:
            self.read_shard(name)

    def model_problem(self, shapes: Mapping[str, tuple[int, ...]],
                      buffers: Mapping[str, tuple[int, ...]] | None = None) -> str | None:
        """Why this checkpoint is not one of the model whose parameters have `shapes` and
        whose buffers `buffers` (by `state_dict` name): a tensor that is not one of them, or of
        another shape, or blocks that do not tile it exactly (weights and centre: every
        parameter)."""
        spans: dict[tuple[str, int | None, str], list[Placement]] = {}
        known = {**(buffers or {}), **shapes}
        for _, entry in self.entries:
            if is_hot_row_tensor(entry.name):
                continue  # a sharded table's hot-row replicas: no tensor of the sequential model
            shape = (buffers or {}).get(entry.name) if entry.kind == BUFFERS else \
                shapes.get(entry.name)
            if shape is None:
                return f"its {entry.kind} tensor {entry.name!r} is not a parameter of this model"
            if entry.shape != shape:
                return (f"{entry.name} has shape {list(entry.shape)} in the checkpoint and "
                        f"{list(shape)} in this model")
            spans.setdefault((entry.kind, entry.replica, entry.name), []).append(entry.place)
        for scalar in self.scalars:
            if scalar.name not in shapes and not is_hot_row_tensor(scalar.name):
                return (f"its {scalar.kind} value for {scalar.name!r} is not a parameter of "
                        f"this model")
        for (kind, _, name), blocks in spans.items():
            problem = tiling_problem(kind, name, known[name], blocks)
            if problem is not None:
                return problem
        whole = {(kind, replica) for kind, replica, _ in spans if kind in WHOLE_KINDS}
        if not any(kind == "model" for kind, _ in whole):
            return "it holds no model weights"
        for kind, replica in sorted(whole, key=str):
            missing = [name for name in shapes if (kind, replica, name) not in spans]
            if missing:
                return f"it has no {kind} tensor for {missing[0]}"
        return None

    def _file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._open:
            self._open[name] = self.read_shard(name)
        return self._open[name]

    def load_shards(self, names: Sequence[str]) -> None:
        """Read, verify and keep these shards for the reads that follow."""
        for name in names:
            self._file(name)

    def release(self) -> None:
        """Forget the shards read so far (a rank keeps none once it has loaded)."""
        self._open.clear()

    def has(self, kind: str) -> bool:
        return (any(entry.kind == kind for _, entry in self.entries)
                or any(scalar.kind == kind for scalar in self.scalars))

    def _covering(self, kind: str, replica: int | None, place: Placement,
                  optional: bool) -> list[tuple[str, Entry, Placement]]:
        """The entries holding parts of `place` for `kind` and `replica`, with the block of it
        each holds; an error when they do not cover it (`optional`: unless none does)."""
        found = []
        for file, entry in self.entries:
            if entry.kind != kind or entry.replica != replica or entry.name != place.name:
                continue
            if entry.shape != place.shape and is_hot_row_tensor(place.name):
                continue  # another number of hot rows: none for this run (the table is whole)
            if entry.shape != place.shape:
                raise CheckpointError(
                    f"checkpoint {self.path}: {place.name} has shape {list(entry.shape)} in "
                    f"the checkpoint and {list(place.shape)} in this model (a different model "
                    f"or dataset?)")
            shared = entry.place.intersection(place)
            if shared is not None:
                found.append((file, entry, shared))
        covered = sum(shared.area for _, _, shared in found)
        if covered != place.area and not (optional and covered == 0):
            raise CheckpointError(f"checkpoint {self.path}: no {kind} {block_text(place)} "
                                  f"of {place.name} (a different model?)")
        return found

    def files_for(self, kind: str, replica: int | None, places: Sequence[Placement],
                  optional: bool = False) -> set[str]:
        """The shards that `read_into` would read for these placements."""
        return {file for place in places
                for file, _, _ in self._covering(kind, replica, place, optional)}

    def read_into(self, kind: str, replica: int | None, place: Placement,
                  out: torch.Tensor, optional: bool = False) -> bool:
        """Copy block `place` (its rows, and columns) of `kind`'s tensor `place.name` into
        `out`, from each stored block its intersection with it; `optional`: False instead of
        an error when the checkpoint has none of it."""
        found = self._covering(kind, replica, place, optional)
        for file, entry, shared in found:
            stored = self._file(file)[entry.key]
            place.view(out, shared).copy_(entry.place.view(stored, shared))
        return bool(found)

    def read_states(self, kind: str, replica: int | None, like: Sequence[torch.Tensor],
                    optional: bool = True) -> list[torch.Tensor | None]:
        """`kind`'s values for tensors shaped and placed like the parameters `like`;
        `optional`: None for a parameter the optimizer kept no state for (else a parameter the
        checkpoint lacks is refused)."""
        out: list[torch.Tensor | None] = []
        for param in like:
            value = torch.empty_like(param.detach())
            found = self.read_into(kind, replica, tensor_placement(param), value, optional=optional)
            out.append(value if found else None)
        return out

    def read_scalars(self, kind: str, replica: int | None,
                     like: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """`kind`'s one value for each of the parameters `like` (by its global name; None where
        the checkpoint has none), each a copy of its own: every shard of a parameter is given
        one, and an optimizer updates it in place."""
        keys = {s.name: s.key for s in self.scalars if s.kind == kind and s.replica == replica}
        rank0 = self.rank_state(0)
        names = [tensor_placement(param).name for param in like]
        return [rank0[keys[name]].clone() if name in keys else None for name in names]

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        return self._file(shard_file(rank))
