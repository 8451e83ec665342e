"""What the reproductions share: runs launched through gridrun's own command line (as a user
would type them, each into its own run directory), reading those directories back, and the
markdown and figure helpers of the pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from runner.report.data import Run, finite, load_run

DPI = 110
Log = Callable[[str], None]


class RunFailed(RuntimeError):
    """A launched run that exited non-zero; the message is its last line of output."""


@dataclass(frozen=True)
class Launch:
    """One `python -m runner OVERRIDES hydra.run.dir=RUN_DIR`."""

    overrides: tuple[str, ...]
    run_dir: Path

    def command(self) -> list[str]:
        return [sys.executable, "-m", "runner", *self.overrides, f"hydra.run.dir={self.run_dir}"]

    def shown(self) -> str:
        """The command as a user would type it (without the run directory)."""
        return "python -m runner " + " ".join(self.overrides)


def launch(job: Launch, timeout_s: float = 300.0) -> Run:
    """Run `job` to its end and read its run directory; `RunFailed` if it did not complete."""
    done = subprocess.run(job.command(), capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise RunFailed(lines[-1] if lines else f"exit code {done.returncode}")
    return load_run(job.run_dir)


def optimizer_missing(name: str) -> str | None:
    """Why `optimizer=name` cannot run in this checkout (no config file, not registered), or
    None when it can."""
    from runner.cli.compose import CONF_DIR
    from runner.config.registry import OPTIMIZERS, load_plugins

    load_plugins()
    if not (CONF_DIR / "optimizer" / f"{name}.yaml").is_file():
        return f"`optimizer={name}` is not in this checkout yet (no conf/optimizer/{name}.yaml)"
    if name not in OPTIMIZERS:
        return f"`optimizer={name}` has a config but no registered optimizer yet"
    return None


def time_to_target(run: Run, target: float) -> tuple[int, float] | None:
    """(step, training time in s) of the first validation at or above `target` accuracy."""
    for record in run.val:
        accuracy, time_s = record.get("accuracy"), record.get("time_s")
        if finite(accuracy) and finite(time_s) and accuracy >= target:
            return int(record["step"]), float(time_s)
    return None


def comm_share(run: Run) -> float | None:
    """Time blocked in communication over step time, summed over the training steps."""
    comm = [r["comm_time_s"] for r in run.train
            if finite(r.get("comm_time_s")) and finite(r.get("step_time_s"))]
    steps = [r["step_time_s"] for r in run.train
             if finite(r.get("comm_time_s")) and finite(r.get("step_time_s"))]
    return sum(comm) / sum(steps) if steps and sum(steps) > 0 else None


def load_average() -> float:
    """This machine's 1-minute load average (every process's, not only ours)."""
    return os.getloadavg()[0]


def machine_note(data: dict[str, Any]) -> str:
    """A sentence on how busy the machine was while a section ran, for its page."""
    load = data.get("load")
    if not load:
        return ""
    return (f"While these runs ran, the machine's 1-minute load average went from {load[0]:.1f} "
            f"to {load[1]:.1f} on {data.get('cores', '?')} cores (every process on it, other "
            "users' too). A load above the core count means ranks waited for a core, and "
            "every timing above grew with it.")


def median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Any, spec: str = ".3g", missing: str = "—") -> str:
    return format(value, spec) if finite(value) else missing


def percent(value: Any) -> str:
    return f"{value:.0%}" if finite(value) else "—"


def save(fig: Figure, path: Path) -> str:
    """Write `fig` as a PNG; its file name, as the page links it."""
    fig.savefig(path, dpi=DPI)
    return path.name


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return loaded if isinstance(loaded, dict) else None
