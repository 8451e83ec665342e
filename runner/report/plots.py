"""The report's figures, drawn with matplotlib's object API: no pyplot, so no display and no
global figure state (`Figure.savefig` renders with Agg), and the functions return `Figure`s a
test can inspect before they are saved.

The time axis is the metrics' `time_s`: rank 0's cumulative training time (the sum of its step
times, evaluations excluded), the time the run spent training rather than starting up.

Text taken from a run's files (names in titles, overrides in legends and ticks) is drawn with
`parse_math=False`: as written, never read as mathtext (a `$...$` in a copied run's config would
otherwise be typeset, or stop the report with a parse error), and cut to `TEXT_LIMIT` characters
(report.md has it whole).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path, PurePath

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from runner.records import safe_paths
from runner.records.console import printable
from runner.report.data import Job, Record, Run, finite, varying_overrides

TIME_LABEL = "training time (s, cumulative step time)"
WIDE = (11.0, 4.2)
DPI = 110
LINE_STYLES = ("-", "--", "-.", ":")
TEXT_LIMIT = 100  # characters: laying out a megabyte of title took matplotlib minutes


def short(text: str) -> str:
    """`text` as a figure shows it: at most `TEXT_LIMIT` characters, `printable`."""
    text = printable(text, newlines=True)
    return text if len(text) <= TEXT_LIMIT else f"{text[:TEXT_LIMIT - 1]}…"


def series(records: Iterable[Record], x: str, y: str, scale: float = 1.0) -> tuple[list, list]:
    """The (x, y) points of the records that have both, `finite` numbers only (1e308 in %
    or ms overflows matplotlib)."""
    xs, ys = [], []
    for record in records:
        if finite(record.get(x)) and finite(record.get(y)):
            xs.append(record[x])
            ys.append(record[y] * scale)
    return xs, ys


def comm_share(records: Iterable[Record]) -> tuple[list, list]:
    """Per step: the share of the step spent blocked in communication (comm_time_s/step_time_s)."""
    xs, ys = [], []
    for record in records:
        step_time, comm_time = record.get("step_time_s"), record.get("comm_time_s")
        if finite(step_time) and finite(comm_time) and step_time > 0:
            xs.append(record["step"])
            ys.append(comm_time / step_time)
    return xs, ys


def _finish(ax: Axes, xlabel: str, ylabel: str, legend: bool = True) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def loss_figure(run: Run) -> Figure:
    fig = Figure(figsize=WIDE, layout="constrained")
    for ax, x, xlabel in zip(fig.subplots(1, 2), ("step", "time_s"), ("step", TIME_LABEL),
                             strict=True):
        ax.plot(*series(run.train, x, "loss"), lw=1.2, label="training loss (global batch)")
        ax.plot(*series(run.val, x, "loss"), "o-", ms=4, label="validation loss")
        if any("workers_loss" in r for r in run.val):
            ax.plot(*series(run.val, x, "workers_loss"), "s--", ms=3,
                    label="validation loss, replicas' mean")
        _finish(ax, xlabel, "cross-entropy loss")
    fig.suptitle(short(f"Loss: {run.describe()}"), parse_math=False)
    return fig


def accuracy_figure(run: Run) -> Figure:
    fig = Figure(figsize=WIDE, layout="constrained")
    for ax, x, xlabel in zip(fig.subplots(1, 2), ("step", "time_s"), ("step", TIME_LABEL),
                             strict=True):
        ax.plot(*series(run.val, x, "accuracy"), "o-", ms=4, label="validation accuracy")
        if any("workers_accuracy" in r for r in run.val):
            ax.plot(*series(run.val, x, "workers_accuracy"), "s--", ms=3,
                    label="replicas' mean")
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        _finish(ax, xlabel, "validation accuracy")
    fig.suptitle(short(f"Validation accuracy: {run.describe()}"), parse_math=False)
    return fig


def comm_figure(run: Run) -> Figure:
    """Where each step's time went: the blocked-in-communication share, and the times in ms
    beside the planner's predicted communication time per step."""
    fig = Figure(figsize=WIDE, layout="constrained")
    share_ax, time_ax = fig.subplots(1, 2)
    share_ax.plot(*comm_share(run.train), lw=1.2, label="per step")
    overall = run.stats().get("comm_time_share")
    if finite(overall):
        share_ax.axhline(overall, color="black", ls=":", label=f"whole run ({overall:.1%})")
    share_ax.set_ylim(0, 1.02)
    share_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _finish(share_ax, "step", "communication share of step time")
    time_ax.plot(*series(run.train, "step", "step_time_s", 1e3), lw=1.2, label="step time")
    time_ax.plot(*series(run.train, "step", "comm_time_s", 1e3), lw=1.2,
                 label="communication time (measured)")
    predicted = run.stats().get("predicted_comm_time_s_per_step")
    if finite(predicted):
        time_ax.axhline(predicted * 1e3, color="black", ls="--",
                        label=f"communication time (predicted, {predicted * 1e3:.3f} ms)")
    time_ax.set_ylim(bottom=0)
    _finish(time_ax, "step", "time per step (ms)")
    fig.suptitle(short(f"Communication: {run.describe()}"), parse_math=False)
    return fig


