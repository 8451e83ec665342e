"""What `torch.compile` gains or costs gridrun on CPUs: eager steps against `trainer.compile`, per
model and parallel layout, and what the compiling itself costs, cold and from a warm cache.

    python bench/compile.py [--cases NAME ...] [--rounds 2] [--threads N] [--quick]
                            [--out FILE] [--keep DIR]

Cases (`CASES`), each a run of the real command line, `python -m runner ...` (seed 0, SGD, the
loss read every step, no evaluation until the one at the end, which runs eagerly on both sides):
- `gpt_*`: gridrun's GPT (`model=gpt`, width 128, 4 layers, 4 heads) on `dataset=tokens` (vocab
  256, 64-token windows), global batch 32, compiled side `trainer.compile=blocks` (each block of
  its `nn.ModuleList`); at P = 1 (`strategy=data`, 1 × 1), P = 2 data parallel (`strategy=data`,
  1 × 2) and P = 2 tensor parallel (`strategy=grid`, 2 × 1: heads and MLP features split, an
  all-reduce inside each block, so a block is compiled around and its pieces between the
  collectives are compiled);
- `mlp_*`: gridrun's MLP (`model=mlp`, hidden [128, 128]) on `dataset=digits`, global batch 64,
  compiled side `trainer.compile=model` (it has no `nn.ModuleList`: `blocks` is refused), at
  P = 1 and P = 2 (`strategy=data`).
Threads per rank are gridrun's default (the cores / the ranks), or `--threads` (trainer.threads);
P = 2 starts its ranks with MPI.

Per case:
1. Cold: one short run of the compiled side into a fresh private compile cache (the benchmark's
   own `trainer.compile_cache`): its summary's `compile` section gives `compile_s` (the seconds
   dynamo and inductor spent, forward and backward graphs: `strategies.compiled`), the graphs
   and the cache's misses. Inductor keeps its precompiled C++ header outside that cache, under
   the temp directory; every run here gets a private TMPDIR, so the first cold compile of the
   benchmark also builds that header (`precompiled_header_built_by` names the case) and the
   later cold compiles find it, as they would on a machine that has compiled anything before.
2. Rounds: `--rounds` times, eager (`trainer.compile=none`) then compiled (the cache now warm),
   alternating (a drift of the shared machine hits both alike), each a fresh process with the
   same seed and config. A run's step time is the median of its `metrics.jsonl` `step_time_s`
   (rank 0's wall time of each step) over the steps after the first `SKIP`: the first step
   of a compiled run holds its compiling, and the summary's `median_step_time_s` is the median
   over every step, that one included (reported beside it, `summary_median_step_s`). The
   case's step time is the median over the rounds; samples/s = batch / that;
   `speed_ratio = eager step / compiled step` (> 1: compiling is faster); `best_speed_ratio` the
   same of each side's fastest round (a shared machine's bursts of load slow a run, never speed
   it up; each run records the 1-minute load average at its start). `warm_compile_s`: the
   median of the compiled rounds' `compile_s` (graphs read from the cache, and dynamo's
   tracing, which no cache saves); `break_even_steps`: the steps after which the compiled run
   has caught up, cold and warm (none where it is not faster).
3. Losses: both sides start from the same weights and see the same batches, so the final losses
   agree to float32 rounding; `max_abs_step_loss_gap` is the largest per-step gap of round 0.
Prints one JSON document (also written to `--out`): the machine (cores, torch, load averages
before and after: the machine may be shared), each case's overrides and each measurement.
The default run takes about 8 minutes on 2 cores; `--quick` is a 1-2 minute check: the P = 1
cases, fewer steps, one round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
SKIP = 5  # the first steps of every run, left out of its median step time
COLD_STEPS = 3  # the cold run's steps: only its compiling is measured
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"batch": 32, "steps": 30, "quick_steps": 15, "overrides": [
        "model=gpt", "model.width=128", "model.layers=4", "model.heads=4", "dataset=tokens",
        "dataset.vocab_size=256", "dataset.seq_len=64", "dataset.samples=2048"]},
    "mlp": {"batch": 64, "steps": 200, "quick_steps": 100, "overrides": [
        "model=mlp", "model.hidden=[128,128]", "dataset=digits"]},
}
COMMON = [f"seed={SEED}", "optimizer=sgd", "trainer.eval_every=null", "trainer.eval_samples=256",
          "trainer.log_every=1"]


@dataclass(frozen=True)
class Case:
    """A model at a layout, and the `trainer.compile` of its compiled side."""

    model: str
    layout: tuple[str, ...]
    mode: str

    @property
    def ranks(self) -> int:
        grid = dict(item.split("=") for item in self.layout if item.startswith("grid."))
        return int(grid["grid.pr"]) * int(grid["grid.pc"])


DATA_1 = ("strategy=data", "grid.pr=1", "grid.pc=1")
DATA_2 = ("strategy=data", "grid.pr=1", "grid.pc=2")
TENSOR_2 = ("strategy=grid", "grid.pr=2", "grid.pc=1")
CASES = {
    "gpt_p1_data": Case("gpt", DATA_1, "blocks"),
    "gpt_p2_data": Case("gpt", DATA_2, "blocks"),
    "gpt_p2_tensor": Case("gpt", TENSOR_2, "blocks"),
    "mlp_p1_data": Case("mlp", DATA_1, "model"),
    "mlp_p2_data": Case("mlp", DATA_2, "model"),
}
QUICK_CASES = ["gpt_p1_data", "mlp_p1_data"]


@dataclass
class Run:
    """One `python -m runner` process: its summary and rank 0's per-step lines."""

    command: str
    wall_s: float
    load_at_start: float
    summary: dict[str, Any]
    step_s: list[float]
    losses: list[float]

    def median_step_s(self) -> float:
        return statistics.median(self.step_s[SKIP:])

    def compile_section(self) -> dict[str, Any]:
        section: dict[str, Any] = self.summary.get("compile") or {}
        return section


