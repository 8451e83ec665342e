"""What this machine's communication and local work cost: the stored calibration
(`python -m runner.plan plan.calibrate=true` measures it), or defaults.

Read by every tool that chooses from the cost model (training, the planner, the benchmarks);
written only by `runner.plan.calibration`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from runner.core.cost import (
    DEFAULT_ALPHA,
    DEFAULT_BETA,
    DEFAULT_SPARSE_ROW,
    DEFAULT_TABLE_PASS,
    MachineCosts,
)
from runner.rundir import PROJECT_ROOT


def calibration_path() -> Path:
    return Path(os.environ.get("GRIDRUN_CALIBRATION",
                               PROJECT_ROOT / ".calibration" / "alpha_beta.json"))


def load_machine_costs(alpha: float | None = None,
                       beta: float | None = None) -> MachineCosts:
    """Explicit values first, then the stored calibration, then the defaults."""
    path = calibration_path()
    stored, local = None, {}
    if path.exists():
        try:
            everything = json.loads(path.read_text())
            stored, local = everything["collective"], everything.get("local", {})
        except (json.JSONDecodeError, KeyError):
            stored = None
    costs = {"table_pass": local.get("table_pass", DEFAULT_TABLE_PASS),
             "sparse_row": local.get("sparse_row", DEFAULT_SPARSE_ROW)}
    if alpha is not None and beta is not None:
        return MachineCosts(alpha, beta, source="given", **costs)
    if stored is not None:
        return MachineCosts(alpha if alpha is not None else stored["alpha"],
                            beta if beta is not None else stored["beta"],
                            source=f"calibrated ({path})", **costs)
    return MachineCosts(alpha if alpha is not None else DEFAULT_ALPHA,
                        beta if beta is not None else DEFAULT_BETA,
                        source="default (not calibrated: python -m runner.plan "
                               "plan.calibrate=true)", **costs)
