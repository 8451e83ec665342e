"""Safetensors files, read by blocks and written as a stream, with no model held in memory.

`model.weights=PATH` starts a run from pretrained weights: each rank reads the header once
(`read_header`), then only the bytes of the rows it keeps of each tensor (`read_block`: one
positional read into a preallocated buffer). `python -m runner.export` writes a trained model
tensor by tensor, or a tensor in consecutive pieces of rows as it is assembled from shards
(`SafetensorsWriter`), and hashes the bytes as it writes them.

The format: 8 bytes, a little-endian u64 N; N bytes of UTF-8 JSON, an object that gives each
tensor's name, dtype, shape and data_offsets ([begin, end), counted from the start of the data
section) and optionally "__metadata__" (str -> str); then the data section, each tensor's bytes
row-major and little-endian. The header is padded with spaces so that the data section starts at
a multiple of 8. This module is written from that specification, not taken from the safetensors
package, so that every refusal is one line naming the file and the tensor (`WeightsFileError`).
Bytes are copied as they are: the hosts torch runs on are little-endian.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

METADATA_KEY = "__metadata__"
# A header larger than this is damage, not a model's index (the safetensors package's bound too).
MAX_HEADER_BYTES = 100 * 1024 * 1024
_LENGTH_BYTES = 8
_ALIGNMENT = 8
# What torch.save writes begins so: a zip archive (b"PK"), or, before zip, a pickle's protocol.
_TORCH_SAVE_STARTS = (b"PK", b"\x80")
# Symlinks are followed (a hub cache's weights are symlinks). O_NONBLOCK: a FIFO in the file's
# place is refused at once instead of waiting for a writer.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class WeightsFileError(ValueError):
    """A weights file refused: one line naming the file (its path as given), the tensor where it
    is about one, and what is wrong with it."""


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of `dtype` (`torch.float32` -> "F32")."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"safetensors files of gridrun cannot hold {dtype} "
                         f"(they hold {', '.join(map(str, DTYPES.values()))})") from None


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a file: its dtype and shape, and where its bytes lie (absolute offsets in
    the file: `begin` its first byte, `end` one past its last)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def row_count(self) -> int:
        """Rows of dim 0; a 0-d tensor is one row of one value."""
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        """The bytes of one row of dim 0 (all the later dims)."""
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass(frozen=True)
class SafetensorsHeader:
    """What a file's header says: its tensors in the header's order, its metadata, where the data
    section starts, and the file's size when the header was read."""

    path: Path
    tensors: dict[str, StoredTensor]
    metadata: dict[str, str]
    data_start: int
    file_size: int


# -- words for messages ----------------------------------------------------------------------

def _quoted(text: str) -> str:
    """Text from a file, quoted on one line: control characters escaped, long text cut."""
    shown = text if text.isprintable() else repr(text)[1:-1]
    return f"'{shown[:117]}...'" if len(shown) > 120 else f"'{shown}'"


