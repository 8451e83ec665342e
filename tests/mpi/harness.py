"""The runner of the MPI check scripts: `@check` functions run in order on every rank; rank 0
prints `ok <name>` for each one that passed on all ranks; a failure prints that rank's
traceback and aborts the job (tests/test_mpi_checks.py reads the `ok` lines)."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

CHECKS: list[Callable[[], None]] = []


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


def run_checks() -> None:
    world = MPI.COMM_WORLD
    # GRIDRUN_CHECKS=name1,name2 runs only those (for debugging one check by hand)
    only = {n for n in os.environ.get("GRIDRUN_CHECKS", "").split(",") if n}
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
        try:
            fn()
            world.Barrier()
            if world.Get_rank() == 0:
                print(f"ok {fn.__name__}", flush=True)
        except BaseException:
            sys.stderr.write(f"[rank {world.Get_rank()}] {fn.__name__} FAILED\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            world.Abort(1)


def train_run(config: dict[str, Any], run_dir: Path, grid: Any) -> Path:
    """train() on `grid` with a plain config dict, the directory made by the grid's rank 0."""
    from omegaconf import OmegaConf

    from runner.rundir import RunDir
    from runner.train import train
    from runner.validation import validate

    cfg = OmegaConf.create(config)
    directory = RunDir(run_dir)
    if grid.rank == 0:
        directory.create(cfg)
    grid.world.barrier()
    train(validate(cfg, world_size=grid.size), directory, grid)
    return directory.path


def train_losses(path: Path) -> tuple[list[float], list[dict]]:
    """The training losses of a run directory, and its training lines."""
    lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [m for m in lines if "split" not in m]
    return [m["loss"] for m in train_lines], train_lines
