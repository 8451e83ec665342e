"""What this machine's communication, local work and compute cost: the stored calibration
(`gridrun-plan plan.calibrate=true` measures it), or defaults.

The calibration is per machine and belongs to the user, not to an installation:
`$GRIDRUN_CALIBRATION` if set, else `${XDG_CACHE_HOME:-~/.cache}/gridrun/calibration-<host>.json`.
Read by every tool that chooses from the cost model (training, the planner, the benchmarks);
written only by `runner.plan.calibration`. A calibration made where torch sees a GPU also holds
that GPU's compute rates and its collectives' α–β under "devices", by the GPU's name: a run or
plan on that GPU (`device`, `pricing_device`) is priced with them.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the cost model imports torch: `calibration_path` (for --help) needs none
    from runner.cost.collectives import MachineCosts
    from runner.cost.compute import ComputeRates


def cache_dir() -> Path:
    """gridrun's directory in the user's cache (XDG: a relative `$XDG_CACHE_HOME` is ignored)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "gridrun"


def cache_subdir(name: str, configured: str | None = None) -> Path:
    """Where gridrun keeps one kind of cached files (`tokens`, `compile`): `configured` (a
    config option), else `$GRIDRUN_CACHE/<name>`, else `cache_dir()/<name>`."""
    if configured:
        return Path(configured).expanduser()
    explicit = os.environ.get("GRIDRUN_CACHE")
    if explicit:
        return Path(explicit).expanduser() / name
    return cache_dir() / name


def calibration_path() -> Path:
    """Where this machine's calibration is stored: `$GRIDRUN_CALIBRATION`, else a file per host
    in the user's cache (machines sharing a home directory keep their own)."""
    explicit = os.environ.get("GRIDRUN_CALIBRATION")
    if explicit:
        return Path(explicit)
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"
    return cache_dir() / f"calibration-{host}.json"


def _stored() -> dict[str, Any] | None:
    """The stored calibration (None: none, or a file that cannot be read or parsed)."""
    path = calibration_path()
    try:
        stored = json.loads(path.read_text()) if path.exists() else None
    except (OSError, json.JSONDecodeError):
        return None
    return stored if isinstance(stored, dict) else None


def _device_record(stored: Mapping[str, Any] | None, device: str | None) -> Mapping[str, Any]:
    """The calibration's record of the GPU named `device` (empty: none asked for, or none
    stored for it)."""
    if stored is None or device is None:
        return {}
    record = (stored.get("devices") or {}).get(device)
    return record if isinstance(record, Mapping) else {}


def calibrated_devices() -> list[str]:
    """The names of the GPUs the stored calibration holds rates for."""
    return sorted((_stored() or {}).get("devices") or {})


def pricing_device(setting: str) -> str | None:
    """The GPU whose calibration prices a run with `trainer.device=setting`: None on the CPU;
    otherwise the name of the GPU torch sees here (the current one), or where it sees none (a
    plan made away from the GPUs) the one GPU the calibration holds, if it holds one."""
    if setting == "cpu":
        return None
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    stored = calibrated_devices()
    return stored[0] if setting == "cuda" and len(stored) == 1 else None


def load_machine_costs(alpha: float | None = None, beta: float | None = None,
                       device: str | None = None) -> MachineCosts:
    """Explicit values first, then the stored calibration (the α and β of the GPU named
    `device` where it holds them), then the defaults."""
    from runner.cost.collectives import (
        DEFAULT_ALPHA,
        DEFAULT_BETA,
        DEFAULT_OVERSUBSCRIBED_SYNC,
        DEFAULT_SPARSE_ROW,
        DEFAULT_TABLE_PASS,
        MachineCosts,
    )

    path = calibration_path()
    stored, local, where = None, {}, str(path)
    everything = _stored()
    if everything is not None:
        try:
            stored, local = everything["collective"], everything.get("local", {})
        except KeyError:  # unreadable: as if not calibrated
            stored = None
        on_device = _device_record(everything, device).get("collective")
        if stored is not None and isinstance(on_device, Mapping):
            # the GPU's α and β; the runner's own costs per call are the host's
            stored = {**stored, "alpha": on_device["alpha"], "beta": on_device["beta"]}
            where = f"{path}, {device}"
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
                            source=f"calibrated ({where})", **costs)
    return MachineCosts(alpha if alpha is not None else DEFAULT_ALPHA,
                        beta if beta is not None else DEFAULT_BETA,
                        source="default (not calibrated: gridrun-plan plan.calibrate=true)",
                        **costs)


def load_compute_rates(device: str | None = None, precision: str = "fp32") -> ComputeRates:
    """This machine's compute rates: the stored calibration's "compute" section (of the GPU
    named `device` where it holds that GPU: its "compute_bf16" rates for a bf16 or fp16
    `precision`), else (not calibrated, calibrated before compute rates were measured, or a
    file that cannot be read or parsed) the defaults."""
    from runner.cost.compute import DEFAULT_RATES, ComputeRates

    path = calibration_path()
    everything = _stored()
    if everything is None:
        return DEFAULT_RATES
    record = _device_record(everything, device)
    key = "compute_bf16" if precision in ("bf16", "fp16") and "compute_bf16" in record else (
        "compute")
    try:
        if key in record:
            return ComputeRates.from_dict(record[key], source=f"calibrated ({path}, {device}"
                                          f"{', bf16' if key == 'compute_bf16' else ''})")
        return ComputeRates.from_dict(everything["compute"], source=f"calibrated ({path})")
    except (KeyError, TypeError, ValueError):
        return DEFAULT_RATES
