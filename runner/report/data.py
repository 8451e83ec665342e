"""Reading the run-directory contract (docs/design.md, "Run directory") for a report.

Tolerant on purpose: a report is most wanted for a run that is still going or went wrong, so a
missing `summary.json`, a half-written last line of `metrics.jsonl` or a sweep job without a run
directory is noted in the report, never fatal. Only input that is no run or sweep at all is
refused (`ReportError`).

A run's files are data from wherever the run was copied, so they are read as plain YAML and JSON
and shown as written: no OmegaConf, hence no interpolation is ever resolved (`${oc.env:NAME}` in
a config.yaml or an override appears in the report as that text, never as this machine's value).

Hostile files (`runner/records/rundir_files.py` holds the bounds): what no reader should take in, a
file over its size limit, a line of metrics.jsonl over 1 MiB, JSON or YAML nested deeper than
32 levels (or multiplied by YAML aliases), an integer of more than 100 digits, a YAML tag
(`!!python/object/...`, which a loader would construct), is refused too: one line naming the file
and its line, no report written. What is within the bounds but cannot
be read is noted and left out, as a cut-short line always was: a metrics line that is no JSON
object with an integer `step`, a summary.json or config.yaml that is no valid JSON or YAML. A
value that is no finite number of a usable size (see `finite`: NaN, infinities, 1e308, text
where a number belongs) is plotted nowhere and computed with nowhere; tables show it as
written, and a note counts those of metrics.jsonl, naming the first.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from runner.records.console import printable
from runner.records.rundir_files import (
    NotYaml,
    load_json,
    load_yaml,
    parse_json,
    read_csv,
    read_lines,
)

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
SWEEP_CSV = "sweep_summary.csv"
# the numbers of a metrics line (docs/design.md); `step` aside, which a line cannot do without
METRIC_KEYS = ("time_s", "loss", "lr", "step_time_s", "comm_time_s", "comm_bytes", "comm_share",
               "samples_per_s", "accuracy", "workers_loss", "workers_accuracy")
# past this a value is no measurement: scaled for a figure (ms, %) it would overflow to inf
USABLE_MAGNITUDE = 1e100

Record = dict[str, Any]


class ReportError(Exception):
    """Input that cannot be reported on; the message is the one line the user sees."""


@dataclass
class Run:
    """One run directory as far as it got."""

    path: Path
    train: list[Record]
    val: list[Record]
    summary: Record | None
    config: Record | None
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.summary is not None:
            return str(self.summary.get("status", "unknown"))
        return "in progress or interrupted" if self.train else "not started"

    def setting(self, summary_key: str, config_key: str) -> Any:
        """A value from summary.json, else from config.yaml (a run still going has no summary),
        as written there: the dotted `config_key` is looked up, nothing is resolved."""
        if self.summary and self.summary.get(summary_key) is not None:
            return self.summary[summary_key]
        value: Any = self.config or {}
        for part in config_key.split("."):
            if not isinstance(value, dict):
                return None
            value = value.get(part)
        return value

    def grid_text(self, times: str = "×") -> str:
        """'1×2' from the grid's pr and pc; a grid that is no mapping, as written."""
        grid = self.setting("grid", "grid")
        if grid is not None and not isinstance(grid, dict):
            return str(grid)
        grid = grid or {}
        return f"{grid.get('pr', '?')}{times}{grid.get('pc', '?')}"

    def describe(self) -> str:
        """'data · grid 1×2 · sgd', the run's identity for titles (`printable`: the names are
        the files')."""
        strategy = self.setting("strategy", "strategy.name") or "?"
        optimizer = self.setting("optimizer", "optimizer.name") or "?"
        return printable(f"{strategy} · grid {self.grid_text()} · {optimizer}")

    def stats(self) -> Record:
        """The summary's numbers; for a run without one, the same numbers from its metrics so
        far (predictions are then unknown)."""
        steps = [r["step_time_s"] for r in self.train if finite(r.get("step_time_s"))]
        comm = [r["comm_time_s"] for r in self.train if finite(r.get("comm_time_s"))]
        # not in summary.json, whose comm_time_s_per_step is a mean (start-up steps weigh in)
        median_comm = {"median_comm_time_s": statistics.median(comm) if comm else None}
        if self.summary is not None and self.summary.get("status") == "completed":
            return {**self.summary, **median_comm}
        nbytes = [r["comm_bytes"] for r in self.train if finite(r.get("comm_bytes"))]
        derived: Record = {
            "steps": self.train[-1]["step"] if self.train else None,
            "final_loss": self.train[-1].get("loss") if self.train else None,
            "val_loss": self.val[-1].get("loss") if self.val else None,
            "val_accuracy": self.val[-1].get("accuracy") if self.val else None,
            "median_step_time_s": statistics.median(steps) if steps else None,
            "comm_time_s_per_step": statistics.fmean(comm) if comm else None,
            "comm_bytes_per_step": statistics.fmean(nbytes) if nbytes else None,
            "comm_time_share": sum(comm) / sum(steps) if comm and sum(steps) > 0 else None,
            **median_comm,
        }
        return {**derived, **{k: v for k, v in (self.summary or {}).items() if v is not None}}


