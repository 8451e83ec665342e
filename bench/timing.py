"""What the benchmarks share: starting their MPI worker, and timing with every rank starting each
repetition together."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_worker(script: str, ranks: int, *args: str) -> dict[str, Any]:
    """`mpiexec -n ranks python script --worker args` with one thread per rank; rank 0's last
    stdout line, parsed as JSON."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, script, "--worker",
                          *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    """A TCP port on this host nobody listens on (torch.distributed's rendezvous for a DDP
    baseline)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def barrier_timed(comm: Any, fn: Callable[[], object], repeats: int,
                  warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones, each started
    right after a barrier (so no rank's time includes waiting for a late starter)."""
    times = []
    for i in range(warmup + repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
