"""`python -m runner.cli.worker RUN_DIR`: one rank of a training job the head started.

The launcher starts this once per rank; it forks the rank under its supervisor
(`runner.training.supervisor`) and the rank trains (`runner.training.rank`), tells its supervisor
it finished, then ends without the interpreter's teardown (`runner.records.process`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from runner.records.process import defer_full_collections, end_process
from runner.training.mpienv import detect_mpi_environment
from runner.training.supervisor import mark_finished, supervise


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m runner.cli.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[1])
    defer_full_collections()  # until the rank trains (runner.records.process)
    job = detect_mpi_environment()
    if job is not None and hasattr(os, "fork"):
        code = supervise(run_dir, job.rank)
        if code is not None:
            return code
    from mpi4py import MPI

    from runner.training.rank import run_rank

    code = run_rank(run_dir, MPI.COMM_WORLD)
    mark_finished()  # an exit before this is the supervisor's to name as unfinished
    end_process(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
