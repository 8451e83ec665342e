"""Start-up cost: a short MPI run through the CLI against the floor of starting its ranks.

    python bench/startup.py [--repeats 3] [--ranks 4] [--steps 5] [--root DIR]

Four commands, timed wall-clock from this process, interleaved within each repeat (a drift of
the shared machine hits all alike), each in a fresh temporary directory, each required to exit 0:
- `mpiexec`: `mpiexec -n P python -c 'import torch'` (the mpiexec beside sys.executable), the
  floor of any P-rank job of this project;
- `compose`: `python -m runner --cfg job`, the head composing (and printing) the config,
  running nothing;
- `run`: `python -m runner grid.pr=.. grid.pc=.. trainer.steps=S hydra.run.dir=TMP`, P ranks;
- `run_1`: the same on a 1 × 1 grid (trains inside the head process, no MPI).

The target: `ratio = run / (mpiexec + compose) <= 1.5` (medians): a short run should cost little
more than composing its config and starting its ranks. The P-rank run is also split
(`run_split_s`), from its run directory:
- `head_before_job_s`: up to the mtime of `config.yaml`, which the head writes just before it
  starts mpiexec (interpreter, imports, composition, validation);
- `job_startup_s`: from there to the start of rank 0's `train()` (`summary.json`'s mtime less its
  `wall_time_s`): mpiexec, the ranks' interpreters, imports, MPI;
  `ranks_started_s`, when the head's rank records (`RUN_DIR/.ranks/`, removed at the end) were
  seen during the run, is how long after the job's start the first rank's supervisor wrote its
  record (interpreter up, before torch and MPI);
- `train_wall_s`: rank 0's `wall_time_s` (data, model, optimizer, steps, evaluation);
- `after_train_s`: the rest, the ranks' and the head's exits (interpreter teardown, mpiexec).
`logs/rank0.log` stamps whole seconds, too coarse to split on: it only confirms that the steps
ran. `--root` times another checkout (e.g. an earlier commit unpacked with `git archive`), put
first on PYTHONPATH; the default is this repository. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GRIDS = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}  # ranks -> (pr, pc)
TARGET = 1.5
TIMEOUT_S = 600
POLL_S = 0.05  # how often the run directory is looked at during the P-rank run


def timed(command: list[str], root: Path,
          watch: Path | None = None) -> tuple[float, float, float | None]:
    """Run `command` in `root`; (wall seconds, epoch at its start, the earliest rank-record
    start seen under `watch`/.ranks, if any). Exits with the command's output if it fails."""
    first_rank: float | None = None
    # `root` first on the path: the editable install would otherwise supply its own `runner`.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    start_epoch, start = time.time(), time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:  # a file: a pipe left unread could fill and block
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        while True:
            try:
                process.wait(timeout=POLL_S if watch is not None else TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                if time.perf_counter() - start > TIMEOUT_S:
                    process.kill()
                    process.wait()
                    break
                if watch is not None and first_rank is None:
                    first_rank = _first_rank_start(watch)
        wall = time.perf_counter() - start
        if process.returncode != 0:
            out.seek(0)
            tail = out.read()[-4000:]
            sys.exit(f"bench/startup.py: {' '.join(command)} (in {root}) exited with "
                     f"{process.returncode} after {wall:.1f} s:\n{tail}")
    return wall, start_epoch, first_rank


def _first_rank_start(run_dir: Path) -> float | None:
    try:
        starts = [json.loads(p.read_text())["started"]
                  for p in (run_dir / ".ranks").glob("rank*.json")]
    except (OSError, ValueError, KeyError):  # not there yet, or being replaced
        return None
    return min(starts) if starts else None


def split_run(run_dir: Path, start_epoch: float, wall: float, first_rank: float | None,
              steps: int) -> dict[str, Any]:
    """The P-rank run's wall time in parts, from the files its run directory keeps."""
    summary = json.loads((run_dir / "summary.json").read_text())
    log = (run_dir / "logs" / "rank0.log").read_text()
    logged_steps = len(re.findall(r" step \d+ loss ", log))
    if summary.get("status") != "completed" or logged_steps != steps:
        sys.exit(f"bench/startup.py: {run_dir} did not train {steps} steps: status "
                 f"{summary.get('status')}, {logged_steps} steps in logs/rank0.log")
    job_start = (run_dir / "config.yaml").stat().st_mtime - start_epoch
    train_start = (run_dir / "summary.json").stat().st_mtime - summary["wall_time_s"] - start_epoch
    return {
        "head_before_job_s": job_start,
        "ranks_started_s": None if first_rank is None else first_rank - start_epoch - job_start,
        "job_startup_s": train_start - job_start,
        "train_wall_s": summary["wall_time_s"],
        "after_train_s": wall - train_start - summary["wall_time_s"],
        "median_step_s": summary["median_step_time_s"],
    }


def machine() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "processor": platform.processor() or None}


def checkout(root: Path) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):  # an unpacked archive: no git
        return {"root": str(root), "commit": None, "dirty": None}
    return {"root": str(root), "commit": commit, "dirty": dirty}


def summarise(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, choices=sorted(GRIDS), default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose `python -m runner` is timed")
    args = parser.parse_args()
    root = args.root.resolve()
    if not (root / "runner" / "__main__.py").is_file():
        parser.error(f"--root {root} is not a checkout of this project (no runner/__main__.py)")
    pr, pc = GRIDS[args.ranks]
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    python = sys.executable
    times: dict[str, list[float]] = {"mpiexec": [], "compose": [], "run": [], "run_1": []}
    splits: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for repeat in range(args.repeats):
            times["mpiexec"].append(timed([mpiexec, "-n", str(args.ranks), python, "-c",
                                           "import torch"], root)[0])
            times["compose"].append(timed([python, "-m", "runner", "--cfg", "job"], root)[0])
            run_dir = Path(tmp) / f"run_{repeat}"
            wall, start_epoch, first_rank = timed(
                [python, "-m", "runner", f"grid.pr={pr}", f"grid.pc={pc}",
                 f"trainer.steps={args.steps}", f"hydra.run.dir={run_dir}"], root, watch=run_dir)
            times["run"].append(wall)
            splits.append(split_run(run_dir, start_epoch, wall, first_rank, args.steps))
            times["run_1"].append(timed(
                [python, "-m", "runner", "grid.pr=1", "grid.pc=1", f"trainer.steps={args.steps}",
                 f"hydra.run.dir={Path(tmp) / f'run_1_{repeat}'}"], root)[0])
    median = {name: statistics.median(samples) for name, samples in times.items()}
    ratio = median["run"] / (median["mpiexec"] + median["compose"])
    split = {key: summarise([s[key] for s in splits])
             if all(s[key] is not None for s in splits) else None for key in splits[0]}
    print(json.dumps({
        "ranks": args.ranks, "grid": {"pr": pr, "pc": pc}, "steps": args.steps,
        "repeats": args.repeats,
        "commands": {
            "mpiexec": f"mpiexec -n {args.ranks} python -c 'import torch'",
            "compose": "python -m runner --cfg job",
            "run": f"python -m runner grid.pr={pr} grid.pc={pc} trainer.steps={args.steps}",
            "run_1": f"python -m runner grid.pr=1 grid.pc=1 trainer.steps={args.steps}"},
        "seconds": {name: summarise(samples) for name, samples in times.items()},
        "run_split_s": split,
        "ratio": ratio, "ratio_formula": "run / (mpiexec + compose), medians",
        "target": TARGET, "met": ratio <= TARGET,
        "machine": machine(), "checkout": checkout(root),
    }, indent=1))


if __name__ == "__main__":
    main()
