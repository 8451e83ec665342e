"""The report's `report.md`: the numbers of summary.json as tables, and the figures beside it.

Numbers are formatted as the console's result and sweep tables show them (loss and accuracy to
4 decimals, times in ms), so a report and a terminal can be read side by side. Text from a run's
files (names, overrides, errors) is shown as written, less what a terminal showing report.md
would act on: control characters as visible escapes (`printable`); table cells also escape `|`
and newlines.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runner.records.console import printable
from runner.report.data import Job, Run, Sweep, finite, varying_overrides

IMAGE_TITLES = {
    "loss": "Loss",
    "accuracy": "Validation accuracy",
    "communication": "Communication per step",
    "sweep_curves": "Loss and validation accuracy per job",
    "sweep_times": "Time and communication per step, measured and predicted",
}


def fmt(value: Any, spec: str, unit: str = "", scale: float = 1.0) -> str:
    """A number as the tables show it; '—' for a value the run does not have."""
    if not finite(value):
        return "—" if value is None else str(value)
    return f"{format(value * scale, spec)}{unit}"


def ratio(measured: Any, predicted: Any) -> str:
    if not finite(measured) or not finite(predicted) or predicted == 0:
        return "—"
    return f"{measured / predicted:.2f}"


def cell(text: Any) -> str:
    return printable(str(text).replace("\n", " ")).replace("|", "\\|")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


def images(paths: Sequence[Path]) -> list[str]:
    """Each figure under its heading, linked relative to report.md (which sits beside them)."""
    lines = []
    for path in paths:
        title = IMAGE_TITLES.get(path.stem, path.stem)
        lines += ["", f"## {title}", "", f"![{title}]({path.name})"]
    return lines


def _notes(notes: Sequence[str]) -> list[str]:
    return ["", "Notes:", "", *[f"- {printable(note)}" for note in notes]] if notes else []


def run_markdown(run: Run, pngs: Sequence[Path]) -> str:
    s = run.stats()
    world = s.get("world_size")
    ranks = f" ({world} ranks)" if world else ""
    status = run.status
    if s.get("error"):
        where = f" on rank {s['failed_rank']}" if "failed_rank" in s else ""
        status += f"{where}: {s['error']}"
    val = fmt(s.get("val_accuracy"), ".4f")
    if finite(s.get("workers_val_accuracy")):
        val += f" (replicas' mean {s['workers_val_accuracy']:.4f})"
    configured = run.setting("steps", "trainer.steps")
    logged = run.train[-1]["step"] if run.train else 0
    steps = str(configured) if run.status == "completed" else f"{logged} logged of {configured}"
    rows = [
        ("status", status),
        ("strategy", run.setting("strategy", "strategy.name")),
        ("grid (pr × pc)", f"{run.grid_text(' × ')}{ranks}"),
        ("optimizer", run.setting("optimizer", "optimizer.name")),
        ("steps", steps),
        ("final training loss", fmt(s.get("final_loss"), ".4f")),
        ("validation loss", fmt(s.get("val_loss"), ".4f")),
        ("validation accuracy", val),
        ("wall time", fmt(s.get("wall_time_s"), ".2f", " s")),
        ("median step time", fmt(s.get("median_step_time_s"), ".3f", " ms", 1e3)),
        ("communication share of step time", fmt(s.get("comm_time_share"), ".1%")),
    ]
    comm = [
        ("bytes", fmt(s.get("comm_bytes_per_step"), ",.0f"),
         fmt(s.get("predicted_comm_bytes_per_step"), ",.0f"),
         ratio(s.get("comm_bytes_per_step"), s.get("predicted_comm_bytes_per_step"))),
        ("time", fmt(s.get("comm_time_s_per_step"), ".3f", " ms", 1e3),
         fmt(s.get("predicted_comm_time_s_per_step"), ".3f", " ms", 1e3),
         ratio(s.get("comm_time_s_per_step"), s.get("predicted_comm_time_s_per_step"))),
    ]
    lines = [f"# Run report: {run.describe()}", "", f"Run directory: `{printable(run.path)}`", "",
             *table(("quantity", "value"), rows), "",
             "## Communication per step: measured against the planner's prediction", "",
             *table(("per step", "measured", "predicted", "measured / predicted"), comm)]
    if s.get("predicted_comm_bytes_per_step") is None and run.status == "completed":
        lines += ["", "No prediction: the planner does not model this optimizer's exchanges."]
    lines += _notes(run.notes)
    if not run.val:
        lines += ["", "No validation lines in metrics.jsonl: no accuracy figure."]
    return "\n".join([*lines, *images(pngs), ""])


def _pair(measured: Any, predicted: Any, spec: str, scale: float = 1.0) -> str:
    return f"{fmt(measured, spec, scale=scale)} ({fmt(predicted, spec, scale=scale)})"


def job_row(job: Job, label: str) -> list[str]:
    s = job.run.stats() if job.run is not None else {}
    return [str(job.number), label, job.status, fmt(s.get("final_loss"), ".4f"),
            fmt(s.get("val_accuracy"), ".4f"), fmt(s.get("wall_time_s"), ".2f"),
            fmt(s.get("median_step_time_s"), ".3f", scale=1e3),
            fmt(s.get("comm_time_share"), ".1%"),
            _pair(s.get("comm_time_s_per_step"), s.get("predicted_comm_time_s_per_step"), ".3f",
                  1e3),
            _pair(s.get("comm_bytes_per_step"), s.get("predicted_comm_bytes_per_step"), ",.0f"),
            job.error or ""]


def sweep_markdown(sweep: Sweep, pngs: Sequence[Path]) -> str:
    common, labels = varying_overrides(sweep.jobs)
    by_status: dict[str, int] = {}
    for job in sweep.jobs:
        by_status[job.status] = by_status.get(job.status, 0) + 1
    counts = ", ".join(f"{n} {status}" for status, n in by_status.items())
    header = ("job", "overrides", "status", "final loss", "val acc", "wall time (s)",
              "median step (ms)", "comm share", "comm ms/step (predicted)",
              "comm bytes/step (predicted)", "error")
    lines = [f"# Sweep report: `{printable(sweep.path)}`", "",
             f"{len(sweep.jobs)} job(s): {counts or 'none'}.", ""]
    if common:
        lines += [f"Overrides every job shares: `{printable(' '.join(common))}`", ""]
    lines += table(header, [job_row(job, labels[job.number]) for job in sweep.jobs])
    skipped = [str(job.number) for job in sweep.jobs if not job.plotted]
    if skipped:
        lines += ["", f"Not plotted (failed, or nothing logged): job {', '.join(skipped)}."]
    lines += _notes(sweep.notes)
    return "\n".join([*lines, *images(pngs), ""])