def _path_shown(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if text.isprintable() else repr(text)[1:-1]


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as its key-value pairs, in order, duplicates kept (so they can be named)."""


def _plain(value: Any) -> Any:
    if isinstance(value, _Pairs):
        return {key: _plain(item) for key, item in value}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _described(value: Any) -> str:
    """A JSON value as a user would write it, on one line, at most 60 characters."""
    text = json.dumps(_plain(value))
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0  # JSON true is no count, nor is 3.0


def _truncated(shown: str, tensor: StoredTensor, file_size: int) -> WeightsFileError:
    return WeightsFileError(f"{shown}: truncated: the tensor {_quoted(tensor.name)} ends at byte "
                            f"{tensor.end} and the file has {file_size} bytes")


# -- reading ---------------------------------------------------------------------------------

def _open_regular(path: str | os.PathLike[str], shown: str) -> tuple[int, int]:
    """(descriptor, size) of the regular file `path`; anything else is refused."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise WeightsFileError(f"{shown}: no such file") from None
    except OSError as error:
        raise WeightsFileError(f"{shown}: cannot be opened ({error.strerror})") from None
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(status.st_mode) else "a device, FIFO or socket"
        raise WeightsFileError(f"{shown}: not a regular file ({kind}), so not a weights file")
    return fd, status.st_size


def _pread_all(fd: int, length: int, offset: int, shown: str) -> bytes:
    """Up to `length` bytes at `offset` (fewer only where the file ends first)."""
    chunks: list[bytes] = []
    done = 0
    try:
        while done < length:
            chunk = os.pread(fd, length - done, offset + done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
    except OSError as error:
        raise WeightsFileError(f"{shown}: cannot be read ({error.strerror})") from None
    return b"".join(chunks)


def _not_safetensors(shown: str, start: bytes, why: str) -> WeightsFileError:
    if start.startswith(_TORCH_SAVE_STARTS):
        form = "a zip archive" if start.startswith(b"PK") else "a pickle"
        return WeightsFileError(f"{shown}: a torch.save file, not safetensors (it starts as "
                                f"{form} does; convert it to safetensors first)")
    return WeightsFileError(f"{shown}: not a safetensors file ({why})")


def _header_json(fd: int, file_size: int, shown: str) -> tuple[_Pairs, int]:
    """The header's JSON object as pairs, and where the data section starts."""
    if file_size < _LENGTH_BYTES:
        raise WeightsFileError(f"{shown}: not a safetensors file (it has {file_size} bytes, fewer "
                               f"than the {_LENGTH_BYTES} that give its header's length)")
    start = _pread_all(fd, _LENGTH_BYTES, 0, shown)
    length = int.from_bytes(start, "little")
    if length > MAX_HEADER_BYTES or length > file_size - _LENGTH_BYTES:
        raise _not_safetensors(shown, start, "its first 8 bytes do not give a header length: "
                               f"they say {length} bytes and the file has {file_size}")
    raw = _pread_all(fd, length, _LENGTH_BYTES, shown)
    if len(raw) < length:
        raise WeightsFileError(f"{shown}: truncated while read: its header ends at byte "
                               f"{_LENGTH_BYTES + length} and the file has "
                               f"{_LENGTH_BYTES + len(raw)} bytes")
    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=_Pairs)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        reason = "UTF-8" if isinstance(error, UnicodeDecodeError) else "JSON"
        raise _not_safetensors(shown, start, f"its header is not {reason}") from None
    if not isinstance(parsed, _Pairs):
        raise _not_safetensors(shown, start, "its header is JSON but not an object: "
                               f"{_described(parsed)}")
    return parsed, _LENGTH_BYTES + length


def _metadata(shown: str, value: Any) -> dict[str, str]:
    if value is None:  # the reference reader takes a null as no metadata
        return {}
    if not isinstance(value, _Pairs):
        raise WeightsFileError(f"{shown}: its {METADATA_KEY} is {_described(value)}, not an "
                               "object of strings")
    metadata: dict[str, str] = {}
    for key, text in value:
        if key in metadata:
            raise WeightsFileError(f"{shown}: its {METADATA_KEY} names {_quoted(key)} twice")
        if not isinstance(text, str):
            raise WeightsFileError(f"{shown}: its {METADATA_KEY} gives {_quoted(key)} the value "
                                   f"{_described(text)}, not a string")
        metadata[key] = text
    return metadata


def _entry_fields(where: str, entry: Any) -> tuple[Any, Any, Any]:
    """dtype, shape and data_offsets of one tensor's entry (other keys are ignored, as the
    reference reader ignores them)."""
    if not isinstance(entry, _Pairs):
        raise WeightsFileError(f"{where} is described by {_described(entry)}, not by an object "
                               "with dtype, shape and data_offsets")
    fields = dict(entry)
    if len(fields) < len(entry):
        twice = next(key for i, (key, _) in enumerate(entry) if key in dict(entry[:i]))
        raise WeightsFileError(f"{where} has {_quoted(twice)} twice")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in fields]
    if missing:
        raise WeightsFileError(f"{where} has no {' and no '.join(missing)}")
    return fields["dtype"], fields["shape"], fields["data_offsets"]


def _stored_tensor(shown: str, name: str, entry: Any, data_start: int) -> StoredTensor:
    where = f"{shown}: the tensor {_quoted(name)}"
    dtype_text, shape, offsets = _entry_fields(where, entry)
    if not isinstance(dtype_text, str) or dtype_text not in DTYPES:
        given = _quoted(dtype_text) if isinstance(dtype_text, str) else _described(dtype_text)
        raise WeightsFileError(f"{where} has an unknown dtype {given} "
                               f"(gridrun reads {', '.join(DTYPES)})")
    if type(shape) is not list or not all(_is_count(size) for size in shape):
        raise WeightsFileError(f"{where} has the shape {_described(shape)}, not a list of "
                               "non-negative integers")
    if type(offsets) is not list or len(offsets) != 2 or not all(map(_is_count, offsets)) \
            or offsets[0] > offsets[1]:
        raise WeightsFileError(f"{where} has the data_offsets {_described(offsets)}, not "
                               "[begin, end] with 0 <= begin <= end")
    dtype = DTYPES[dtype_text]
    needed = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != needed:
        raise WeightsFileError(f"{where} ({dtype_text} of shape {shape}) takes {needed} bytes, "
                               f"but its data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return StoredTensor(name, dtype, tuple(shape), data_start + offsets[0],
                        data_start + offsets[1])


