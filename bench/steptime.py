"""Predicted against measured step time, for every strategy and `auto`, through the command line
(the runs a user makes), and whether `auto`'s choice is the fastest of the layouts tried.

    python bench/steptime.py [--ranks 2 4] [--models mlp cnn] [--steps 60]

For each rank count P and model, every grid Pr × Pc of P and every strategy that accepts it runs
`python -m runner` for `--steps` steps (one thread per rank, digits); each run's summary gives
the median step time and communication time, measured and predicted (compute at this machine's
calibrated rates + α–β communication, `gridrun-plan plan.calibrate=true` first for calibrated
numbers). Prints JSON: per run the two step times, their ratio, the same for communication;
per (P, model) the fastest run measured, `auto`'s own time and its ratio to the fastest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

STRATEGIES = ("data", "model", "grid", "domain", "auto")
MODELS = {"mlp": ["model=mlp"], "cnn": ["model=cnn"]}


def run(strategy: str, model: str, pr: int, pc: int, steps: int, out: Path) -> dict | None:
    directory = out / f"{model}_{strategy}_{pr}x{pc}"
    result = subprocess.run(
        [sys.executable, "-m", "runner", f"strategy={strategy}", *MODELS[model],
         f"grid.pr={pr}", f"grid.pc={pc}", f"trainer.steps={steps}",
         f"trainer.eval_every={steps}", "trainer.log_every=1000",
         f"hydra.run.dir={directory}"], capture_output=True, text=True)
    if result.returncode != 0:
        return None  # refused (a strategy that cannot split this model here)
    summary = json.loads((directory / "summary.json").read_text())
    return {
        "strategy": strategy, "model": model, "ranks": pr * pc, "grid": f"{pr}x{pc}",
        "step_s": summary["median_step_time_s"],
        "predicted_step_s": summary["predicted_step_time_s"],
        "step_ratio": summary["predicted_step_time_s"] / summary["median_step_time_s"],
        "comm_s": summary["comm_time_s_per_step"],
        "predicted_comm_s": summary["predicted_comm_time_s_per_step"],
        "layouts": summary.get("layouts"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    runs, choices = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            grids = [(pr, ranks // pr) for pr in range(1, ranks + 1) if ranks % pr == 0]
            for model in args.models:
                done = [r for s in STRATEGIES for pr, pc in grids
                        if (r := run(s, model, pr, pc, args.steps, Path(tmp))) is not None]
                runs += done
                fastest = min(done, key=lambda r: r["step_s"])
                autos = [r for r in done if r["strategy"] == "auto"]
                chosen = min(autos, key=lambda r: r["predicted_step_s"])  # the planner's grid
                choices.append({"ranks": ranks, "model": model,
                                "fastest": f"{fastest['strategy']} {fastest['grid']}",
                                "fastest_s": fastest["step_s"],
                                "auto": f"auto {chosen['grid']}", "auto_s": chosen["step_s"],
                                "auto_over_fastest": chosen["step_s"] / fastest["step_s"]})
    print(json.dumps({"runs": runs, "auto_choice": choices}, indent=2))


if __name__ == "__main__":
    main()
