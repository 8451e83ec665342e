"""Resuming from a checkpoint: which one (`find_resume_checkpoint`, and the head's full check
`verify_resume`), which of its tensors become this rank's (`resume_plan`), and loading them; and
the command that continues an interrupted run (`resume_command`).

`verify_resume` is the head's full check before any rank starts: every shard read and verified,
and the checkpoint checked against the model. `resume=auto` skips damaged checkpoints for the
newest one that verifies. Every shard of a parameter gets its one-value optimizer state on
load; loading copies the host tensors into the parameters and into state created on their
device.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint.format import (
    BUFFERS,
    WHOLE_KINDS,
    model_placements,
    placed_buffers,
    tensor_placement,
)
from runner.checkpoint.layout import (
    MANIFEST,
    CheckpointError,
    DamagedCheckpoint,
    complete_checkpoints,
    resolve_resume,
    shard_file,
    short_name,
)
from runner.checkpoint.read import Checkpoint
from runner.core import ProcessGrid
from runner.optim.sync import ReplicaOptimizer
from runner.records.rundir_files import load_yaml
from strategies import ParallelModel
from strategies.exchange.sparse_gradients import HOT_IDS, is_hot_row_tensor


def _copy_into(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, value in zip(params, values, strict=True):
            param.copy_(value)


@dataclass(frozen=True)
class ResumePlan:
    """Which of a checkpoint's tensors become this rank's weights, centre and state."""

    weights: tuple[str, int | None]
    centre: tuple[str, int | None] | None
    states_replica: int | None
    same_replicas: bool


def _buffers_source(plan: ResumePlan) -> tuple[str, int | None]:
    """Whose buffers a resume reads: the replica whose weights it reads, replica 0's where it
    reads the centre (which has none of its own)."""
    kind, replica = plan.weights
    return BUFFERS, replica if kind == "model" else 0


def resume_plan(checkpoint: Checkpoint, per_replica: bool, has_centre: bool,
                grid: ProcessGrid) -> ResumePlan:
    """Replicas' own weights when the checkpoint has them for the same replicas; otherwise the
    weights all replicas agree on (the centre of an EASGD checkpoint)."""
    saved_per_replica = bool(checkpoint.manifest["per_replica"])
    same_replicas = (saved_per_replica and per_replica
                     and checkpoint.manifest["grid"]["pc"] == grid.pc)
    if same_replicas:
        weights: tuple[str, int | None] = ("model", grid.batch_index)
    elif saved_per_replica:
        weights = ("centre", None)
    else:
        weights = ("model", None)
    centre = None
    if has_centre:
        centre = ("centre", None) if checkpoint.has("centre") else ("model", None)
    return ResumePlan(weights, centre, grid.batch_index if same_replicas else None,
                      same_replicas or not saved_per_replica)


def _is_hot(tensor: torch.Tensor) -> bool:
    return is_hot_row_tensor(tensor_placement(tensor).name)


def _read_weights(checkpoint: Checkpoint, kind: str, replica: int | None,
                  params: Sequence[torch.Tensor]) -> None:
    """Copy `kind`'s values into `params`; a sharded table's hot-row replicas only when the
    checkpoint has them (one written under another exchange has its rows in the table)."""
    for param in params:
        checkpoint.read_into(kind, replica, tensor_placement(param), param.data,
                             optional=_is_hot(param))


def _hot_rows_without_checkpoint(checkpoint: Checkpoint, buffers: Sequence[torch.Tensor],
                                 plan: ResumePlan) -> list[str]:
    """A sharded table resumed from a checkpoint without hot rows keeps none (every slot
    empty): replicas chosen now would start their optimizer state from zero, while their
    owners' rows hold the true state."""
    kind, replica = _buffers_source(plan)
    notes = []
    for buffer in buffers:
        place = tensor_placement(buffer)
        if place.name.rsplit(".", 1)[-1] != HOT_IDS:
            continue
        if not checkpoint.files_for(kind, replica, [place], optional=True):
            buffer.fill_(-1)
            notes.append(f"{place.name}: no hot rows in the checkpoint, so none this run")
    return notes


def load_centre(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel) -> None:
    """Before the optimizer is built (it takes its centre from the model's weights)."""
    if plan.centre is not None:
        _read_weights(checkpoint, *plan.centre, list(model.parameters()))


