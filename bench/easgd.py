"""The replica optimizers on digits at P = 4: time and steps to a target validation accuracy.

    python bench/easgd.py [--ranks 4] [--target 0.93] [--steps 600] [--repeats 2]
                          [--model mlp|cnn] [--slow-seconds 0.0]

Each optimizer (and `sgd`, the synchronous all-reduce a user would otherwise pick) trains the
same model from the same seed with `strategy=data` on a 1 × P grid, evaluating every 10 steps
(the centre variable, for the EASGD family). A method reaches the target at the first evaluation
whose accuracy is at least `--target`; its time is rank 0's training time up to that step
(summed step times, evaluation excluded). `--slow-seconds` makes the last rank a straggler. Runs
are launched through the CLI exactly as a user would; methods alternate within each repeat so a
drift of the shared machine hits all alike. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

METHODS = {
    "sgd": ["optimizer=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9"],
    "sync_easgd": ["optimizer=sync_easgd"],
    "easgd": ["optimizer=easgd"],
    "async_easgd": ["optimizer=async_easgd"],
    "async_measgd": ["optimizer=async_measgd"],
    "hogwild_easgd": ["optimizer=hogwild_easgd"],
}


def run(method: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    overrides = [f"model={args.model}", "dataset=digits", "strategy=data", "grid.pr=1",
                 f"grid.pc={args.ranks}", f"trainer.steps={args.steps}",
                 "trainer.eval_every=10", "trainer.threads=1", f"hydra.run.dir={run_dir}",
                 *METHODS[method]]
    if args.slow_seconds:
        overrides += [f"debug.slow_rank={args.ranks - 1}",
                      f"debug.slow_seconds={args.slow_seconds}"]
    subprocess.run([sys.executable, "-m", "runner", *overrides], check=True,
                   capture_output=True, text=True)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    reached = next((m for m in lines if m.get("split") == "val"
                    and m["accuracy"] >= args.target), None)
    return {
        "steps_to_target": reached["step"] if reached else None,
        "time_to_target_s": reached["time_s"] if reached else None,
        "final_val_accuracy": summary["val_accuracy"],
        "workers_val_accuracy": summary["workers_val_accuracy"],
        "median_step_ms": summary["median_step_time_s"] * 1e3,
        "comm_share": summary["comm_time_share"],
        "comm_bytes_per_step": summary["comm_bytes_per_step"],
    }


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if len(present) == len(values) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--target", type=float, default=0.93)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--slow-seconds", type=float, default=0.0)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for method in args.methods:
                runs[method].append(run(method, args, Path(tmp) / f"{method}_{repeat}"))
    results = {}
    for method, reps in runs.items():
        results[method] = {
            "time_to_target_s": median_or_none([r["time_to_target_s"] for r in reps]),
            "steps_to_target": median_or_none([r["steps_to_target"] for r in reps]),
            "median_step_ms": statistics.median(r["median_step_ms"] for r in reps),
            "comm_share": statistics.median(r["comm_share"] for r in reps),
            "final_val_accuracy": statistics.median(r["final_val_accuracy"] for r in reps),
            "runs": reps,
        }
    print(json.dumps({"ranks": args.ranks, "model": args.model, "target": args.target,
                      "steps": args.steps, "slow_seconds": args.slow_seconds,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