@dataclass
class Job:
    """One job of a multirun sweep."""

    number: int
    overrides: list[str]
    status: str
    error: str | None
    run: Run | None

    @property
    def plotted(self) -> bool:
        return self.status != "failed" and self.run is not None and bool(self.run.train)


@dataclass
class Sweep:
    path: Path
    jobs: list[Job]
    notes: list[str] = field(default_factory=list)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_run_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in RUN_FILES)


def job_dirs(path: Path) -> list[Path]:
    """A sweep's numbered job directories, in job order."""
    return sorted((p for p in path.iterdir() if p.is_dir() and p.name.isdigit()),
                  key=lambda p: int(p.name))


def is_sweep_dir(path: Path) -> bool:
    return ((path / SWEEP_CSV).is_file() or (path / "multirun.yaml").is_file()
            or any(is_run_dir(p) for p in job_dirs(path)))


def read_metrics(path: Path) -> tuple[list[Record], list[Record], list[str]]:
    """Training and validation lines of a metrics.jsonl, skipping what cannot be read;
    `RunFileError` for a file or line beyond the bounds. Counts, not lists, of what is
    skipped: a file of junk lines may hold millions."""
    train: list[Record] = []
    val: list[Record] = []
    bad = unusable = last = last_bad = 0
    first_unusable = ""
    for number, line in read_lines(path):
        if not line.strip():
            continue
        last = number
        record = _record(line, path, number)
        if record is None:
            bad, last_bad = bad + 1, number
            continue
        for key in METRIC_KEYS:
            if record.get(key) is not None and not finite(record[key]):
                unusable += 1
                first_unusable = first_unusable or f"line {number}, {key}={record[key]!r}"
        if record.get("split") == "val":
            val.append(record)
        elif "split" not in record:
            train.append(record)
    notes = []
    if bad and last_bad == last:
        bad -= 1
        notes.append("the last line of metrics.jsonl is incomplete (still being written, or "
                     "the run was stopped): ignored")
    if bad:
        notes.append(f"{bad} unreadable line(s) in metrics.jsonl ignored")
    if unusable:
        shown = first_unusable if len(first_unusable) <= 80 else f"{first_unusable[:77]}..."
        notes.append(f"{unusable} value(s) in metrics.jsonl are no finite number of a usable "
                     f"size: left out (first: {shown})")
    return train, val, notes


def _record(line: str, path: Path, number: int) -> Record | None:
    """A metrics line as a record, None when it is none: no JSON object with a `step`."""
    try:
        record = parse_json(line, path, number)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and _step(record.get("step")) else None


def _step(value: Any) -> bool:
    """gridrun writes steps as integers; a float could be infinite or NaN, which no step is."""
    return isinstance(value, int) and not isinstance(value, bool)


def _load_yaml(path: Path) -> Any:
    """The file as plain Python values, exactly as written (an interpolation is the text it
    is: a report only shows it), or None when it is no YAML (a report only notes that);
    `RunFileError` beyond the bounds or for a tag."""
    try:
        return load_yaml(path, shown_only=True)
    except NotYaml:
        return None


