"""`python -m runner.report DIR`: figures and a report.md for a run or a multirun sweep.

Reads only the run-directory contract (docs/design.md, "Run directory"): `metrics.jsonl`,
`summary.json`, `config.yaml`, and a sweep's `sweep_summary.csv`, so it works on a run copied
off a cluster, on one still going and on one that failed. No Hydra, no torch, no MPI, and no
OmegaConf: a run's files are data, shown as written, and no interpolation in them (such as
`${oc.env:NAME}`) is ever resolved.
"""

from __future__ import annotations

from pathlib import Path, PurePath

from runner.records import safe_paths
from runner.records.rundir_files import RunFileError
from runner.records.safe_paths import PathRefused
from runner.report.data import (
    ReportError,
    Run,
    Sweep,
    is_run_dir,
    is_sweep_dir,
    load_run,
    load_sweep,
)

__all__ = ["ReportError", "write_report"]


def write_report(path: Path, out: Path | None = None) -> list[Path]:
    """Write the figures and report.md for the run or sweep at `path` into `out` (default
    `<path>/report/`); return the files written, report.md first."""
    from runner.report import plots, summary

    if not path.exists():
        raise ReportError(f"{path}: no such directory")
    if not path.is_dir():
        raise ReportError(f"{path}: not a directory")
    # `--out` is the user's own choice (its links are theirs); the default lies inside the run
    # directory, where no link is followed (`safe_paths`)
    root, inside = (out, "") if out is not None else (path, "report")
    out = Path(root) / inside
    safe_paths.register_root(path)  # its files are read from inside it, no link followed
    loaded = _load(path)
    if isinstance(loaded, Run):
        figures = plots.run_figures(loaded)
        render = lambda pngs: summary.run_markdown(loaded, pngs)  # noqa: E731
    else:
        figures = plots.sweep_figures(loaded.jobs)
        render = lambda pngs: summary.sweep_markdown(loaded, pngs)  # noqa: E731
    try:
        safe_paths.make_dir(root, inside)
        pngs = plots.save(figures, root, inside)
        report = out / "report.md"
        safe_paths.replace_file(root, PurePath(inside, "report.md"), render(pngs).encode())
    except PathRefused as exc:  # a link (or a FIFO) where the report would go
        raise ReportError(str(exc)) from None
    except OSError as exc:
        raise ReportError(f"cannot write the report into {out}: {exc.strerror or exc}") from exc
    return [report, *pngs]


def _load(path: Path) -> Run | Sweep:
    """The run or sweep at `path`, every file read before anything is written."""
    try:
        if is_run_dir(path):
            return load_run(path)
        if is_sweep_dir(path):
            return load_sweep(path)
    except RunFileError as exc:  # a file beyond the readers' bounds
        raise ReportError(str(exc)) from None
    raise ReportError(f"{path} is neither a run directory (config.yaml, metrics.jsonl, "
                      "summary.json) nor a sweep directory (sweep_summary.csv, numbered "
                      "job directories)")