def _check_overlaps(shown: str, tensors: Mapping[str, StoredTensor]) -> None:
    """Refuses two tensors sharing bytes (gaps between tensors are allowed: nothing reads them)."""
    furthest: StoredTensor | None = None  # of the tensors before, the one that reaches furthest
    for tensor in sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.begin):
        if furthest is not None and tensor.begin < furthest.end:
            raise WeightsFileError(
                f"{shown}: the tensors {_quoted(furthest.name)} and {_quoted(tensor.name)} "
                f"overlap (bytes {furthest.begin}-{furthest.end} and {tensor.begin}-{tensor.end} "
                "of the file)")
        if furthest is None or tensor.end > furthest.end:
            furthest = tensor


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """The header of the safetensors file `path`, checked whole: every tensor's entry, its size
    against its dtype and shape, its bytes inside the file and apart from the others'. Reads the
    header only, never the data."""
    shown = _path_shown(path)
    fd, file_size = _open_regular(path, shown)
    try:
        pairs, data_start = _header_json(fd, file_size, shown)
    finally:
        os.close(fd)
    tensors: dict[str, StoredTensor] = {}
    metadata: dict[str, str] = {}
    seen: set[str] = set()
    for name, entry in pairs:
        if name in seen:
            raise WeightsFileError(f"{shown}: the header names {_quoted(name)} twice")
        seen.add(name)
        if name == METADATA_KEY:
            metadata = _metadata(shown, entry)
        else:
            tensors[name] = _stored_tensor(shown, name, entry, data_start)
    past_the_end = [t for t in tensors.values() if t.end > file_size]
    if past_the_end:
        raise _truncated(shown, max(past_the_end, key=lambda t: t.end), file_size)
    _check_overlaps(shown, tensors)
    return SafetensorsHeader(Path(path), tensors, metadata, data_start, file_size)


def _span(what: str, span: tuple[int, int] | None, size: int, where: str) -> tuple[int, int]:
    """[first, last) of `size` rows or columns; the whole when `span` is None."""
    if span is None:
        return 0, size
    first, last = span
    if not 0 <= first <= last <= size:
        raise ValueError(f"{where}: {what} [{first}, {last}) are not within its {size} {what}")
    return first, last


def _read_into(header: SafetensorsHeader, tensor: StoredTensor, buffer: torch.Tensor,
               offset: int) -> None:
    """Fills the uint8 `buffer` with the file's bytes from `offset`, in one positional read
    (more only where the system returns fewer bytes than asked)."""
    shown = _path_shown(header.path)
    fd, file_size = _open_regular(header.path, shown)
    try:
        # The header was read earlier: the file may have been cut or replaced since.
        if file_size < tensor.end:
            raise _truncated(shown, tensor, file_size)
        if file_size != header.file_size:
            raise WeightsFileError(f"{shown}: changed since its header was read (it had "
                                   f"{header.file_size} bytes and has {file_size})")
        view = buffer.numpy().data
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise _truncated(shown, tensor, offset + done)
            done += got
    except OSError as error:
        raise WeightsFileError(f"{shown}: cannot be read ({error.strerror})") from None
    finally:
        os.close(fd)


