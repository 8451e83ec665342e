"""A checkpoint's model handed back as safetensors (`python -m runner.export`): a directory that
the transformers library's `from_pretrained` loads (`config.json` and `model.safetensors`, or
numbered files and `model.safetensors.index.json` above a size, as `save_pretrained` writes
them), or one `.safetensors` file for a model of another kind.

Any checkpoint of any strategy and grid: each tensor is put together from the blocks its shards
hold (`runner.core.placement`), one tensor at a time, and written at once, so the memory held is
about the largest tensor, never the model. The model is the replicas' agreed weights (the
centre of an EASGD-family checkpoint). Every shard read is hashed against the manifest first
(`Checkpoint.map_shard`), and every tensor written is read back and compared by hash before the
output takes its name; the output appears whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.checkpoint.format import BUFFERS, Entry
from runner.checkpoint.layout import CheckpointError, latest_checkpoint, step_dir
from runner.checkpoint.read import Checkpoint
from runner.core.placement import Placement
from runner.weights.library_names import model_from_config, to_stored
from runner.weights.model_card import MODEL_CONFIG, STATE_NAMES
from runner.weights.safetensors_file import SafetensorsWriter, read_block, read_header
from runner.weights.sources import SAFETENSORS_FILE, SAFETENSORS_INDEX
from strategies.exchange.sparse_gradients import is_hot_row_tensor

CONFIG_FILE = "config.json"
DEFAULT_SHARD_BYTES = 5 * 10**9  # save_pretrained's default largest file
METADATA = {"format": "pt"}  # what from_pretrained expects of a PyTorch safetensors file


class ExportError(RuntimeError):
    """Why a checkpoint cannot be exported (one line)."""


@dataclass(frozen=True)
class ExportedTensor:
    """A tensor of the exported model: where its blocks are, and how it is written."""

    name: str  # as the file names it (save_pretrained's name)
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    dtype: torch.dtype
    blocks: tuple[tuple[str, Entry], ...]  # (shard file, entry) of each stored block

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    path: Path
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    largest_tensor_bytes: int
    checkpoint: Path


def find_checkpoint(source: Path, step: int | None) -> Path:
    """The checkpoint `source` names: a checkpoint directory itself, or a run directory's
    checkpoint of `step` (None: its newest complete one)."""
    if (source / "manifest.json").is_file():
        return source
    checkpoints = source / "checkpoints"
    if step is not None:
        found = step_dir(checkpoints, step)
        if not (found / "manifest.json").is_file():
            raise ExportError(f"{source}: no complete checkpoint of step {step}")
        return found
    newest = latest_checkpoint(checkpoints)
    if newest is None:
        raise ExportError(f"{source}: no checkpoint to export (a run writes them with "
                          f"trainer.checkpoint_every=N, or trainer.export=true at its end)")
    return newest


def _model_kind(checkpoint: Checkpoint) -> tuple[str, int | None]:
    """The weights every replica agrees on: the centre of a checkpoint of replicas that differ
    (replica 0's own where it has none), else the model."""
    if not checkpoint.manifest["per_replica"]:
        return "model", None
    return ("centre", None) if checkpoint.has("centre") else ("model", 0)


def _tensors(checkpoint: Checkpoint, dtypes: dict[str, torch.dtype],
             dtype: torch.dtype | None) -> list[ExportedTensor]:
    """The tensors the model's `state_dict` keeps, in its order, with their blocks."""
    kind, replica = _model_kind(checkpoint)
    buffers_replica = 0 if checkpoint.manifest["per_replica"] else None  # as a resume reads
    wanted = {(kind, replica), (BUFFERS, buffers_replica)}
    blocks: dict[str, list[tuple[str, Entry]]] = {}
    for file, entry in checkpoint.entries:  # a strategy's own tensors (hot rows) left out
        if (entry.kind, entry.replica) in wanted and not is_hot_row_tensor(entry.name):
            blocks.setdefault(entry.name, []).append((file, entry))
    kept = checkpoint.manifest.get(STATE_NAMES)
    if isinstance(kept, list) and all(isinstance(name, str) for name in kept):
        order = kept
    else:  # a checkpoint written before it recorded them: every placed tensor
        order = list(blocks)
    missing = [name for name in order if name not in blocks]
    if missing:
        raise ExportError(f"{checkpoint.path}: no {kind} of {missing[0]} (a damaged manifest?)")
    config = checkpoint.manifest.get(MODEL_CONFIG)
    model = model_from_config(config) if isinstance(config, dict) else None
    stored_name = to_stored(model) if model is not None else (lambda name: name)
    tensors = []
    for name in order:
        found = blocks[name]
        file, entry = found[0]
        stored = dtypes[entry.key]
        cast_to = dtype if dtype is not None and stored.is_floating_point else stored
        tensors.append(ExportedTensor(stored_name(name), entry.shape, stored, cast_to,
                                      tuple(found)))
    return tensors


def _assembled(tensor: ExportedTensor, shards: _Shards) -> torch.Tensor:
    """The whole tensor, put together from its stored blocks (which tile it: the manifest's
    checks), cast to the dtype it is written in."""
    whole = torch.empty(tensor.shape, dtype=tensor.stored_dtype)
    model_name = tensor.blocks[0][1].name
    place = Placement(model_name, tensor.shape, 0, tensor.shape[0] if tensor.shape else 1)
    by_file: dict[str, list[Entry]] = {}
    for file, entry in tensor.blocks:
        by_file.setdefault(file, []).append(entry)
    for file, entries in by_file.items():
        mapped = shards.mapped(file)
        for entry in entries:
            shared = entry.place.intersection(place)
            if shared is not None:
                place.view(whole, shared).copy_(entry.place.view(mapped[entry.key], shared))
        del mapped  # the mapping goes, and its pages with it
    return whole if tensor.dtype == tensor.stored_dtype else whole.to(tensor.dtype)


def _shard_groups(tensors: Sequence[ExportedTensor], max_bytes: int
                  ) -> list[list[ExportedTensor]]:
    """Consecutive tensors packed into files of at most `max_bytes` (a larger tensor alone)."""
    groups: list[list[ExportedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return groups


def _file_names(count: int, single: str) -> list[str]:
    if count == 1:
        return [single]
    stem = single.removesuffix(".safetensors")
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _tensor_hash(tensor: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes, read in place (no copy of a contiguous tensor)."""
    flat = tensor.contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()


def _write_files(folder: Path, groups: list[list[ExportedTensor]], names: list[str],
                 shards: _Shards) -> dict[str, str]:
    """Each group's file, tensor by tensor; the hash of every tensor's bytes as written."""
    hashes = {}
    for group, file in zip(groups, names, strict=True):
        layout = [(t.name, t.dtype, t.shape) for t in group]
        with SafetensorsWriter(folder / file, layout, METADATA) as writer:
            for tensor in group:
                whole = _assembled(tensor, shards)
                hashes[tensor.name] = _tensor_hash(whole)
                writer.write(tensor.name, whole)
                del whole
    return hashes


def _verify_written(folder: Path, names: list[str], hashes: dict[str, str]) -> None:
    """Every tensor read back from the files as written, by hash against what was written."""
    seen = set()
    for file in names:
        header = read_header(folder / file)
        for name in header.tensors:
            if _tensor_hash(read_block(header, name)) != hashes.get(name):
                raise ExportError(f"{file}: tensor {name} reads back other than it was "
                                  f"written (a failing disk?)")
            seen.add(name)
    if seen != set(hashes):
        raise ExportError(f"the files written hold {len(seen)} of {len(hashes)} tensors")


def _existing_problem(out: Path, force: bool) -> str | None:
    """Why `out` cannot be written: a model there (unless `force`), or a file or folder of
    something else (never replaced)."""
    if not (out.exists() or out.is_symlink()):
        return None
    if out.is_dir() and not out.is_symlink():
        entries = list(out.iterdir())
        holds_model = any(e.suffix == ".safetensors" or e.name == CONFIG_FILE for e in entries)
        if not entries or (holds_model and force):
            return None
        if holds_model:
            return f"{out} already holds a model: refused (--force replaces it)"
        return f"{out} is a folder of other files: refused (export to a new path)"
    if out.suffix == ".safetensors" and out.is_file() and not out.is_symlink():
        return None if force else f"{out} already exists: refused (--force replaces it)"
    return f"{out} exists and is not a model's file or folder: refused"


def _config_json(checkpoint: Checkpoint, dtype: torch.dtype | None,
                 tensors: Sequence[ExportedTensor]) -> dict[str, object] | None:
    config = checkpoint.manifest.get(MODEL_CONFIG)
    if not isinstance(config, dict):
        return None
    floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
    written = dtype or (floats[0] if floats else torch.float32)
    key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
    return {**config, key: str(written).removeprefix("torch.")}


@dataclass(frozen=True)
class ExportRequest:
    """What to export: the checkpoint, where to, in which dtype (None: as stored), whether an
    existing model there is replaced, and the largest file."""

    checkpoint: Path
    out: Path
    dtype: torch.dtype | None = None
    force: bool = False
    max_shard_bytes: int = DEFAULT_SHARD_BYTES


class _Shards:
    """The checkpoint's shards, each hashed once, then mapped while a tensor is put together
    and dropped after it: the pages of a mapping count in the exporter's memory while it
    lasts, so at most one tensor's blocks are ever mapped in."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        try:
            self.identities = {name: checkpoint.verify_shard(name) for name in checkpoint.files}
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None

    def mapped(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return self.checkpoint.map_verified(name, self.identities[name])
        except CheckpointError as exc:
            raise ExportError(str(exc)) from None

    def dtypes(self) -> dict[str, torch.dtype]:
        """Every stored tensor's dtype, by its key (mapped, nothing read)."""
        found = {}
        for name in self.identities:
            found.update({key: tensor.dtype for key, tensor in self.mapped(name).items()})
        return found


def export_checkpoint(request: ExportRequest) -> Exported:
    """Write the checkpoint's model to `request.out` (see the module's docstring)."""
    out = request.out
    problem = _existing_problem(out, request.force)
    if problem is not None:
        raise ExportError(problem)
    try:
        checkpoint = Checkpoint(request.checkpoint)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    shards = _Shards(checkpoint)
    tensors = _tensors(checkpoint, shards.dtypes(), request.dtype)
    config = _config_json(checkpoint, request.dtype, tensors)
    single_file = config is None and out.suffix == ".safetensors"
    groups = _shard_groups(tensors, request.max_shard_bytes) if not single_file else [tensors]
    names = _file_names(len(groups), out.name if single_file else SAFETENSORS_FILE)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _staging(out) as folder:
        hashes = _write_files(folder, groups, names, shards)
        _verify_written(folder, names, hashes)
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                     "weight_map": {t.name: names[i] for i, group in enumerate(groups)
                                    for t in group}}
            (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if config is not None:
            (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _put_in_place(folder / names[0] if single_file else folder, out)
    return Exported(out, tuple(names), len(tensors), sum(t.nbytes for t in tensors),
                    max((t.nbytes for t in tensors), default=0), checkpoint.path)


class _staging:
    """A fresh folder beside the output, removed on the way out whatever happened."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __enter__(self) -> Path:
        self.folder = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        return self.folder

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _put_in_place(source: Path, out: Path) -> None:
    """The staged output takes its name, replacing what `--force` allowed to be replaced."""
    if out.exists() or out.is_symlink():
        aside = out.with_name(f".{out.name}.replaced")
        _remove(aside)
        os.replace(out, aside)
        os.replace(source, out)
        _remove(aside)
    else:
        os.replace(source, out)
