"""The run directory: the contract other tools read (DESIGN.md, "Run directory").

    config.yaml        the fully resolved config the ranks ran
    metrics.jsonl      one JSON object per logged step
    summary.json       the outcome
    logs/rank<k>.log   each rank's log
    checkpoints/       sharded checkpoints
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from omegaconf import DictConfig, OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunDir:
    path: Path

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
        self.logs.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config, OmegaConf.to_yaml(cfg, resolve=True))

    def read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.summary.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
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
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary name, flush it to disk, then rename: readers never see a
    half-written file, and a crash never leaves a complete name over incomplete contents."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


class MetricsWriter:
    """One JSON line per record, flushed, so a crash loses at most the last line. A new run
    starts a new file: rerunning into the same directory must not mix two runs' lines. A run
    resumed at step s keeps the lines up to s and continues after them (the lines of steps
    after s are dropped: those steps run again)."""

    def __init__(self, path: Path, continue_after: int | None = None) -> None:
        if continue_after is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if (step := _line_step(line)) is not None and step <= continue_after]
            atomic_write_text(path, "".join(f"{line}\n" for line in kept))
            self._file: TextIO = path.open("a", buffering=1)
        else:
            self._file = path.open("w", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def _line_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a crash


def git_commit() -> str | None:
    """The project's commit, with '+dirty' when the working tree has changes."""
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
