"""Saving a checkpoint: collective over the world, written atomically, the manifest last.

Of the ranks holding the same block of a tensor, only the lowest writes it, and a block inside
a larger one that is written (a block of a column stripe another rank holds whole) is not
written again (`_writers`). One-value optimizer state is written once, by rank 0; the ranks
holding a parameter must agree on it, or the checkpoint is not written.

Under `strategy.sparse=sharded` a rank holds only its block of each embedding table (placed
like any row shard) and replicas of the table's hot rows, which took the steps while their
owners' rows went stale: the replicas' weights and optimizer state (momentum, Adam's moments)
are written back into the owners' rows first (`refresh_copies`, `refresh_state_copies`), so the
blocks saved are true; the replicas and their ids (`<table>.hot_weight`, `<table>.hot_ids`, no
tensors of the sequential model) are kept too, read back only by a resume with as many hot rows
and ignored by any other. Then the ranks agree on who writes what, each writes its file
(temporary name, fsync, rename), hashing the bytes as they are written, they share what went
wrong, and rank 0 writes the manifest only when every file is in place. A failed write leaves
no manifest, so the previous checkpoint stays the latest.

A checkpoint is device-independent: every tensor is copied to the host before it is written
(`_host_copy`), so a checkpoint of a model trained on a GPU holds the same bytes, and the same
hashes, as one trained on the CPU, and loads on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from runner.checkpoint.format import (
    BUFFERS,
    FORMAT,
    Entry,
    Scalar,
    ShardRecord,
    first_overlap,
    model_placements,
    placed_buffers,
    tensor_placement,
)
from runner.checkpoint.layout import (
    MANIFEST,
    CheckpointError,
    complete_checkpoints,
    shard_file,
    step_dir,
)
from runner.core import ProcessGrid
from runner.core.placement import Placement
from runner.optim.sync import ReplicaOptimizer, UnsavableState
from runner.records import safe_paths
from runner.records.rundir import atomic_write_text
from strategies import ParallelModel
from strategies.exchange.sparse_gradients import UnevenState


@dataclass
class TrainingProgress:
    """What a checkpoint restores besides tensors: where training stands."""

    step: int
    time_s: float  # training seconds so far (metrics' `time_s` continues from it)
    sampler: dict[str, Any]  # EpochSampler.state(): epoch, position, generator, order
    loss_scale: dict[str, float | int] | None = None  # fp16's DynamicLossScale.state()


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of its own (not a view: a slice would save its whole storage): what a
    checkpoint holds, wherever `tensor` lives (torch.save records a tensor's device, so a
    device tensor would make the bytes, and the hash, depend on it)."""
    return tensor.detach().to("cpu", copy=True)


def _entries(kind: str, replica: int | None, places: list[Placement],
             tensors: Sequence[torch.Tensor | None]) -> Iterator[tuple[Entry, torch.Tensor]]:
    for place, tensor in zip(places, tensors, strict=True):
        if tensor is not None:
            yield Entry(kind, replica, place), _host_copy(tensor)


def _optimizer_states(optimizer: ReplicaOptimizer,
                      step: int) -> dict[str, list[torch.Tensor | None]]:
    """The optimizer's per-parameter state; state it cannot give is one line (the same on
    every rank: it depends on the optimizer's class and options alone)."""
    try:
        return optimizer.param_states()
    except UnsavableState as exc:
        raise CheckpointError(f"checkpoint at step {step} not written: {exc}") from None


def _refresh_states(model: ParallelModel, optimizer: ReplicaOptimizer,
                    states: Mapping[str, Sequence[torch.Tensor | None]], step: int) -> None:
    """Collective: the optimizer's state shaped like the parameters made whole from the rows'
    owners, as `refresh_copies` makes the weights (under `strategy.sparse=sharded` only a row's
    owner holds its true momentum or moments; the lowest rank writes every row). A state some
    ranks lack cannot be: one line on every rank, nothing written."""
    scalar_kinds = optimizer.scalar_kinds()
    try:
        model.refresh_state_copies({kind: tensors for kind, tensors in states.items()
                                    if kind not in scalar_kinds})
    except UnevenState as exc:
        raise CheckpointError(f"checkpoint at step {step} not written: {exc}") from None


def _held_tensors(model: ParallelModel, optimizer: ReplicaOptimizer, grid: ProcessGrid,
                  states: Mapping[str, Sequence[torch.Tensor | None]]
                  ) -> list[tuple[Entry, torch.Tensor]]:
    """Everything this rank holds that a checkpoint keeps by rows (collective: reads the
    centre); `states`: the optimizer's (`param_states`)."""
    places = model_placements(model)
    replica = grid.batch_index if optimizer.per_replica else None
    params = list(model.parameters())
    held = list(_entries("model", replica, places, params))
    buffers = placed_buffers(model)
    held += _entries(BUFFERS, replica, [tensor_placement(b) for b in buffers], buffers)
    scalar_kinds = optimizer.scalar_kinds()
    for kind, tensors in states.items():
        if kind not in scalar_kinds:
            held += _entries(kind, replica, places, tensors)
    if optimizer.has_centre:
        with optimizer.centre_weights():
            held += _entries("centre", None, places, list(model.parameters()))
    return held


