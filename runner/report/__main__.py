"""`python -m runner.report RUN_OR_SWEEP_DIR [--out DIR]`; bad input: one line, exit code 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.records.console import print_error, printable
from runner.report import ReportError, write_report

EXIT_BAD_INPUT = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.report",
        description="Figures and a report.md for a run directory or a multirun sweep directory.")
    parser.add_argument("path", type=Path, help="a run directory or a sweep directory")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the report (default: <path>/report/)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.path, args.out)
    except ReportError as exc:
        print_error(str(exc))
        return EXIT_BAD_INPUT
    print(printable(f"report written to {written[0].parent}:"))
    for path in written:
        print(printable(f"  {path}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