def read_block(header: SafetensorsHeader, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows [r0, r1) of dim 0 of the tensor `name` and, given `cols`, only its columns [c0, c1)
    of dim 1 (later dims whole): a new contiguous CPU tensor of the stored dtype. Reads the bytes
    of those rows only (whole rows: the columns are cut from them). A 0-d tensor is read whole
    (`rows` and `cols` None). Rows or columns outside the tensor are a ValueError."""
    shown = _path_shown(header.path)
    tensor = header.tensors.get(name)
    if tensor is None:
        raise WeightsFileError(f"{shown}: has no tensor {_quoted(name)} (it has "
                               f"{len(header.tensors)})")
    where = f"{shown}: the tensor {_quoted(name)} of shape {list(tensor.shape)}"
    if not tensor.shape and rows is not None:
        raise ValueError(f"{where} has no rows: it is read whole (rows=None)")
    if len(tensor.shape) < 2 and cols is not None:
        raise ValueError(f"{where} has no columns (dim 1)")
    first, last = _span("rows", rows, tensor.row_count, where)
    # bf16 and float8 have no numpy dtype: read bytes into a uint8 tensor and view it as stored.
    buffer = torch.empty((last - first) * tensor.row_bytes, dtype=torch.uint8)
    _read_into(header, tensor, buffer, tensor.begin + first * tensor.row_bytes)
    block = buffer.view(tensor.dtype).reshape((last - first, *tensor.shape[1:])
                                              if tensor.shape else ())
    if cols is None:
        return block
    col_first, col_last = _span("columns", cols, tensor.shape[1], where)
    return block[:, col_first:col_last].contiguous()


def read_rows_into(header: SafetensorsHeader, name: str, rows: tuple[int, int] | None,
                   out: torch.Tensor) -> bool:
    """Rows [r0, r1) of the tensor `name` (None: a 0-d tensor, whole) read straight into
    `out`'s memory, one copy from the file, no buffer between: where `out` is a contiguous
    CPU tensor of the stored dtype and the block's shape. False (nothing read) otherwise: the
    caller reads a block and copies it (`read_block`)."""
    tensor = header.tensors.get(name)
    if (tensor is None or out.device.type != "cpu" or not out.is_contiguous()
            or out.dtype != tensor.dtype or (rows is None) != (not tensor.shape)):
        return False
    first, last = (0, 1) if rows is None else rows
    if (tuple(out.shape) != ((last - first, *tensor.shape[1:]) if tensor.shape else ())
            or not 0 <= first <= last <= tensor.row_count):
        return False
    flat = out.detach().reshape(-1).view(torch.uint8) if out.numel() else None
    if flat is not None:
        _read_into(header, tensor, flat, tensor.begin + first * tensor.row_bytes)
    return True


# -- writing ---------------------------------------------------------------------------------

Layout = Sequence[tuple[str, torch.dtype, tuple[int, ...]]]


def _checked_metadata(shown: str, metadata: Mapping[str, str]) -> dict[str, str]:
    wrong = [key for key, value in metadata.items()
             if not isinstance(key, str) or not isinstance(value, str)]
    if wrong:
        raise ValueError(f"{shown}: metadata must map strings to strings; not so for "
                         f"{wrong[0]!r}")
    return dict(metadata)


def _planned_entries(shown: str, layout: Layout) -> dict[str, Any]:
    """The header's entries of `layout`: its order, the data offsets consecutive."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in layout:
        if not isinstance(name, str) or name == METADATA_KEY or name in entries:
            problem = "is named twice" if name in entries else "cannot be a tensor's name"
            raise ValueError(f"{shown}: the layout's {name!r} {problem}")
        if not all(_is_count(size) for size in shape):
            raise ValueError(f"{shown}: the tensor {_quoted(name)} has the shape {shape!r}, not "
                             "non-negative integers")
        nbytes = math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return entries


def _encoded_header(shown: str, layout: Layout, metadata: Mapping[str, str] | None
                    ) -> tuple[bytes, dict[str, Any]]:
    """The length and the header, space-padded so that the data starts at a multiple of 8, and
    the entries it holds."""
    entries = _planned_entries(shown, layout)
    document = dict(entries)
    if metadata is not None:
        document = {METADATA_KEY: _checked_metadata(shown, metadata), **entries}
    text = json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(_LENGTH_BYTES + len(text)) % _ALIGNMENT)
    if len(text) > MAX_HEADER_BYTES:
        raise ValueError(f"{shown}: a header of {len(text)} bytes, more than readers accept")
    return len(text).to_bytes(_LENGTH_BYTES, "little") + text, entries


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, row-major (a non-contiguous tensor is copied to be so)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


