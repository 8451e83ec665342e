"""The sweep table: one row per multirun job, printed and written as CSV. No Hydra here."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from runner.records import safe_paths
from runner.records.console import plain, printable
from runner.records.rundir import atomic_write_text, unsafe_place

COLUMNS = ("job", "overrides", "status", "final_loss", "val_accuracy", "workers_val_accuracy",
           "wall_time_s", "median_step_time_s", "comm_time_share", "comm_bytes_per_step",
           "predicted_comm_bytes_per_step", "comm_time_s_per_step",
           "predicted_comm_time_s_per_step", "requeued", "run_dir", "error")


@dataclass(frozen=True)
class SweepJob:
    """One job's row: its overrides, its run directory and the `summary.json` read from there
    (None: the job failed, or wrote none), or why it failed; `requeued`: how many times Slurm
    started its batch job again (None: not a batch job)."""

    number: int
    overrides: Sequence[str]
    run_dir: str
    summary: Mapping[str, Any] | None
    error: str | None = None
    requeued: int | None = None


def sweep_rows(jobs: Sequence[SweepJob]) -> list[dict[str, Any]]:
    rows = []
    for job in jobs:
        summary = job.summary or {}
        row: dict[str, Any] = {key: summary.get(key) for key in COLUMNS}
        row.update(job=job.number, overrides=" ".join(job.overrides), run_dir=job.run_dir,
                   status="completed" if job.error is None else "failed", error=job.error,
                   requeued=job.requeued)
        rows.append(row)
    return rows


def make_sweep_dir(path: Path) -> None:
    """The sweep's directory (made where missing): what is written under it, its jobs' run
    directories too, is reached from it without following a link (`safe_paths`)."""
    safe_paths.register_root(path)
    safe_paths.make_dir(path, "")


def job_dir_refusal(sweep_dir: Path, subdir: str) -> str | None:
    """Why a job's run directory `sweep_dir/subdir` is not written (a link on the way to it or
    where the run writes in it), as one line; None when it can be."""
    refused = safe_paths.refusal_on_the_way(sweep_dir, subdir)
    return str(refused) if refused is not None else unsafe_place(sweep_dir / subdir)


def sweep_record_problem(args: Sequence[str]) -> str | None:
    """For a sweep whose directory is named on the command line (`-m hydra.sweep.dir=DIR`): a
    link in place of its `multirun.yaml`, which Hydra writes before any of gridrun's code runs,
    as one line; None otherwise (a sweep directory named by the time is new)."""
    if not {"-m", "--multirun"} & set(args):
        return None
    named = [a for a in args if a.startswith("hydra.sweep.dir=")]
    if not named:
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        value = OverridesParser.create().parse_override(named[-1]).value()
    except HydraException:
        return None  # Hydra names a bad override itself
    if not isinstance(value, str) or "${" in value or not Path(value).is_dir():
        return None
    refused = safe_paths.refusal_on_the_way(value, "multirun.yaml")
    return None if refused is None else str(refused)


def write_sweep_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, text.getvalue())


def _scaled(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_table(rows: Sequence[Mapping[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    batch_jobs = any(row.get("requeued") is not None for row in rows)  # a Slurm sweep's
    headers = ["job", "overrides", "final loss", "val acc", "time (s)", "step (ms)",
               "comm share", "comm bytes/step (predicted)", "comm ms/step (predicted)"]
    for header in headers + (["requeued"] if batch_jobs else []):
        table.add_column(header, justify="left" if header == "overrides" else "right")
    for row in rows:
        requeued = [_cell(row.get("requeued"), "d")] if batch_jobs else []
        if row["status"] != "completed":
            table.add_row(str(row["job"]), plain(row["overrides"]), "[red]failed[/red]", *[""] * 6,
                          *requeued)
            continue
        step_ms = None if row["median_step_time_s"] is None else row["median_step_time_s"] * 1e3
        table.add_row(
            str(row["job"]), plain(row["overrides"]), _cell(row["final_loss"], ".4f"),
            _cell(row["val_accuracy"], ".4f"), _cell(row["wall_time_s"], ".2f"),
            _cell(step_ms, ".2f"), _cell(row["comm_time_share"], ".1%"),
            f"{_cell(row['comm_bytes_per_step'], ',.0f')} "
            f"({_cell(row['predicted_comm_bytes_per_step'], ',.0f')})",
            f"{_cell(_scaled(row['comm_time_s_per_step']), '.3f')} "
            f"({_cell(_scaled(row['predicted_comm_time_s_per_step']), '.3f')})", *requeued)
    return table


def sweep_failures(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return [printable(f"job {row['job']} ({row['overrides']}): {row['error']}") for row in rows
            if row["status"] != "completed"]
