"""What is checked on the machine before a run starts, after the config itself is valid: that
the launcher exists, that the run directory can be made and written, and that its disk has room
for the checkpoints the run will keep. A problem is one line, before any MPI job exists."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from runner.checkpoint import checkpoint_bytes, space_problem
from runner.config import LauncherConfig, RunConfig
from runner.rundir import unwritable

MIN_FREE_BYTES = 16 << 20  # logs, metrics and the summary of any run


def bundled_mpiexec() -> str | None:
    """The mpiexec installed beside this Python (the `mpich` wheel), else one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def launcher_problems(launcher: LauncherConfig) -> list[str]:
    argv = launcher.argv
    command = argv[0] if argv else bundled_mpiexec()
    if command is None:
        return ["no mpiexec found: install the bundled MPI (pip install mpich) or set "
                "launcher.command to your site's launcher"]
    if shutil.which(command) is None:
        return [f"launcher.command={command}: not found or not executable"]
    return []


def parameter_bytes(run: RunConfig) -> int:
    """The sequential model's parameter bytes (built on the meta device: no memory used)."""
    from runner import assembly

    spec = assembly.build_dataset(run.dataset).spec()
    model = assembly.model_for(run.model, spec, assembly.dtype_of(run), device="meta")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_space_needed(run: RunConfig) -> tuple[int, str]:
    """Bytes the run directory needs, and what for."""
    if not run.trainer.checkpoint_every:
        return MIN_FREE_BYTES, "the run's logs"
    from runner import assembly

    optimizer = assembly.optimizer_class(run.optimizer)
    has_state = any(float(run.optimizer.options.get(k) or 0) > 0 for k in ("momentum",))
    one = checkpoint_bytes(parameter_bytes(run), run.grid.pc, optimizer.per_replica,
                           optimizer.has_centre, int(has_state))
    kept = (run.trainer.keep_checkpoints or max(1, run.trainer.steps
                                                // run.trainer.checkpoint_every)) + 1
    # the ones kept, and the next one being written
    return (MIN_FREE_BYTES + one * kept,
            f"{kept} checkpoints of {one / (1 << 20):,.1f} MiB and the logs")


def machine_problems(run: RunConfig, run_dir: Path, inside_mpi_job: bool = False) -> list[str]:
    """Every reason this machine cannot run `run` into `run_dir` (empty: go)."""
    problems = [] if inside_mpi_job or run.grid.size == 1 else launcher_problems(run.launcher)
    problem = unwritable(run_dir)
    if problem:
        return [*problems, problem]
    needed, what = checkpoint_space_needed(run)
    problem = space_problem(run_dir, needed, what)
    return [*problems, problem] if problem else problems
