"""What rank 0 shows: a rich progress bar on a terminal (plain lines otherwise) and result tables.

Workers started by the head write to a pipe, not a terminal; the head passes
GRIDRUN_FORCE_TERMINAL=1 when its own output is a terminal so rank 0 still draws the live bar.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

FORCE_TERMINAL_ENV = "GRIDRUN_FORCE_TERMINAL"


_PLAIN_WIDTH = 160  # for logs and pipes, where rich would otherwise assume 80 columns

# What a terminal acts on rather than shows: C0 and C1 controls (ESC starts cursor moves, screen
# clears and window titles; CR rewrites a line), DEL, the line and paragraph separators, and the
# bidirectional overrides and isolates that reorder what follows them.
_ACTED_ON = "\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_UNPRINTABLE = re.compile(f"[\x00-\x1f{_ACTED_ON}]")
_UNPRINTABLE_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_ACTED_ON}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: object, newlines: bool = False) -> str:
    """`text` as a terminal shows it and acts on nothing of it: every control character (and
    bidirectional override) written as a visible escape, `\\x1b`, `\\r`, `\\u202e`; a newline
    kept only where `newlines` allows it. Text that came from a file (a run's names, errors,
    values) is printed through this, so no file can move the cursor, rewrite lines or set the
    window title."""
    pattern = _UNPRINTABLE_BUT_NEWLINE if newlines else _UNPRINTABLE
    return pattern.sub(_escape, str(text))


def plain(text: object) -> Text:
    """`printable(text)` for a rich table cell or `Console.print`: shown as written, never read
    as rich's markup (a `[bold]` in a file stays those characters)."""
    return Text(printable(text))


def make_console(stderr: bool = False) -> Console:
    force = os.environ.get(FORCE_TERMINAL_ENV) == "1" or None
    console = Console(stderr=stderr, force_terminal=force, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = _PLAIN_WIDTH
    return console


class ProgressReporter:
    """Training progress for rank 0; silent on every other rank."""

    def __init__(self, enabled: bool, total_steps: int, title: str) -> None:
        # the title names the run's model and strategy: a replayed run's come from its file
        self.enabled, self.total, self.title = enabled, total_steps, printable(title)
        self.console = make_console()
        self.live = enabled and self.console.is_terminal
        self._every = max(1, total_steps // 10)
        self._progress: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> ProgressReporter:
        if self.live:
            self._progress = Progress(
                TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("{task.fields[rate]:.0f} samples/s"), TimeRemainingColumn(),
                console=self.console, transient=False)
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=self.total, loss=float("nan"),
                                                 rate=0.0)
        elif self.enabled:
            self.console.print(f"{self.title}: {self.total} steps", markup=False)
        return self

    def step(self, step: int, loss: float, samples_per_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, rate=samples_per_s)
        elif self.enabled and (step % self._every == 0 or step == self.total or step == 1):
            self.console.print(f"step {step:>6}/{self.total}  loss {loss:.4f}  "
                               f"{samples_per_s:,.0f} samples/s")

    def evaluation(self, step: int, loss: float, accuracy: float,
                   perplexity: float | None = None) -> None:
        if self.enabled:
            shown = "" if perplexity is None else f"  val perplexity {perplexity:.2f}"
            self.console.print(f"step {step:>6}/{self.total}  val loss {loss:.4f}  "
                               f"val accuracy {accuracy:.4f}{shown}")

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.3f} ms"


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def _sparse_cell(table: Mapping[str, Any]) -> str:
    """'allgather 398, dense 2 steps; last batch 3.6% of the rows'."""
    modes = ", ".join(f"{mode} {steps}" for mode, steps in
                      sorted(table.get("steps_by_mode", {}).items(), key=lambda kv: -kv[1]))
    return f"{modes} steps; last batch {_fmt(table.get('density'), '.1%')} of the rows"