def load_training_state(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel,
                        optimizer: ReplicaOptimizer, grid: ProcessGrid) -> list[str]:
    """The weights, the optimizer's per-parameter state (rows re-sharded, one-value state by
    parameter name; given to the optimizer in one call, so that it can restore a parameter's
    state whole) and this rank's RNG; returns what could not be restored exactly (for the
    log)."""
    params = list(model.parameters())
    _read_weights(checkpoint, *plan.weights, params)
    notes = []
    buffers = placed_buffers(model)
    if buffers and checkpoint.has(BUFFERS):
        kind, replica = _buffers_source(plan)
        saved = checkpoint.read_states(kind, replica, buffers)
        _copy_into([b for b, v in zip(buffers, saved, strict=True) if v is not None],
                   [v for v in saved if v is not None])
    elif any(not _is_hot(buffer) for buffer in buffers):
        notes.append("running statistics start afresh (the checkpoint has none)")
    notes += _hot_rows_without_checkpoint(checkpoint, buffers, plan)
    states: dict[str, list[torch.Tensor | None]] = {}
    scalar_kinds = optimizer.scalar_kinds()
    for kind in (*optimizer.state_kinds(), *scalar_kinds):
        if plan.same_replicas and checkpoint.has(kind):
            read = checkpoint.read_scalars if kind in scalar_kinds else checkpoint.read_states
            states[kind] = read(kind, plan.states_replica, params)
        else:
            notes.append(f"optimizer state '{kind}' starts from zero (not in the checkpoint "
                         f"for these replicas)")
    if states:
        optimizer.load_param_states(states)
    same_grid = checkpoint.manifest["grid"] == {"pr": grid.pr, "pc": grid.pc}
    state = checkpoint.rank_state(grid.rank if same_grid else 0)
    torch.set_rng_state(state["rng"])
    cuda_rng = state.get("cuda_rng")  # written on a GPU; a CPU resume has no use for it
    if (isinstance(cuda_rng, torch.Tensor) and cuda_rng.dtype == torch.uint8
            and torch.cuda.is_available()):
        torch.cuda.set_rng_state(cuda_rng)
    if not same_grid:
        notes.append("random state taken from rank 0 (the checkpoint's grid differs)")
    return notes


def sampler_state(checkpoint: Checkpoint) -> dict[str, Any]:
    rank0 = checkpoint.rank_state(0)
    return {**checkpoint.manifest["sampler"], "generator": rank0["sampler/generator"],
            "order": rank0["sampler/order"]}


def prepare_resume(checkpoint: Checkpoint, plan: ResumePlan, model: ParallelModel,
                   grid: ProcessGrid) -> None:
    """Read and verify every shard this rank's resume will read, and check that they cover
    its parameters, before anything collective happens: a damaged shard or another model's
    checkpoint is then a `CheckpointError` every rank can share (one line, no rank left
    waiting). Only these shards are hashed here (the head verified the whole checkpoint): the
    bytes hashed are the bytes loaded, so a file changed since the head's check is caught."""
    places = model_placements(model)
    hot = [place for place in places if is_hot_row_tensor(place.name)]
    places = [place for place in places if not is_hot_row_tensor(place.name)]
    files = checkpoint.files_for(*plan.weights, places)
    files |= checkpoint.files_for(*plan.weights, hot, optional=True)
    if checkpoint.has(BUFFERS):
        files |= checkpoint.files_for(*_buffers_source(plan),
                                      [tensor_placement(b) for b in placed_buffers(model)],
                                      optional=True)
    if plan.centre is not None:
        files |= checkpoint.files_for(*plan.centre, places)
    if plan.same_replicas:  # the optimizer's state: read only for the same replicas
        for kind in {entry.kind for _, entry in checkpoint.entries} - set(WHOLE_KINDS):
            files |= checkpoint.files_for(kind, plan.states_replica, places + hot,
                                          optional=True)
    same_grid = checkpoint.manifest["grid"] == {"pr": grid.pr, "pc": grid.pc}
    files |= {shard_file(0), shard_file(grid.rank if same_grid else 0)}  # sampler, RNG
    checkpoint.load_shards(sorted(files))


# -- before a resume: which checkpoint, verified ---------------------------------------------