def _held_scalars(model: ParallelModel, optimizer: ReplicaOptimizer, grid: ProcessGrid,
                  states: Mapping[str, Sequence[torch.Tensor | None]]
                  ) -> list[tuple[Scalar, torch.Tensor]]:
    """This rank's one-value optimizer state, by parameter name (`optimizer.scalar_kinds`)."""
    replica = grid.batch_index if optimizer.per_replica else None
    places = model_placements(model)
    held = []
    for kind in optimizer.scalar_kinds():
        for place, value in zip(places, states.get(kind, [None] * len(places)), strict=True):
            if value is not None:
                held.append((Scalar(kind, replica, place.name), _host_copy(value)))
    return held


def _agreed_scalars(reported: Sequence[Sequence[tuple[Scalar, torch.Tensor]]]
                    ) -> tuple[dict[Scalar, torch.Tensor], str | None]:
    """One value per parameter name from what every rank reported, and why not when ranks
    holding the same parameter disagree or a value is not one value (every rank sees the same
    reports, so all raise together). Disagreement would be a bug: the shards of a parameter
    take the same steps."""
    agreed: dict[Scalar, torch.Tensor] = {}
    for rank, held in enumerate(reported):
        for scalar, value in held:
            if value.dim() != 0:
                return {}, (f"rank {rank}: optimizer state '{scalar.kind}' of {scalar.name} "
                            f"has shape {list(value.shape)}, not one value")
            first = agreed.setdefault(scalar, value)
            if first.dtype != value.dtype or not torch.equal(first, value):
                return {}, (f"rank {rank}: optimizer state '{scalar.kind}' of {scalar.name} "
                            f"is {value.item()!r}, a lower rank holds {first.item()!r}")
    return agreed, None


