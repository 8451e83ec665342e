"""`python -m runner.reproduce [--out DIR] [--only sc17|grid|parallax] [--quick]`: rerun the
seed papers' headline comparisons at this machine's scale and write a report (one markdown page
per paper, its PNGs, and an index) into DIR (default docs/reproductions). Bad options: one line
on stderr, exit code 2, nothing run.

The runs go through gridrun's own command line into `--runs-dir` (default
outputs/reproduce/<date>_<time>), where `python -m runner.report` can read any of them. Each
section also writes its results as `<paper>.json` beside its page, so the index can gather the
headline numbers of sections run at different times (`--only`).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from runner.records.console import print_error, printable
from runner.reproduce import grid, parallax, sc17
from runner.reproduce.runs import read_json, table, write_json

EXIT_BAD_INPUT = 2
SECTIONS = {"sc17": sc17, "grid": grid, "parallax": parallax}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        print_error(message)
        raise SystemExit(EXIT_BAD_INPUT)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m runner.reproduce",
                     description="Reproduce the seed papers' headline comparisons and write "
                                 "a report (markdown and PNG plots).")
    parser.add_argument("--out", type=Path, default=Path("docs/reproductions"),
                        help="where the report goes (default: docs/reproductions)")
    parser.add_argument("--only", choices=list(SECTIONS),
                        help="one paper's section only (the index keeps the others' numbers)")
    parser.add_argument("--quick", action="store_true",
                        help="a much shorter variant: fewer steps, points and plans")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where the training runs go (default: "
                             "outputs/reproduce/<date>_<time>)")
    args = parser.parse_args(argv)
    for option, path in (("--out", args.out), ("--runs-dir", args.runs_dir)):
        if path is not None and path.exists() and not path.is_dir():
            parser.error(f"{option} {path}: exists and is not a directory")
    return args


def collect(name: str, runs_dir: Path, quick: bool) -> dict[str, Any]:
    def log(message: str) -> None:  # a failed run's message quotes its output
        print(printable(message), flush=True)

    if name == "grid":
        return grid.collect(quick, log)
    module = sc17 if name == "sc17" else parallax
    return module.collect(runs_dir / name, quick, log)


def write_index(out: Path) -> Path:
    """The index page: every section whose results are in `out`, and its headline numbers."""
    pages, headlines = [], []
    for name, module in SECTIONS.items():
        data = read_json(out / f"{name}.json")
        if data is None:
            continue
        scale = " (`--quick` variant)" if data.get("quick") else ""
        pages.append([f"[{module.TITLE}]({name}.md)", data.get("generated", "?") + scale])
        headlines += module.headline(data)
    lines = [
        "# Reproductions of the seed papers", "",
        "gridrun implements the methods of four papers ([the design](../design.md)). This "
        "report reruns three of their headline comparisons at the scale of a 2-core machine: "
        "4 MPI ranks on 2 cores, small models and data, minutes rather than days. Each page "
        "puts the paper's own figures beside gridrun's and says why they differ. The papers' "
        "figures are quoted from their own tables, figures and abstracts. The fourth paper "
        "(DistDL's adjoint primitives) is a correctness property, tested by "
        "the suite's dot-product tests, not a comparison to rerun.", "",
        "```bash",
        "python -m runner.reproduce                 # everything, 7-10 minutes on 2 cores",
        "python -m runner.reproduce --only sc17     # one paper; also --only grid, --only parallax",
        "make reproduce",
        "```", "",
        table(["page", "generated"], pages), "",
        "## Headline numbers", "",
        table(["paper", "comparison", "paper's figure", "gridrun here"], headlines), "",
    ]
    index = out / "README.md"
    index.write_text("\n".join(lines))
    return index


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    runs_dir = args.runs_dir or Path("outputs") / "reproduce" / stamp
    args.out.mkdir(parents=True, exist_ok=True)
    for name in [args.only] if args.only else list(SECTIONS):
        data = collect(name, runs_dir, args.quick)
        data.update({"quick": args.quick, "generated": datetime.now().strftime("%Y-%m-%d")})
        write_json(args.out / f"{name}.json", data)
        page = SECTIONS[name].render(data, args.out)
        print(f"{name}: wrote {page}", flush=True)
    index = write_index(args.out)
    print(f"report: {index} ({time.monotonic() - started:.0f} s; runs in {runs_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
