"""Runs the grouped MPI check scripts (one launch each) and reports each check, under each
communication backend: mpi4py ("mpi") and torch.distributed on gloo ("torch")."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_mpi_script

# script: the world sizes it runs at, per backend (check_core carves grids up to 2x3 out of 6
# ranks). A script runs the checks of the check scripts it imports in its own launch (a launch
# of 4 ranks costs ~6 s of CPU in interpreters and torch before any check; with the transformers
# library, ~17 s). The torch variants run at one size each where the mpi ones run at two: the
# larger, whose grids and uneven pieces cover more. check_easgd stays on mpi: its windows are
# MPI's under either backend. check_model_grid (with check_domain and check_layouts) runs under
# torch with `make test-backends` (GRIDRUN_TEST_ALL_BACKENDS=1: ~31 s more on 2 cores, where
# gloo is slow) and under mpi only in `make test`, for its time: there their strategies' torch
# path is covered end to end by the command-line runs of tests/test_cli_runs.py (grid 2 x 2,
# domain 2 x 2, auto 2 x 2: one process's losses, the predicted bytes), and every operation
# they use by check_core's adjoint tests.
ALL_BACKENDS = os.environ.get("GRIDRUN_TEST_ALL_BACKENDS") == "1"
BOTH: dict[str, tuple[int, ...]] = {"mpi": (4,), **({"torch": (4,)} if ALL_BACKENDS else {})}
SCRIPTS: dict[str, dict[str, tuple[int, ...]]] = {
    # with check_sparse.py (the sparse exchange of embedding gradients)
    "tests/mpi/check_data_parallel.py": {"mpi": (2, 4), "torch": (4,)},
    "tests/mpi/check_core.py": {"mpi": (6,), "torch": (6,)},
    # with check_domain.py and check_layouts.py (per-layer layouts, strategy=auto)
    "tests/mpi/check_model_grid.py": BOTH,
    "tests/mpi/check_easgd.py": {"mpi": (4,)},
    # with check_tensor_parallel.py and check_sequence.py
    "tests/mpi/check_gpt.py": {"mpi": (4,)},
    # parallel plans by module name: the transformers library's models, a user's block; with
    # check_plan_vocab (a head split by vocabulary, scored split), check_plan_resume
    # (planned runs resumed on other grids and strategies; vision transformers by plan),
    # check_fsdp (sharded data parallelism at every stage), check_corpus (the conformance
    # corpus: every model under every strategy, or refused) and check_weights (pretrained
    # weights loaded per rank under every layout, exported, fine-tuned as one process)
    "tests/mpi/check_plans.py": {"mpi": (4,)},
}
CASES = [(script, ranks, backend) for script, backends in SCRIPTS.items()
         for backend, sizes in backends.items() for ranks in sizes]


def _declared_checks(script: str) -> list[str]:
    """The script's checks, and those of the check scripts it imports (they run in its
    launch)."""
    path = ROOT / script
    tree = ast.parse(path.read_text())
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
             and any(getattr(d, "id", None) == "check" for d in node.decorator_list)]
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("check_"):
                    imported = path.parent / f"{alias.name}.py"
                    names += _declared_checks(str(imported.relative_to(ROOT)))
    return names


@pytest.mark.parametrize("script,ranks,backend", CASES)
def test_mpi_checks(script: str, ranks: int, backend: str, tmp_path: Path) -> None:
    result = run_mpi_script(script, ranks, str(tmp_path), f"--backend={backend}")
    passed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    declared = _declared_checks(script)
    assert declared, "no checks found"
    missing = [name for name in declared if name not in passed]
    assert result.returncode == 0 and not missing, (
        f"{script} on {ranks} ranks ({backend}): exit {result.returncode}, not passed: "
        f"{missing}\n{result.stderr[-4000:]}")


@pytest.mark.parametrize("mode", ["blocking", "nonblocking"])
def test_a_hung_rank_ends_a_torch_job(mode: str) -> None:
    """Rank 1 sleeps outside any collective; rank 0's watchdog (1 s) ends the 2-rank job from
    its thread while rank 0 is blocked in gloo (under "mpi", tests/test_failures.py's hang
    through the command line)."""
    started = time.monotonic()
    result = run_mpi_script("tests/mpi/hang.py", 2, mode, "--backend=torch", timeout=60)
    elapsed = time.monotonic() - started
    op = "allreduce" if mode == "blocking" else "iallreduce"
    assert result.stdout.splitlines() == ["waiting"], result.stdout
    assert result.returncode != 0, result.stderr
    assert (f"rank 0: {op} 'hang' on group world (2 ranks) did not complete within 1 s"
            in result.stderr), result.stderr
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"


def test_a_grid_of_one_process_needs_neither_mpi_nor_torch_distributed() -> None:
    from runner.core import ProcessGrid
    from runner.core.torchdist import (
        init_torch_distributed,
        shutdown_torch_distributed,
        torch_distributed_ready,
    )

    init_torch_distributed(None)  # one process: nothing to start
    assert not torch_distributed_ready()
    grid = ProcessGrid(1, 1, backend="torch")
    assert (grid.size, grid.world.size, grid.backend) == (1, 1, "torch")
    shutdown_torch_distributed()  # nothing to end
    with pytest.raises(ValueError, match="unknown communication backend 'nccl'; one of mpi, "
                                         "torch"):
        ProcessGrid(1, 1, backend="nccl")  # type: ignore[arg-type]


def test_scripts_exist() -> None:
    for script in SCRIPTS:
        assert Path(ROOT / script).exists()