def load_run(path: Path) -> Run:
    train: list[Record] = []
    val: list[Record] = []
    notes: list[str] = []
    if (path / "metrics.jsonl").is_file():
        train, val, notes = read_metrics(path / "metrics.jsonl")
    else:
        notes.append("no metrics.jsonl")
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = load_json(path / "summary.json")
        except json.JSONDecodeError:
            notes.append("summary.json is not valid JSON: ignored")
    elif train:
        notes.append("no summary.json yet: the run is still going or was interrupted; numbers "
                     "below are from metrics.jsonl so far")
    config = None
    if (path / "config.yaml").is_file():
        loaded = _load_yaml(path / "config.yaml")
        config = loaded if isinstance(loaded, dict) else None
        if config is None:
            notes.append("config.yaml could not be read: ignored")
    return Run(path, train, val, summary if isinstance(summary, dict) else None, config, notes)


def _job_overrides(job_dir: Path | None, shown: str) -> list[str]:
    """The job's overrides as Hydra recorded them (exact, even with spaces in a value), else
    the CSV's space-joined form."""
    if job_dir is not None and (job_dir / ".hydra" / "overrides.yaml").is_file():
        loaded = _load_yaml(job_dir / ".hydra" / "overrides.yaml")
        if isinstance(loaded, list):
            return [str(item) for item in loaded]
    return shown.split()


def _job_dir(sweep: Path, number: int, recorded: str) -> Path | None:
    for candidate in (sweep / str(number), Path(recorded) if recorded else None):
        try:
            if candidate is not None and candidate.is_dir():
                return candidate
        except OSError:  # a name no file system takes (too long, say): no directory
            continue
    return None


def load_sweep(path: Path) -> Sweep:
    """Jobs from sweep_summary.csv; while a sweep runs (no CSV yet), from its job directories."""
    jobs: list[Job] = []
    notes: list[str] = []
    if (path / SWEEP_CSV).is_file():
        for row in read_csv(path / SWEEP_CSV):
            try:
                number = int(row.get("job") or "")
            except ValueError:
                notes.append(f"{SWEEP_CSV}: a row without a job number ignored")
                continue
            job_dir = _job_dir(path, number, row.get("run_dir") or "")
            run = load_run(job_dir) if job_dir is not None and is_run_dir(job_dir) else None
            jobs.append(Job(number, _job_overrides(job_dir, row.get("overrides") or ""),
                            row.get("status") or "unknown", row.get("error") or None, run))
    else:
        notes.append(f"no {SWEEP_CSV}: the sweep is still going or was interrupted; jobs are "
                     "read from their directories")
        for job_dir in job_dirs(path):
            run = load_run(job_dir) if is_run_dir(job_dir) else None
            error = (run.summary or {}).get("error") if run else None
            jobs.append(Job(int(job_dir.name), _job_overrides(job_dir, ""),
                            run.status if run else "not started", error, run))
    return Sweep(path, jobs, notes)


def varying_overrides(jobs: list[Job]) -> tuple[list[str], dict[int, str]]:
    """The overrides every job shares, and each job's label: the overrides that set it apart."""
    if len(jobs) < 2:  # nothing to set a job apart from
        return [], {job.number: " ".join(job.overrides) or f"job {job.number}" for job in jobs}
    # sets: a sweep's files may hold any number of overrides, and lists compare pairwise
    shared = set(jobs[0].overrides).intersection(*(job.overrides for job in jobs[1:]))
    common = [o for o in jobs[0].overrides if o in shared]
    labels = {job.number: " ".join(o for o in job.overrides if o not in shared)
              or f"job {job.number}" for job in jobs}
    return common, labels


def finite(value: Any) -> TypeGuard[float]:
    """A number to plot and compute with: finite, and of a size no measurement exceeds (NaN
    compares false; a huge int compares exactly, never converted to a float)."""
    return _number(value) and abs(value) <= USABLE_MAGNITUDE
