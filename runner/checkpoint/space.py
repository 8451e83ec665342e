"""Room for the checkpoints: what one takes, and whether the filesystem has it (the head's
check before training)."""

from __future__ import annotations

import shutil
from pathlib import Path

from runner.records.rundir import nearest_existing


def checkpoint_bytes(param_bytes: int, replicas: int, per_replica: bool, has_centre: bool,
                     state_kinds: int) -> int:
    """Bytes of one checkpoint: the weights (each replica's own when they differ), the centre,
    and the optimizer's per-parameter state alongside the weights."""
    copies = replicas if per_replica else 1
    return param_bytes * (copies * (1 + state_kinds) + int(has_centre))


def space_problem(directory: Path, needed: int, what: str) -> str | None:
    """One line when the filesystem of `directory` (or its nearest existing ancestor) has less
    than `needed` bytes free."""
    existing = nearest_existing(directory)
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return (f"not enough disk space under {existing}: {what} need about {_mib(needed)}, "
            f"{_mib(free)} free")


def _mib(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"
