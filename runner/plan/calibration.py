"""α and β of this machine's MPI: measured, stored, and found again by plans and runs.

`measure()` starts a small MPI job: a ping-pong between 2 ranks and an all-reduce sweep on 4,
over message sizes from 8 B to 4 MiB. A least-squares fit of t = α + β·n to the ping-pong gives
the point-to-point values; a fit of the all-reduce times to 2(α⌈log₂ p⌉ + β(p−1)/p·n) gives the
values the planner uses (training steps are collectives). Both are stored as JSON at
`calibration_path()`, where `runner.machine` finds them for every later plan and run.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from runner.machine import calibration_path
from runner.rundir import write_json

SIZES = [8 << k for k in range(0, 20, 2)]  # 8 B .. 2 MiB


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


def _run(kind: str, ranks: int, repeats: int) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, "-m",
                          "runner.plan.calibration", kind, str(repeats)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(repeats: int = 20, collective_ranks: int = 4) -> dict:
    """Measure, fit, store; returns what was stored."""
    from runner.core.cost import log2_ceil

    ping = _run("pingpong", 2, repeats)
    alpha_p2p, beta_p2p = fit([float(n) for n in ping["sizes"]], ping["seconds"])
    sweep = _run("allreduce", collective_ranks, repeats)
    p = collective_ranks
    # t = 2α⌈log p⌉ + 2β(p−1)/p n: fit intercept and slope, then undo the factors
    a, b = fit([float(n) for n in sweep["sizes"]], sweep["seconds"])
    result = {
        "point_to_point": {"alpha": max(alpha_p2p, 0.0), "beta": beta_p2p,
                           "ranks": 2, "sizes": ping["sizes"], "seconds": ping["seconds"]},
        "collective": {"alpha": max(a / (2 * log2_ceil(p)), 0.0), "beta": b / (2 * (p - 1) / p),
                       "ranks": p, "sizes": sweep["sizes"], "seconds": sweep["seconds"]},
        "local": measure_local(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return result


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
