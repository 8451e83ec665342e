"""What `model.weights=PATH` names, opened by its headers alone: a transformers directory
(`model.safetensors`, or the files of `model.safetensors.index.json`, or `pytorch_model.bin`),
one `.safetensors` file, or a state dict written by `torch.save`.

Nothing here runs code from a file: safetensors headers are JSON, a `torch.save` file is read
with `weights_only` (tensors and plain containers; any other object is refused) and mapped, not
read (`mmap`), so its shapes cost no memory. An index names files by their plain names in its
own directory: a path (`../x`, `/x`) is refused. Each tensor is read later by block: the rows,
and columns, that one rank keeps (`WeightsSource.read`).
"""

from __future__ import annotations

import json
import os
import stat
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.core.placement import Placement
from runner.weights.safetensors_file import (
    SafetensorsHeader,
    WeightsFileError,
    read_block,
    read_header,
    read_rows_into,
)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredWeight:
    """A tensor of the weights: its dtype and shape, and the file that holds it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path


class WeightsSource:
    """The tensors of `path`, by name, each read by block on demand."""

    def __init__(self, path: Path, tensors: Mapping[str, StoredWeight],
                 headers: Mapping[Path, SafetensorsHeader],
                 state: Mapping[str, torch.Tensor] | None = None) -> None:
        self.path = path
        self.tensors = dict(tensors)
        self._headers = dict(headers)
        self._state = state  # a torch.save file's tensors, mapped (nothing read yet)

    @property
    def files(self) -> list[Path]:
        return sorted({stored.file for stored in self.tensors.values()})

    def read_into(self, name: str, place: Placement, out: torch.Tensor) -> bool:
        """Block `place` of the stored tensor `name` read straight into `out` (a contiguous
        CPU tensor of the stored dtype, rows only); False where it cannot be (`read`)."""
        stored = self.tensors[name]
        if self._state is not None or place.splits_columns:
            return False
        rows = (place.start, place.stop) if stored.shape else None
        return read_rows_into(self._headers[stored.file], name, rows, out)

    def read(self, name: str, place: Placement) -> torch.Tensor:
        """Block `place` (its rows and columns) of the stored tensor `name`, read alone."""
        stored = self.tensors[name]
        if not stored.shape:
            rows, cols = None, None
        else:
            rows = (place.start, place.stop)
            cols = place.col_range if place.splits_columns else None
        if self._state is not None:
            whole = self._state[name]
            if rows is None:
                return whole.clone()
            block = whole[rows[0]:rows[1]]
            return (block[:, cols[0]:cols[1]] if cols is not None else block).clone()
        return read_block(self._headers[stored.file], name, rows, cols)


def _regular(path: Path, what: str) -> os.stat_result:
    """`path`'s status (a link is followed: a model cache links its files to blobs), refused
    unless it is a regular file."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise WeightsFileError(f"{path}: no such file ({what})") from None
    except OSError as exc:
        raise WeightsFileError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(status.st_mode):
        raise WeightsFileError(f"{path}: not a regular file ({what})")
    return status


def _from_headers(path: Path, files: list[Path],
                  index: Mapping[str, Path] | None = None) -> WeightsSource:
    headers = {file: read_header(file) for file in files}
    tensors: dict[str, StoredWeight] = {}
    for file, header in headers.items():
        for name, info in header.tensors.items():
            if index is not None and index.get(name) != file:
                continue  # the index says which file's copy of a name is the one
            if name in tensors:
                raise WeightsFileError(f"{path}: tensor {name!r} is in both "
                                       f"{tensors[name].file.name} and {file.name}")
            tensors[name] = StoredWeight(name, info.dtype, info.shape, file)
    for name, file in (index or {}).items():
        if name not in tensors:
            raise WeightsFileError(f"{path}: the index puts {name!r} in {file.name}, which "
                                   f"does not hold it")
    return WeightsSource(path, tensors, headers)


def _index(path: Path) -> dict[str, Path]:
    """A sharded directory's index: each tensor's file, a plain name inside the directory."""
    status = _regular(path, "the index of the weights' files")
    if status.st_size > MAX_INDEX_BYTES:
        raise WeightsFileError(f"{path}: {status.st_size} bytes: not an index of weights")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsFileError(f"{path}: not JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsFileError(f"{path}: no \"weight_map\" of tensor names to files")
    index = {}
    for name, file in weight_map.items():
        if (not isinstance(file, str) or not file or Path(file).name != file
                or file in (".", "..")):
            raise WeightsFileError(f"{path}: tensor {name!r} is mapped to {file!r}, which is "
                                   f"not a file of the index's own directory (refused)")
        index[str(name)] = path.parent / file
    return index


def _torch_file(path: Path) -> WeightsSource:
    """A state dict written by `torch.save`: mapped with `weights_only` (no code runs)."""
    _regular(path, "weights")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(8)
        what = ("a pickle of the old torch.save format (save it again with torch.save, or as "
                "safetensors)" if head[:1] == b"\x80" else "neither safetensors nor a "
                "torch.save file")
        raise WeightsFileError(f"{path}: {what}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # pickle, zip and torch's own checks raise anything
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WeightsFileError(f"{path}: not loaded as tensors alone (refused: loading it "
                               f"could run code): {first[:200]}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise WeightsFileError(f"{path}: holds a {type(state).__name__}, not a state dict "
                               f"(names to tensors)")
    tensors = {name: StoredWeight(name, t.dtype, tuple(t.shape), path)
               for name, t in state.items()}
    return WeightsSource(path, tensors, {}, state)


def _directory(path: Path) -> WeightsSource:
    index_path = path / SAFETENSORS_INDEX
    if index_path.exists():
        index = _index(index_path)
        files = sorted(set(index.values()))
        for file in files:
            _regular(file, f"named by {SAFETENSORS_INDEX}")
        return _from_headers(path, files, index)
    if (path / SAFETENSORS_FILE).exists():
        _regular(path / SAFETENSORS_FILE, "weights")
        return _from_headers(path, [path / SAFETENSORS_FILE])
    if (path / TORCH_FILE).exists():
        return _torch_file(path / TORCH_FILE)
    raise WeightsFileError(f"{path}: holds no {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} or "
                           f"{TORCH_FILE}")


def open_weights(path: str | Path) -> WeightsSource:
    """The weights `path` names, by their headers (`WeightsFileError`: one line naming the
    file and what is wrong with it)."""
    path = Path(path)
    if path.is_dir():
        return _directory(path)
    if not path.exists():
        raise WeightsFileError(f"{path}: no such file or directory")
    if path.suffix == ".safetensors":
        _regular(path, "weights")
        return _from_headers(path, [path])
    return _torch_file(path)

