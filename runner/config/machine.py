"""What this machine's communication, local work and compute cost: the stored calibration
(`gridrun-plan plan.calibrate=true` measures it), or defaults.

The calibration is per machine and belongs to the user, not to an installation:
`$GRIDRUN_CALIBRATION` if set, else `${XDG_CACHE_HOME:-~/.cache}/gridrun/calibration-<host>.json`.
Read by every tool that chooses from the cost model (training, the planner, the benchmarks);
written only by `runner.plan.calibration`.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the cost model imports torch: `calibration_path` (for --help) needs none
    from runner.core.compute import ComputeRates
    from runner.core.cost import MachineCosts


def cache_dir() -> Path:
    """gridrun's directory in the user's cache (XDG: a relative `$XDG_CACHE_HOME` is ignored)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "gridrun"


def calibration_path() -> Path:
    """Where this machine's calibration is stored: `$GRIDRUN_CALIBRATION`, else a file per host
    in the user's cache (machines sharing a home directory keep their own)."""
    explicit = os.environ.get("GRIDRUN_CALIBRATION")
    if explicit:
        return Path(explicit)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"
    return cache_dir() / f"calibration-{host}.json"


def load_machine_costs(alpha: float | None = None,
                       beta: float | None = None) -> MachineCosts:
    """Explicit values first, then the stored calibration, then the defaults."""
    from runner.core.cost import (
        DEFAULT_ALPHA,
        DEFAULT_BETA,
        DEFAULT_OVERSUBSCRIBED_SYNC,
        DEFAULT_SPARSE_ROW,
        DEFAULT_TABLE_PASS,
        MachineCosts,
    )

    path = calibration_path()
    stored, local = None, {}
    if path.exists():
        try:
            everything = json.loads(path.read_text())
            stored, local = everything["collective"], everything.get("local", {})
        except (OSError, json.JSONDecodeError, KeyError):  # unreadable: as if not calibrated
            stored = None
    costs = {"table_pass": local.get("table_pass", DEFAULT_TABLE_PASS),
             "sparse_row": local.get("sparse_row", DEFAULT_SPARSE_ROW),
             "calls": tuple(sorted((stored or {}).get("calls", {}).items())),
             "oversubscribed_sync": (stored or {}).get("oversubscribed_sync",
                                                       DEFAULT_OVERSUBSCRIBED_SYNC)}
    if alpha is not None and beta is not None:
        return MachineCosts(alpha, beta, source="given", **costs)
    if stored is not None:
        return MachineCosts(alpha if alpha is not None else stored["alpha"],
                            beta if beta is not None else stored["beta"],
                            source=f"calibrated ({path})", **costs)
    return MachineCosts(alpha if alpha is not None else DEFAULT_ALPHA,
                        beta if beta is not None else DEFAULT_BETA,
                        source="default (not calibrated: gridrun-plan plan.calibrate=true)",
                        **costs)


def load_compute_rates() -> ComputeRates:
    """This machine's compute rates: the stored calibration's "compute" section, else (not
    calibrated, calibrated before compute rates were measured, or a file that cannot be read
    or parsed) the defaults."""
    from runner.core.compute import DEFAULT_RATES, ComputeRates

    path = calibration_path()
    if not path.exists():
        return DEFAULT_RATES
    try:
        stored = json.loads(path.read_text())["compute"]
        return ComputeRates.from_dict(stored, source=f"calibrated ({path})")
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return DEFAULT_RATES
