"""α and β of this machine's MPI: measured, stored, and found again by plans and runs.

`measure()` starts small MPI jobs on this machine: a ping-pong between 2 ranks and an all-reduce
sweep on up to 4 (never more ranks than this process may use cores: `calibration_ranks`), over
message sizes from 8 B to 2 MiB. A least-squares fit of t = α + β·n to the ping-pong gives the
point-to-point values; a fit of the all-reduce times to 2(α⌈log₂ p⌉ + β(p−1)/p·n) gives the
values the planner uses (training steps are collectives). Both are stored as JSON at
`calibration_path()` (the user's cache, one file per host), where `runner.machine` finds them
for every later plan and run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from runner.machine import calibration_path
from runner.rundir import write_json

SIZES = [8 << k for k in range(0, 20, 2)]  # 8 B .. 2 MiB
PINGPONG_RANKS = 2
MAX_COLLECTIVE_RANKS = 4


class CalibrationRefused(ValueError):
    """This machine cannot be calibrated honestly (bad input: the command exits 2)."""


class CalibrationFailed(RuntimeError):
    """The measurement itself failed (no mpiexec, a rank failed)."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as a batch system sets it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def calibration_ranks(cores: int) -> int:
    """The all-reduce sweep's ranks: up to 4, but never more than `cores`.

    A rank without a core of its own waits for a descheduled peer inside every collective, so
    an oversubscribed sweep measures the scheduler (4 ranks on 2 cores stored α ≈ 4 ms, a
    latency no MPI has), and every later plan and run would be priced with it. We measure
    on fewer ranks instead of refusing: α and β are per message and per byte, the ranks only
    enter through the fit's ⌈log₂ p⌉ and (p−1)/p factors, so 2 ranks on a 2-core machine give the
    values, and refusing would leave the common small machine uncalibrated. With fewer than 2
    cores even the ping-pong would be oversubscribed: refused.
    """
    if cores < PINGPONG_RANKS:
        raise CalibrationRefused(
            f"plan.calibrate=true needs at least {PINGPONG_RANKS} usable cores (one per rank), "
            f"this process may use {cores}: an oversubscribed measurement would store the "
            "scheduler's latency as α; calibrate where the job will run, or give "
            "plan.alpha and plan.beta")
    return min(MAX_COLLECTIVE_RANKS, cores)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def _worker(kind: str, repeats: int) -> None:
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    times = []
    for nbytes in SIZES:
        buf = torch.zeros(nbytes // 4)
        samples = []
        for i in range(repeats + 2):
            comm.Barrier()
            start = time.perf_counter()
            if kind == "pingpong":
                if rank == 0:
                    comm.Send(buf, dest=1)
                    comm.Recv(buf, source=1)
                elif rank == 1:
                    comm.Recv(buf, source=0)
                    comm.Send(buf, dest=0)
            else:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            elapsed = time.perf_counter() - start
            if i >= 2:
                samples.append(elapsed / 2 if kind == "pingpong" else elapsed)
        times.append(statistics.median(samples))
    if rank == 0:
        print(json.dumps({"kind": kind, "ranks": size, "sizes": SIZES, "seconds": times}))


def measure_local(rows: int = 200_000, width: int = 64, touched: int = 50_000,
                  repeats: int = 5) -> dict:
    """Seconds per byte of the local work the sparse exchange's choice weighs (one thread, as a
    rank runs): a dense update's passes over a table, and a row the sparse path coalesces and
    adds into the table at random places."""
    import torch

    from runner.core.sparse import coalesce_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        table, grad = torch.randn(rows, width, generator=gen), torch.zeros(rows, width)
        indices = torch.randint(0, rows, (touched,), generator=gen)
        values = torch.randn(touched, width, generator=gen)

        def dense_update() -> None:
            grad.zero_()
            table.add_(grad, alpha=-0.1)

        def sparse_update() -> None:
            unique, summed = coalesce_rows(indices, values)
            table.index_add_(0, unique, summed, alpha=-0.1)

        def median_time(fn: object) -> float:
            samples = []
            for i in range(repeats + 1):
                start = time.perf_counter()
                fn()  # type: ignore[operator]
                if i:
                    samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        row_bytes = width * 4
        return {"table_pass": median_time(dense_update) / (rows * row_bytes),
                "sparse_row": median_time(sparse_update) / (touched * row_bytes)}
    finally:
        torch.set_num_threads(threads)


def _mpiexec() -> str:
    """The mpiexec beside this Python (the `mpich` wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise CalibrationFailed("no mpiexec found: install the bundled MPI (pip install mpich) "
                                "or put the site's mpiexec on PATH")
    return found


def _run(kind: str, ranks: int, repeats: int) -> dict:
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "runner.plan.calibration",
               kind, str(repeats)]
    out = subprocess.run(command, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        said = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrationFailed(f"the {ranks}-rank {kind} measurement failed "
                                f"(exit code {out.returncode}): {said}")
    result: dict = json.loads(lines[-1])
    return result


def measure(repeats: int = 20, collective_ranks: int | None = None) -> dict:
    """Measure, fit, store; returns what was stored. `collective_ranks`: the all-reduce sweep's
    ranks (default `calibration_ranks(usable_cores())`); more than the usable cores is refused."""
    from runner.core.cost import log2_ceil

    cores = usable_cores()
    most = calibration_ranks(cores)  # refuses below 2 cores: the ping-pong needs them too
    if collective_ranks is None:
        collective_ranks = most
    elif not PINGPONG_RANKS <= collective_ranks <= cores:
        raise CalibrationRefused(f"an all-reduce sweep on {collective_ranks} ranks: needs "
                                 f"{PINGPONG_RANKS} to {cores} ranks here (a core each)")
    ping = _run("pingpong", PINGPONG_RANKS, repeats)
    alpha_p2p, beta_p2p = fit([float(n) for n in ping["sizes"]], ping["seconds"])
    sweep = _run("allreduce", collective_ranks, repeats)
    p = collective_ranks
    # t = 2α⌈log p⌉ + 2β(p−1)/p n: fit intercept and slope, then undo the factors
    a, b = fit([float(n) for n in sweep["sizes"]], sweep["seconds"])
    result = {
        "point_to_point": {"alpha": max(alpha_p2p, 0.0), "beta": beta_p2p,
                           "ranks": PINGPONG_RANKS, "sizes": ping["sizes"],
                           "seconds": ping["seconds"]},
        "collective": {"alpha": max(a / (2 * log2_ceil(p)), 0.0), "beta": b / (2 * (p - 1) / p),
                       "ranks": p, "sizes": sweep["sizes"], "seconds": sweep["seconds"]},
        "local": measure_local(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": socket.gethostname(),
        "usable_cores": cores,
    }
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return result


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