class SafetensorsWriter:
    """Writes a safetensors file as a stream, its layout known in advance.

    The header (every tensor's offsets, from `layout`, in its order) is written at once; then
    the tensors' data, in the layout's order, each either whole (`write(name, tensor)`) or in
    consecutive pieces of rows of dim 0 (`write_rows(name, start, rows)`, `start` the number of
    its rows written before), so a tensor assembled from shards is never held whole. Anything
    else (another tensor than the next, another shape or dtype, rows out of order) is a
    ValueError. The bytes go to PATH.partial, renamed to PATH by `close()` once every tensor is
    complete (a ValueError otherwise, and no file), so PATH is never a half-written model;
    `sha256` is the hash of every byte written. As a context manager it closes at the end, and
    on an exception removes the partial file."""

    def __init__(self, path: str | os.PathLike[str], layout: Layout,
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path = Path(path)
        self._shown = _path_shown(path)
        encoded, entries = _encoded_header(self._shown, layout, metadata)
        data_start = len(encoded)
        tensors = {name: StoredTensor(name, DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                      data_start + entry["data_offsets"][0],
                                      data_start + entry["data_offsets"][1])
                   for name, entry in entries.items()}
        file_size = max((t.end for t in tensors.values()), default=data_start)
        self.header = SafetensorsHeader(self.path, tensors, dict(metadata or {}), data_start,
                                        file_size)
        self._order = list(tensors.values())
        self._next = 0  # the tensor being written, by its place in the layout
        self._rows_done = 0  # of its rows, how many are written
        self._hash = hashlib.sha256()
        self._digest: str | None = None
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "wb")  # noqa: SIM115 (closed by close or __exit__)
        self._put(memoryview(encoded))

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._abandon()

    @property
    def sha256(self) -> str:
        """The sha256 (hex) of the whole file, known once it is closed."""
        if self._digest is None:
            raise ValueError(f"{self._shown}: the sha256 is known once the file is closed")
        return self._digest

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The whole tensor `name`, the next in the layout."""
        stored = self._expect(name, tensor)
        if tuple(tensor.shape) != stored.shape:
            raise ValueError(f"{self._shown}: the tensor {_quoted(name)} has the shape "
                             f"{list(tensor.shape)}; the layout says {list(stored.shape)}")
        if self._rows_done:
            raise ValueError(f"{self._shown}: the tensor {_quoted(name)} is partly written; "
                             f"continue it with write_rows from row {self._rows_done}")
        self._put_rows(stored, tensor)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Rows [start, start + len(rows)) of dim 0 of the tensor `name`: `start` is the number
        of its rows written so far (0 for its first piece)."""
        stored = self._expect(name, rows)
        where = f"{self._shown}: the tensor {_quoted(name)}"
        if not stored.shape:
            raise ValueError(f"{where} is 0-d: it has no rows; write it whole with write()")
        if rows.dim() != len(stored.shape) or tuple(rows.shape[1:]) != stored.shape[1:]:
            raise ValueError(f"{where} has rows of shape {list(stored.shape[1:])}; a piece of "
                             f"shape {list(rows.shape)} does not hold such rows")
        if start != self._rows_done:
            raise ValueError(f"{where}: its rows come in order: the next is row "
                             f"{self._rows_done}, not {start}")
        if start + rows.shape[0] > stored.shape[0]:
            raise ValueError(f"{where} has {stored.shape[0]} rows; rows [{start}, "
                             f"{start + rows.shape[0]}) go past them")
        self._put_rows(stored, rows)

    def close(self) -> None:
        """Renames the complete file into place; a ValueError (and no file) if any tensor is
        not complete. Closing again does nothing."""
        if self._digest is not None:
            return
        if self._file.closed:
            raise ValueError(f"{self._shown}: not written: the writer was abandoned")
        if self._next < len(self._order):
            pending = self._order[self._next]
            self._abandon()
            raise ValueError(
                f"{self._shown}: not written: the tensor {_quoted(pending.name)} has "
                f"{self._rows_done} of its {pending.row_count} rows, and "
                f"{len(self._order) - self._next - 1} tensors after it are missing")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)
        self._digest = self._hash.hexdigest()

    def _expect(self, name: str, tensor: torch.Tensor) -> StoredTensor:
        """The layout's tensor `name` if it is the one to write next, in the dtype given."""
        if self._file.closed:
            raise ValueError(f"{self._shown}: the writer is closed")
        if name not in self.header.tensors:
            raise ValueError(f"{self._shown}: the layout has no tensor {_quoted(name)}")
        if self._next == len(self._order) or self._order[self._next].name != name:
            expected = ("nothing more" if self._next == len(self._order)
                        else f"the tensor {_quoted(self._order[self._next].name)}")
            raise ValueError(f"{self._shown}: the tensor {_quoted(name)} out of order: the "
                             f"layout's order wants {expected} next")
        stored = self._order[self._next]
        if tensor.dtype != stored.dtype:
            raise ValueError(f"{self._shown}: the tensor {_quoted(name)} is {tensor.dtype}; "
                             f"the layout says {stored.dtype}")
        return stored

    def _put_rows(self, stored: StoredTensor, rows: torch.Tensor) -> None:
        self._put(_bytes_of(rows))
        self._rows_done += rows.shape[0] if rows.dim() else 1
        if self._rows_done == stored.row_count:
            self._next += 1
            self._rows_done = 0

    def _put(self, data: memoryview) -> None:
        self._file.write(data)
        self._hash.update(data)

    def _abandon(self) -> None:
        """Closes and removes the partial file: an incomplete model is never left behind."""
        self._file.close()
        self._partial.unlink(missing_ok=True)


def write_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str] | None = None) -> str:
    """Writes `tensors` (in their order) as the safetensors file `path`; returns its sha256."""
    layout = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    with SafetensorsWriter(path, layout, metadata) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    return writer.sha256
