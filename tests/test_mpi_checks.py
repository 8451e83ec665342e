"""Runs the grouped MPI check scripts (one launch each) and reports each check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_mpi_script

# script: the world sizes it runs at (check_core carves grids up to 2x3 out of 6 ranks).
SCRIPTS = {
    "tests/mpi/check_data_parallel.py": (2, 4),
    "tests/mpi/check_core.py": (6,),
    "tests/mpi/check_model_grid.py": (4,),
    "tests/mpi/check_domain.py": (4,),
    "tests/mpi/check_easgd.py": (4,),
    "tests/mpi/check_sparse.py": (2, 4),
}


def _declared_checks(script: str) -> list[str]:
    tree = ast.parse((ROOT / script).read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(getattr(d, "id", None) == "check" for d in node.decorator_list)]


@pytest.mark.parametrize("script,ranks", [(s, n) for s, sizes in SCRIPTS.items() for n in sizes])
def test_mpi_checks(script: str, ranks: int, tmp_path: Path) -> None:
    result = run_mpi_script(script, ranks, str(tmp_path))
    passed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    declared = _declared_checks(script)
    assert declared, "no checks found"
    missing = [name for name in declared if name not in passed]
    assert result.returncode == 0 and not missing, (
        f"{script} on {ranks} ranks: exit {result.returncode}, not passed: {missing}\n"
        f"{result.stderr[-4000:]}")


def test_scripts_exist() -> None:
    for script in SCRIPTS:
        assert Path(ROOT / script).exists()