class Bench:
    """Starts the runs, each in its own run directory under `root`, with a private TMPDIR."""

    def __init__(self, root: Path, quick: bool, threads: int | None) -> None:
        self.root, self.quick, self.threads, self.count = root, quick, threads, 0
        temp = root / "tmp"
        temp.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "TMPDIR": str(temp)}
        self.header = temp / f"torchinductor_{_user()}" / "precompiled_headers"

    def overrides(self, case: Case, steps: int | None = None) -> list[str]:
        model = MODELS[case.model]
        steps = steps or model["quick_steps" if self.quick else "steps"]
        threads = [] if self.threads is None else [f"trainer.threads={self.threads}"]
        return [*model["overrides"], *case.layout, *COMMON, f"trainer.batch_size={model['batch']}",
                f"trainer.steps={steps}", *threads]

    def run(self, label: str, overrides: list[str]) -> Run:
        self.count += 1
        run_dir = self.root / f"{self.count:02d}_{label}"
        command = [sys.executable, "-m", "runner", *overrides, f"hydra.run.dir={run_dir}"]
        load = os.getloadavg()[0]
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        summary_path = run_dir / "summary.json"
        if result.returncode != 0 or not summary_path.exists():
            raise SystemExit(f"bench/compile.py: `{shlex.join(command)}` exited "
                             f"{result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
        lines = [json.loads(line) for line in
                 (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = [line for line in lines if "split" not in line]
        return Run(shlex.join(command), wall, load, json.loads(summary_path.read_text()),
                   [line["step_time_s"] for line in steps], [line["loss"] for line in steps])

    def cold(self, name: str, case: Case, cache: Path) -> tuple[Run, bool]:
        """The compiled side's first run into an empty cache; whether it built inductor's
        precompiled header."""
        had_header = self.header.exists() and any(self.header.iterdir())
        overrides = [*self.overrides(case, COLD_STEPS), f"trainer.compile={case.mode}",
                     f"trainer.compile_cache={cache}"]
        return self.run(f"{name}_cold", overrides), not had_header


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"


def _side(runs: list[Run], batch: int) -> dict[str, Any]:
    """One side's figures over its rounds."""
    step = statistics.median(run.median_step_s() for run in runs)
    return {"median_step_s": step, "samples_per_s": batch / step,
            "best_round_step_s": min(run.median_step_s() for run in runs),
            "rounds_median_step_s": [run.median_step_s() for run in runs],
            "summary_median_step_s": [run.summary["median_step_time_s"] for run in runs],
            "first_step_s": [run.step_s[0] for run in runs],
            "final_loss": runs[0].summary["final_loss"],
            "process_wall_s": [round(run.wall_s, 2) for run in runs],
            "load_average_at_start": [round(run.load_at_start, 2) for run in runs],
            "command": runs[0].command}


def _break_even(compile_s: float, eager_step: float, compiled_step: float) -> float | None:
    """Steps after which the time a compiled run saves per step has paid its compiling."""
    saved = eager_step - compiled_step
    return compile_s / saved if saved > 0 else None


def measure(bench: Bench, name: str, case: Case, rounds: int) -> dict[str, Any]:
    cache = bench.root / "cache" / name
    cold, built_header = bench.cold(name, case, cache)
    base = bench.overrides(case)
    eager_runs, compiled_runs = [], []
    for r in range(rounds):
        eager_runs.append(bench.run(f"{name}_eager_{r}", [*base, "trainer.compile=none"]))
        compiled_runs.append(bench.run(f"{name}_compiled_{r}", [
            *base, f"trainer.compile={case.mode}", f"trainer.compile_cache={cache}"]))
    batch = MODELS[case.model]["batch"]
    eager, compiled = _side(eager_runs, batch), _side(compiled_runs, batch)
    cold_section = cold.compile_section()
    warm_sections = [run.compile_section() for run in compiled_runs]
    cold_s = float(cold_section["compile_s"])
    warm_s = statistics.median(float(s["compile_s"]) for s in warm_sections)
    gaps = [abs(a - b) for a, b in zip(eager_runs[0].losses, compiled_runs[0].losses,
                                       strict=True)]
    return {
        "model": case.model, "ranks": case.ranks, "layout": list(case.layout),
        "compiled_with": f"trainer.compile={case.mode}", "batch": batch,
        "steps": len(eager_runs[0].step_s), "steps_timed": len(eager_runs[0].step_s) - SKIP,
        "overrides": base,
        "eager": eager, "compiled": compiled,
        "speed_ratio": eager["median_step_s"] / compiled["median_step_s"],
        "best_speed_ratio": eager["best_round_step_s"] / compiled["best_round_step_s"],
        "compile": {
            "cold_compile_s": cold_s, "warm_compile_s": warm_s,
            "warm_compile_s_rounds": [s["compile_s"] for s in warm_sections],
            "cold_cache": cold_section["cache"], "warm_cache": warm_sections[0]["cache"],
            "warm_all_from_cache": all(s["cache"]["misses"] == 0 and s["cache"]["hits"] > 0
                                       for s in warm_sections),
            "graphs": warm_sections[0]["graphs"], "backend": cold_section["backend"],
            "compiled": warm_sections[0]["compiled"],
            "compiled_around": warm_sections[0]["compiled_around"],
            "eager": warm_sections[0]["eager"], "rebuilt": warm_sections[0]["rebuilt"],
            "same_modules_cold_and_warm": all(
                s["compiled"] == cold_section["compiled"] for s in warm_sections),
            "cold_first_step_s": cold.step_s[0], "cold_process_wall_s": round(cold.wall_s, 2),
            "cold_built_precompiled_header": built_header,
            "cold_command": cold.command,
        },
        "break_even_steps": {
            "cold": _break_even(cold_s, eager["median_step_s"], compiled["median_step_s"]),
            "warm": _break_even(warm_s, eager["median_step_s"], compiled["median_step_s"])},
        "losses": {"eager_final": eager["final_loss"], "compiled_final": compiled["final_loss"],
                   "final_gap": abs(eager["final_loss"] - compiled["final_loss"]),
                   "max_abs_step_loss_gap": max(gaps)},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=tuple(CASES), help="default: all "
                        "(--quick: the P = 1 cases)")
    parser.add_argument("--rounds", type=int, help="alternating eager / compiled processes "
                        "per case (default 2; --quick 1)")
    parser.add_argument("--threads", type=int, help="trainer.threads of every run (default: "
                        "gridrun's, the cores / the ranks)")
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute check")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--keep", type=Path, help="keep the run directories under DIR")
    args = parser.parse_args()
    args.cases = args.cases or (QUICK_CASES if args.quick else list(CASES))
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.rounds < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--rounds and --threads must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            root = args.keep
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="gridrun-compile-")))
        bench = Bench(root, args.quick, args.threads)
        cases = {name: measure(bench, name, CASES[name], args.rounds) for name in args.cases}
    built = [name for name, case in cases.items()
             if case["compile"]["cold_built_precompiled_header"]]
    report = {
        "benchmark": "compile",
        "machine": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "torch": version("torch"),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "quick": args.quick, "rounds": args.rounds, "skipped_steps": SKIP,
        "threads_per_rank": args.threads or "gridrun's default: the cores / the ranks",
        "cold_steps": COLD_STEPS, "seed": SEED,
        "precompiled_header_built_by": built[0] if built else None,
        "terms": {
            "median_step_s": "per run: the median of metrics.jsonl step_time_s (rank 0) after "
                             f"the first {SKIP} steps; per side: the median over the rounds",
            "summary_median_step_s": "summary.json median_step_time_s: over every step, the "
                                     "first (which compiles) included",
            "samples_per_s": "batch / median_step_s",
            "speed_ratio": "eager median_step_s / compiled median_step_s (> 1: compiled is "
                           "faster)",
            "best_speed_ratio": "the same of each side's fastest round",
            "cold_compile_s": "summary compile_s of a run into an empty private compile cache",
            "warm_compile_s": "summary compile_s of the timed compiled runs (cache warm), "
                              "median over the rounds",
            "break_even_steps": "compile_s / (eager step - compiled step): the steps a run "
                                "needs before compiling has paid for itself",
            "max_abs_step_loss_gap": "largest |eager - compiled| per-step training loss, round 0",
        },
        "cases": cases,
        "bench_wall_s": time.perf_counter() - started,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
