"""The runner of the MPI check scripts: `@check` functions run in order on every rank; rank 0
prints `ok <name> <seconds>s` for each one that passed on all ranks; a failure prints that rank's
traceback and aborts the job (tests/test_mpi_checks.py reads the `ok` lines).

The communication backend the scripts' grids use is `BACKEND`: `--backend=mpi|torch` among a
script's arguments (taken out of `sys.argv`, so the script's own arguments keep their places),
else the variable GRIDRUN_BACKEND, else mpi. Under "torch" importing this module joins
torch.distributed (collective: every rank imports it first), and `run_checks` leaves it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI

CHECKS: list[Callable[[], None]] = []
# The process groups' own timeout under "torch" is about 3 minutes past this: a hang raises a
# transport error with a traceback before the test's 240 s are up.
COMM_TIMEOUT_S = 60.0


def _backend() -> str:
    for arg in sys.argv[1:]:
        if arg.startswith("--backend="):
            sys.argv.remove(arg)
            return arg.partition("=")[2]
    return os.environ.get("GRIDRUN_BACKEND", "mpi")


BACKEND: Any = _backend()
if BACKEND not in ("mpi", "torch"):
    raise SystemExit(f"unknown backend {BACKEND!r}: mpi or torch")
if BACKEND == "torch":
    from runner.core.torchdist import init_torch_distributed

    init_torch_distributed(MPI.COMM_WORLD, timeout_s=COMM_TIMEOUT_S)


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS.append(fn)
    return fn


def run_checks() -> None:
    from runner.records.process import start_up_done

    start_up_done()  # collections as usual again (tests/mpi/start.py deferred them)
    world = MPI.COMM_WORLD
    # GRIDRUN_CHECKS=name1,name2 runs only those (for debugging one check by hand)
    only = {n for n in os.environ.get("GRIDRUN_CHECKS", "").split(",") if n}
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
        try:
            started = time.perf_counter()
            fn()
            world.Barrier()
            if world.Get_rank() == 0:
                print(f"ok {fn.__name__} {time.perf_counter() - started:.2f}s", flush=True)
        except BaseException:
            sys.stderr.write(f"[rank {world.Get_rank()}] {fn.__name__} FAILED\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            world.Abort(1)
    if BACKEND == "torch":
        from runner.core.torchdist import shutdown_torch_distributed

        shutdown_torch_distributed()


def make_grids(shapes: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """A `ProcessGrid` (with `BACKEND`) for each (pr, pc) on the world's first pr·pc ranks, None
    on the ranks outside it; a grid of one rank has no MPI. Collective over the world: every
    rank calls it, with the same shapes, before any check uses them.

    Made all at once rather than as each check reaches a grid: a rank outside a grid would
    otherwise wait for the next one in an MPI call, and MPI waits by spinning, which takes the
    cores away from the ranks of the grid at work when they wait in torch.distributed (which
    sleeps): that tripled the torch backend's time on 6 ranks of 2 cores."""
    from runner.core import ProcessGrid

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    grids: dict[tuple[int, int], Any] = {}
    for pr, pc in shapes:
        size = pr * pc
        sub = world.Split(0 if rank < size else MPI.UNDEFINED, rank)
        grid = grids[pr, pc] = (None if sub == MPI.COMM_NULL else
                                ProcessGrid(pr, pc, sub if size > 1 else None, backend=BACKEND))
        if grid is not None and size > 1:
            assert grid.world.backend == BACKEND, grid
    return grids


def train_run(config: dict[str, Any], run_dir: Path, grid: Any) -> Path:
    """train() on `grid` with a plain config dict, the directory made by the grid's rank 0."""
    from omegaconf import OmegaConf

    from runner.cli.validation import validate
    from runner.records.rundir import RunDir
    from runner.training.loop import train

    cfg = OmegaConf.create(config)
    directory = RunDir(run_dir)
    if grid.rank == 0:
        directory.create(cfg)
    grid.world.barrier()
    train(validate(cfg, world_size=grid.size), directory, grid)
    return directory.path


def wait_politely() -> None:
    """A barrier that sleeps while it waits: MPI's own spins, taking the shared cores from the
    ranks still at work."""
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def one_process_losses(runs: dict[str, tuple[dict[str, Any], Path]]) -> dict[str, list[float]]:
    """The training losses of one-process runs (`name: (config, run directory)`), for every
    rank: each trained on one rank, side by side, rather than one after another on rank 0
    while the others wait. Collective over the world."""
    from runner.core import ProcessGrid

    world = MPI.COMM_WORLD
    mine = {}
    for index, (name, (config, run_dir)) in enumerate(runs.items()):
        if index % world.Get_size() == world.Get_rank():
            mine[name] = train_losses(train_run(config, run_dir, ProcessGrid(1, 1)))[0]
    wait_politely()
    return {name: losses for part in world.allgather(mine) for name, losses in part.items()}


def train_losses(path: Path) -> tuple[list[float], list[dict]]:
    """The training losses of a run directory, and its training lines."""
    lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [m for m in lines if "split" not in m]
    return [m["loss"] for m in train_lines], train_lines


def assert_one_process(path: Path, reference: list[float], tolerance: float, what: str) -> None:
    """The run in `path` gave the one process's losses `reference` (relative `tolerance`) and
    moved every step exactly the bytes its summary predicted."""
    got, lines = train_losses(path)
    gap = max(abs(a - b) / abs(b) for a, b in zip(got, reference, strict=True))
    assert gap <= tolerance, f"{what}: losses {got}, one process's {reference} (gap {gap:.2e})"
    predicted = json.loads((path / "summary.json").read_text())["predicted_comm_bytes_per_step"]
    assert all(m["comm_bytes"] == predicted for m in lines), (
        f"{what}: measured {[m['comm_bytes'] for m in lines]}, predicted {predicted}")