class _HashingWriter:
    """The shard file as torch.save writes it (sequentially: it never seeks): hashes and counts
    the bytes written, and keeps the first write error, which torch.save would report as a
    RuntimeError about stream positions."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        accepted = memoryview(data).cast("B")[:written]  # all of it, for a buffered file
        self.sha256.update(accepted)
        self.size += len(accepted)
        return int(written)

    def flush(self) -> None:
        self.file.flush()


def _write_shard(path: Path, payload: dict[str, torch.Tensor]) -> ShardRecord:
    """Write `payload` to `path` atomically; its record hashes the bytes as written. Reached
    from the run directory without following a link (`safe_paths`)."""
    root, relative = safe_paths.locate(path)
    tmp = relative.with_name(f".{relative.name}.tmp")
    fd = safe_paths.open_file(root, tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(payload, cast("IO[bytes]", writer))
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    safe_paths.move(root, tmp, relative)
    return ShardRecord(writer.size, writer.sha256.hexdigest())


def _shard_payload(held: list[tuple[Entry, torch.Tensor]], writer: dict[str, int], rank: int,
                   progress: TrainingProgress, scalars: dict[Scalar, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """What rank `rank`'s shard file holds: the blocks it writes (`writer`), its random state,
    and on rank 0 the sampler's state and the one-value optimizer state."""
    payload = {e.key: t for e, t in held if writer.get(e.key) == rank}
    payload["rng"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # a run on a GPU: its draws
        payload["cuda_rng"] = torch.cuda.get_rng_state()
    if rank == 0:
        payload["sampler/generator"] = _host_copy(progress.sampler["generator"])
        payload["sampler/order"] = _host_copy(progress.sampler["order"])
        payload.update({scalar.key: value for scalar, value in scalars.items()})
    return payload


def save_checkpoint(checkpoints: Path, progress: TrainingProgress, model: ParallelModel,
                    optimizer: ReplicaOptimizer, grid: ProcessGrid, run_info: dict[str, Any],
                    keep: int | None = None) -> Path:
    """Collective over the world: write a checkpoint and return its path. Raises
    `CheckpointError` on every rank when any rank's write failed.

    Its step is the least step of the ranks: they agree under synchronous optimizers, while
    asynchronous replicas stopped by a signal may stand at different steps (each keeps its own
    weights; a resume continues from the least)."""
    model.refresh_copies()  # rows a parameter-server exchange left stale on non-owners
    states = _optimizer_states(optimizer, progress.step)
    _refresh_states(model, optimizer, states, progress.step)
    held = _held_tensors(model, optimizer, grid, states)
    # Agree on the step, on who writes what (the lowest rank holding the same rows), and on
    # the one-value state (rank 0 writes it).
    everyone = grid.world.allgather_object(([e for e, _ in held], progress.step,
                                            _held_scalars(model, optimizer, grid, states)))
    step = min(s for _, s, _ in everyone)
    scalars, problem = _agreed_scalars([reported for _, _, reported in everyone])
    if problem is not None:
        raise CheckpointError(f"checkpoint at step {step} not written: {problem}")
    path = step_dir(checkpoints, step)
    error = None
    if grid.rank == 0:
        error = _attempt(lambda: _fresh_directory(path))
    _raise_first(grid.world.allgather_object(error), step)
    writer = _writers([entries for entries, _, _ in everyone])
    payload = _shard_payload(held, writer, grid.rank, progress, scalars)
    records: list[ShardRecord] = []
    error = _attempt(lambda: records.append(_write_shard(path / shard_file(grid.rank), payload)))
    written = grid.world.allgather_object((error, records[0] if records else None))
    _raise_first([e for e, _ in written], step, path if grid.rank == 0 else None)
    if grid.rank == 0:
        manifest = {
            "format": FORMAT, "step": step, "time_s": progress.time_s,
            "world_size": grid.size, "grid": {"pr": grid.pr, "pc": grid.pc},
            "per_replica": optimizer.per_replica, "rank_steps": [s for _, s, _ in everyone],
            "sampler": {"epoch": progress.sampler["epoch"],
                        "position": progress.sampler["position"]},
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"), **run_info,
            "files": {shard_file(rank): [e.to_json() for e in entries
                                         if writer.get(e.key) == rank]
                      for rank, (entries, _, _) in enumerate(everyone)},
            "scalars": [scalar.to_json() for scalar in scalars],
            **({} if progress.loss_scale is None else {"loss_scale": progress.loss_scale}),
            "shards": {shard_file(rank): record.to_json()
                       for rank, (_, record) in enumerate(written) if record is not None}}
        error = _attempt(lambda: atomic_write_text(path / MANIFEST,
                                                   json.dumps(manifest, indent=1) + "\n"))
    _raise_first(grid.world.allgather_object(error), step, path if grid.rank == 0 else None)
    if grid.rank == 0 and keep:
        for old in complete_checkpoints(checkpoints)[:-keep]:
            _remove_quietly(old)
    return path


def _writers(reported: Sequence[Sequence[Entry]]) -> dict[str, int]:
    """Which rank writes each block, by entry key (`reported`: every rank's entries; a key
    left out is written by none): the lowest rank holding it, so that the blocks written of
    each tensor hold every element once. Where the distinct blocks of a tensor overlap (a rank
    holds a column stripe W[:, c0:c1], others blocks inside it), the larger blocks go first
    and a block overlapping one already chosen is left out: for blocks nested in each other,
    as partitions that refine each other make, every element is still written once."""
    lowest: dict[str, tuple[int, Entry]] = {}
    for rank, entries in enumerate(reported):
        for entry in entries:
            lowest.setdefault(entry.key, (rank, entry))
    by_tensor: dict[tuple[str, int | None, str], list[tuple[int, Entry]]] = {}
    for rank, entry in lowest.values():
        by_tensor.setdefault((entry.kind, entry.replica, entry.name), []).append((rank, entry))
    writer: dict[str, int] = {}
    for held in by_tensor.values():
        if first_overlap([entry.place for _, entry in held]) is not None:
            chosen: list[Placement] = []
            kept = []
            for rank, entry in sorted(held, key=lambda item: (-item[1].place.area, item[0])):
                if all(entry.place.intersection(other) is None for other in chosen):
                    chosen.append(entry.place)
                    kept.append((rank, entry))
            held = kept
        writer.update((entry.key, rank) for rank, entry in held)
    return writer


def _fresh_directory(path: Path) -> None:
    """An empty directory for this step's files (a crash may have left a partial one); a link
    on the way is refused, never followed."""
    root, relative = safe_paths.locate(path)
    safe_paths.remove_tree(root, relative)
    safe_paths.make_dir(root, relative)


def _remove_quietly(path: Path) -> None:
    """Remove a checkpoint's folder as far as possible (links inside removed as links)."""
    with contextlib.suppress(OSError):
        safe_paths.remove_tree(*safe_paths.locate(path))


def _attempt(write: Any) -> str | None:
    """Run a filesystem action; its error as one line, or None."""
    try:
        write()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _raise_first(errors: list[str | None], step: int, incomplete: Path | None = None) -> None:
    """Every rank raises the same error when any rank failed (`incomplete`: remove it)."""
    failure = next(((rank, e) for rank, e in enumerate(errors) if e is not None), None)
    if failure is None:
        return
    if incomplete is not None:
        _remove_quietly(incomplete)  # best effort: it has no manifest anyway
    raise CheckpointError(f"checkpoint at step {step} not written: rank {failure[0]}: "
                          f"{failure[1]}")