def run_figures(run: Run) -> dict[str, Figure]:
    """File stem -> figure, for what the run has: no validation lines, no accuracy figure."""
    figures: dict[str, Figure] = {}
    if run.train or run.val:
        figures["loss"] = loss_figure(run)
    if run.val:
        figures["accuracy"] = accuracy_figure(run)
    if run.train:
        figures["communication"] = comm_figure(run)
    return figures


def _colour(index: int) -> str:
    return f"C{index % 10}"


def sweep_curves_figure(jobs: list[Job]) -> Figure:
    """One line per job on shared axes; one figure legend (an entry per job) below."""
    shown = [job for job in jobs if job.plotted]
    _, labels = varying_overrides(jobs)
    fig = Figure(figsize=(15.0, 4.8), layout="constrained")
    by_step, by_time, accuracy = fig.subplots(1, 3)
    for index, job in enumerate(shown):
        assert job.run is not None
        # identical curves are common (every grid computes the same losses): vary the dashes too
        style = {"color": _colour(index), "lw": 1.4, "ls": LINE_STYLES[index % len(LINE_STYLES)]}
        (line,) = by_step.plot(*series(job.run.train, "step", "loss"), **style)
        by_time.plot(*series(job.run.train, "time_s", "loss"), **style)
        accuracy.plot(*series(job.run.val, "step", "accuracy"), marker="o", ms=4, **style)
        line.set_label(short(f"{job.number}: {labels[job.number]}"))
    _finish(by_step, "step", "training loss", legend=False)
    _finish(by_time, TIME_LABEL, "training loss", legend=False)
    accuracy.yaxis.set_major_formatter(PercentFormatter(1.0))
    _finish(accuracy, "step", "validation accuracy", legend=False)
    if shown:
        legend = fig.legend(loc="outside lower center", ncols=min(len(shown), 4),
                            fontsize="small", title="job: overrides")
        for text in legend.get_texts():
            text.set_parse_math(False)
    fig.suptitle(f"Sweep: {len(shown)} of {len(jobs)} jobs plotted")
    return fig


def _bars(ax: Axes, groups: list[list[float | None]], names: list[str], ticks: list[str],
          scale: float) -> None:
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        offset = (k - (len(names) - 1) / 2) * width
        for i, values in enumerate(groups):
            value = values[k]
            if finite(value):
                ax.bar(i + offset, value * scale, width, color=_colour(k), label=name)
            else:
                ax.text(i + offset, 0, "n/a", ha="center", va="bottom", fontsize="x-small",
                        rotation=90)
    ax.set_xticks(range(len(ticks)), ticks, fontsize="small", parse_math=False)
    # one legend entry per series, whichever job first had a value for it
    handles, seen = [], set()
    for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
        if label not in seen:
            seen.add(label)
            handles.append(handle)
    ax.legend(handles=handles, fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def sweep_times_figure(jobs: list[Job]) -> Figure:
    """Per job: median step time beside measured and predicted communication time per step;
    and measured beside predicted communication bytes per step. The measured communication
    time is shown as a median too: summary.json's mean is dominated by the first steps of a
    short run (MPI warm-up), which the prediction does not model."""
    shown = [job for job in jobs if job.plotted]
    _, labels = varying_overrides(jobs)
    ticks = [short(f"{job.number}\n" + labels[job.number].replace(" ", "\n")) for job in shown]
    stats = [job.run.stats() for job in shown if job.run is not None]
    fig = Figure(figsize=(max(9.0, 2.2 * len(shown) + 3), 4.8), layout="constrained")
    times, nbytes = fig.subplots(1, 2)
    _bars(times, [[s.get("median_step_time_s"), s.get("median_comm_time_s"),
                   s.get("comm_time_s_per_step"), s.get("predicted_comm_time_s_per_step")]
                  for s in stats],
          ["step time (median)", "communication, measured (median)",
           "communication, measured (mean)", "communication, predicted"], ticks, 1e3)
    times.set_ylabel("time per step (ms)")
    times.set_xlabel("job")
    _bars(nbytes, [[s.get("comm_bytes_per_step"), s.get("predicted_comm_bytes_per_step")]
                   for s in stats], ["measured", "predicted"], ticks, 1 / 1024)
    nbytes.set_ylabel("communication per step (KiB)")
    nbytes.set_xlabel("job")
    fig.suptitle("Sweep: time and communication per step")
    return fig


def sweep_figures(jobs: list[Job]) -> dict[str, Figure]:
    if not any(job.plotted for job in jobs):
        return {}
    return {"sweep_curves": sweep_curves_figure(jobs), "sweep_times": sweep_times_figure(jobs)}


def save(figures: dict[str, Figure], root: Path, inside: str = "") -> list[Path]:
    """Each figure as `<root>/<inside>/<stem>.png`, rendered in memory and written whole,
    without following a link below `root` (`safe_paths.replace_file`)."""
    paths = []
    for stem, fig in figures.items():
        png = io.BytesIO()
        fig.savefig(png, dpi=DPI, format="png")
        safe_paths.replace_file(root, PurePath(inside, f"{stem}.png"), png.getvalue())
        paths.append(Path(root) / inside / f"{stem}.png")
    return paths
