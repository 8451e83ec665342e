"""Where checkpoints lie and which of them are complete, and the errors every part of a
checkpoint's life raises.

    checkpoints/step-00000020/
        rank-00000.pt …   each rank's tensors (a flat dict of tensors, loaded `weights_only`)
        manifest.json     written last, by rename: only a checkpoint with a manifest exists

A shard is named `rank-NNNNN.pt` inside the checkpoint directory and nothing else
(`shard_rank`): a manifest naming any other file is refused before anything is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
SHARD_NAME = re.compile(r"rank-([0-9]{5,})\.pt")  # the only names a manifest may give a shard


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written, is damaged, or does not fit the model."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are not what its manifest says (or whose manifest is not one):
    one line naming the checkpoint, the file and the reason. `resume=auto` skips it."""

    def __init__(self, path: Path, file: str, reason: str) -> None:
        self.path, self.file, self.reason = path, file, reason
        super().__init__(f"checkpoint {path}: {file}: {reason}")


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"{STEP_PREFIX}{step:08d}"


def shard_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def shard_rank(name: Any) -> int | None:
    """The rank whose shard `name` is, when it is exactly `rank-NNNNN.pt` (no directory, no
    `..`, no other spelling); None otherwise."""
    match = SHARD_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        return None
    rank = int(match.group(1))
    return rank if shard_file(rank) == name else None


def is_complete(path: Path) -> bool:
    """A manifest was written (whatever it is: `Checkpoint` checks it is a regular file)."""
    return os.path.lexists(path / MANIFEST)


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """The complete checkpoints under `checkpoints`, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir()
             if p.name.startswith(STEP_PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(checkpoints: Path) -> Path | None:
    found = complete_checkpoints(checkpoints)
    return found[-1] if found else None


def resolve_resume(resume: str | None, checkpoints: Path | None) -> Path | None:
    """The checkpoint `trainer.resume` names: `auto` the run directory's latest (None when
    there is none yet: a fresh start), a checkpoint directory, or a run directory (its
    latest). Raises `CheckpointError` for a path without a complete checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        return None if checkpoints is None else latest_checkpoint(checkpoints)
    path = Path(resume).expanduser()
    if is_complete(path):
        return path
    latest = latest_checkpoint(path / "checkpoints")
    if latest is not None:
        return latest
    raise CheckpointError(f"trainer.resume={resume}: no complete checkpoint there (a "
                          f"checkpoint directory holds {MANIFEST}; a run directory holds "
                          f"checkpoints/{STEP_PREFIX}*)")


def short_name(path: Path) -> str:
    """`checkpoints/step-00000040`: enough to tell a run's checkpoints apart in a note."""
    return f"{path.parent.name}/{path.name}"