def summary_table(summary: Mapping[str, Any]) -> Table:
    grid = summary.get("grid", {})
    ranks = summary.get("world_size")
    measured = _fmt_bytes(summary.get("comm_bytes_per_step"))
    predicted = _fmt_bytes(summary.get("predicted_comm_bytes_per_step"))
    table = Table(title="gridrun result", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("strategy / optimizer", f"{summary.get('strategy')} / {summary.get('optimizer')}"),
        ("grid (pr x pc)", f"{grid.get('pr')} x {grid.get('pc')}  ({ranks} ranks)"),
        ("steps", _fmt(summary.get("steps"))),
        ("final loss", _fmt(summary.get("final_loss"), ".4f")),
        ("val accuracy", _fmt(summary.get("val_accuracy"), ".4f")),
        *([("val perplexity", _fmt(summary["val_perplexity"], ".2f"))]
          if summary.get("val_perplexity") is not None else []),
        *([("workers' mean val accuracy", _fmt(summary["workers_val_accuracy"], ".4f"))]
          if summary.get("workers_val_accuracy") is not None else []),
        ("wall time", f"{_fmt(summary.get('wall_time_s'), '.2f')} s"),
        ("step time (median)", f"{_fmt(summary.get('median_step_time_s', 0) * 1e3, '.2f')} ms "
                               f"measured, {_ms(summary.get('predicted_step_time_s'))} "
                               f"predicted"),
        *([("compiled", _compile_cell(summary["compile"]))] if summary.get("compile") else []),
        *([("layouts", " ".join(f"{k}:{v}" for k, v in summary["layouts"].items()))]
          if summary.get("layouts") else []),
        *([("GPU compute", _gpu_cell(summary))]
          if summary.get("tflops_per_gpu") is not None else []),
        *([("GPU memory peak", f"{_fmt_bytes(summary['device_memory_peak_bytes'])} allocated "
                               f"(the most of any rank)")]
          if summary.get("device_memory_peak_bytes") is not None else []),
        ("samples / s", _fmt(summary.get("samples_per_s"), ",.0f")),
        *([("tokens / s", _fmt(summary["tokens_per_s"], ",.0f"))]
          if summary.get("tokens_per_s") is not None else []),
        ("comm bytes / step", f"{measured} measured, {predicted} predicted"),
        ("comm time / step", f"{_ms(summary.get('comm_time_s_per_step'))} measured, "
                             f"{_ms(summary.get('predicted_comm_time_s_per_step'))} predicted"
                             + (f" + {_ms(summary['predicted_wait_time_s'])} waiting for "
                                f"peers sharing cores" if summary.get("predicted_wait_time_s")
                                else "")),
        ("comm share of step", _fmt(summary.get("comm_time_share"), ".1%")),
        ("params / rank", _fmt_bytes(summary.get("param_bytes_per_rank"))),
        ("memory / rank", _memory_cell(summary.get("memory_per_rank"),
                                       summary.get("predicted_memory_per_rank"))),
        ("activations / step", f"{_fmt_bytes(summary.get('activation_bytes_peak'))} peak kept "
                               f"for backward"
                               + (f", {summary['accumulate_steps']} micro-batches"
                                  if (summary.get("accumulate_steps") or 1) > 1 else "")),
        *[(f"sparse table {name}", _sparse_cell(table))
          for name, table in (summary.get("sparse_exchange") or {}).items()],
        ("run dir", str(summary.get("run_dir"))),
    ]
    for key, value in rows:
        table.add_row(plain(key), plain(value))  # a run's text: never markup
    return table


def _compile_cell(compiled: Mapping[str, Any]) -> str:
    """'trainer.compile=model: 14 modules compiled, 6 eager, 8 compiled around; 47.7 s
    compiling, 2 graphs from the cache, 17 compiled (summary.json: compile)' (graphs: forward
    and backward ones)."""
    cache = compiled.get("cache") or {}
    eager, around = compiled.get("eager") or {}, compiled.get("compiled_around") or {}
    return (f"trainer.compile={compiled.get('mode')}: {len(compiled.get('compiled') or [])} "
            f"modules compiled"
            + (f", {len(eager)} eager" if eager else "")
            + (f", {len(around)} compiled around" if around else "")
            + f"; {_fmt(compiled.get('compile_s'), '.1f')} s compiling, "
              f"{cache.get('hits', 0)} graphs from the cache, {cache.get('misses', 0)} compiled "
              f"(summary.json: compile)")


def _gpu_cell(summary: Mapping[str, Any]) -> str:
    """'312.4 TFLOP/s per GPU (1 GPU), MFU 31.6% of H100 SXM bf16 (989 TFLOP/s)'."""
    peak = summary.get("gpu_peak") or {}
    gpus = summary.get("gpus") or 1
    cell = (f"{summary['tflops_per_gpu']:,.1f} TFLOP/s per GPU ({gpus} GPU"
            f"{'s' if gpus > 1 else ''})")
    if summary.get("mfu") is None:
        return cell + ", MFU unknown (no peak known for this GPU)"
    return (cell + f", MFU {summary['mfu']:.1%} of {peak.get('name')} "
            f"({_fmt(peak.get('tflops'), ',.0f')} TFLOP/s)")


def print_error(message: str) -> None:
    """The one line a user gets for bad input; whatever of a file it quotes is `printable`."""
    print(f"error: {printable(message)}", file=sys.stderr, flush=True)


def _memory_cell(held: Mapping[str, int | None] | None,
                 predicted: Mapping[str, int] | None) -> str:
    """Parameters, gradients, optimizer state and gathered parameters: counted (predicted)."""
    if not held:
        return ""
    parts = []
    for what, size in held.items():
        guess = (predicted or {}).get(what)
        shown = _fmt_bytes(size) + (f" ({_fmt_bytes(guess)} predicted)"
                                    if guess is not None and guess != size else "")
        parts.append(f"{what} {shown}")
    return ", ".join(parts) + (" as predicted" if predicted == held else "")