def find_resume_checkpoint(resume: str | None, checkpoints: Path | None,
                           read_named: bool = True) -> tuple[Path | None, list[str]]:
    """The checkpoint `trainer.resume` names, verified, and notes on what was skipped or could
    not be verified.

    `auto`: the newest complete checkpoint under `checkpoints` whose every shard verifies
    (read, hashed, unpickled, checked: `Checkpoint.verify`), skipping damaged ones with a note
    each; None when there is no complete checkpoint (a fresh start). When there are some and
    none verifies, `CheckpointError` naming each and why: a fresh start there would replace the
    run they record (its metrics cut back, the damaged checkpoints pruned), which is only ever
    the user's explicit choice. A path: that checkpoint, or a run directory's newest; a damaged
    one raises `DamagedCheckpoint` (it was named: no fallback).
    `read_named=False` only looks at a named checkpoint's shards (there, regular files of the
    recorded sizes): for the ranks, which hash what they load. `auto` always reads, so that
    every caller picks the same checkpoint."""
    if resume is None:
        return None, []
    if resume == "auto":
        notes: list[str] = []
        for candidate in reversed(complete_checkpoints(checkpoints) if checkpoints else []):
            try:
                checkpoint = Checkpoint(candidate)
                checkpoint.verify()
            except DamagedCheckpoint as exc:
                notes.append(f"skipped {short_name(candidate)}: {exc.file}: {exc.reason}")
                continue
            return candidate, notes + checkpoint.notes
        if notes:
            reasons = "; ".join(note.removeprefix("skipped ") for note in notes)
            raise CheckpointError(
                f"no checkpoint of {checkpoints} verifies ({reasons}): starting afresh would "
                f"replace the run they record; repair or move them, or start the new run in "
                f"another hydra.run.dir")
        return None, notes
    path = resolve_resume(resume, None)
    assert path is not None
    checkpoint = Checkpoint(path)
    if read_named:
        checkpoint.verify()
    else:
        checkpoint.look_at_shards()
    return path, checkpoint.notes


def parameter_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's parameters by `state_dict` name: what a checkpoint's entries name
    (`runner.core.placement.place_whole`)."""
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def buffer_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The model's buffers (running statistics) by `state_dict` name."""
    return {name: tuple(buffer.shape) for name, buffer in model.named_buffers()}


def verify_resume(resume: str | None, checkpoints: Path, model: torch.nn.Module
                  ) -> tuple[Path | None, list[str]]:
    """The head's check before any rank starts: the checkpoint `trainer.resume` names (None,
    `auto` under the run directory's `checkpoints`, or a path), fully verified
    (`find_resume_checkpoint`) and checked against the sequential `model` (it may live on the
    meta device: only names and shapes are used). Returns the checkpoint to resume from (None:
    a fresh start) and notes (checkpoints skipped and why; no hashes to verify). Raises
    `CheckpointError`, one line naming the checkpoint, the file and the reason, for a damaged
    named checkpoint or one of another model (also under `auto`: that is not damage, and an
    older checkpoint of the same run would not fit either)."""
    path, notes = find_resume_checkpoint(resume, checkpoints)
    if path is not None:
        problem = Checkpoint(path).model_problem(parameter_shapes(model), buffer_shapes(model))
        if problem is not None:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST}: not a checkpoint of this "
                                  f"model: {problem} (another model or dataset?)")
    return path, notes


# -- after an interruption -------------------------------------------------------------------

def hydra_quoted(value: str) -> str:
    """`value` as a double-quoted Hydra override value that reads back as exactly `value`.
    Unquoted, Hydra's grammar gives `( ) [ ] { } , = '` spaces and more a meaning, and reads
    `null`, `1` or `true` as other types. Inside the quotes a `"` is escaped `\\"`, and the
    backslashes before a quote (or before the closing one) are doubled. OmegaConf resolves
    `${...}` even in quoted values: escaped `\\${` (the backslashes before it doubled)."""
    literal = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    inner = re.sub(r'(\\*)("|\Z)',
                   lambda m: m.group(1) * 2 + ('\\"' if m.group(2) else ""), literal)
    return f'"{inner}"'


def resume_command(run_dir: Path) -> str:
    """The command that continues this run: its own overrides, its directory, resume=auto.
    It pastes into a POSIX shell whatever the directory is called (quoted for Hydra, then for
    the shell)."""
    overrides: list[str] = []
    try:
        saved = load_yaml(run_dir / ".hydra" / "overrides.yaml", shown_only=True) or []
        overrides = [str(o) for o in saved
                     if not str(o).startswith(("trainer.resume=", "hydra.run.dir="))]
    except (OSError, ValueError, TypeError):  # unreadable, beyond the bounds, not a list
        pass
    words = [*overrides, f"hydra.run.dir={hydra_quoted(str(run_dir))}", "trainer.resume=auto"]
    return " ".join(["python -m runner", *map(shlex.quote, words)])
