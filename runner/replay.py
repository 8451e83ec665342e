"""`python -m runner.replay RUN_DIR [--run-dir NEW]`: run a run again from its `config.yaml`.

The replay starts from scratch (`trainer.resume` is cleared) in `RUN_DIR/replays/<time>/` unless
`--run-dir` says otherwise, then compares its per-step training losses with the original's:
exit 0 when they are identical, 1 when they differ (naming the first step that does), 2 for bad
input. Runs of an asynchronous optimizer are not deterministic: their difference is reported,
and the exit code is 0. No Hydra here: the saved config is already resolved.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from runner.config import ConfigError
from runner.console import print_error
from runner.launch import RunFailed, RunInterrupted, execute

ASYNCHRONOUS = ("async_easgd", "async_measgd", "hogwild_easgd")
EXIT_DIFFERENT, EXIT_BAD_INPUT = 1, 2


def training_losses(run_dir: Path) -> dict[int, float]:
    """Step → training loss from a run's `metrics.jsonl` (a line cut short is skipped)."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "split" not in record:
            losses[int(record["step"])] = float(record["loss"])
    return losses


def compare(original: dict[int, float], replay: dict[int, float]) -> str | None:
    """None when the losses are identical; otherwise where they first differ."""
    for step in sorted(set(original) | set(replay)):
        if step not in original or step not in replay:
            return f"step {step} is logged by only one of the runs"
        a, b = original[step], replay[step]
        if a != b and not (a != a and b != b):  # NaN == NaN for this purpose
            worst = max(abs(original[s] - replay[s]) for s in original if s in replay)
            return (f"losses differ from step {step}: {a!r} then, {b!r} now (largest "
                    f"difference {worst:.3g})")
    return None


def replay(run_dir: Path, new_dir: Path | None = None) -> int:
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        print_error(f"{run_dir}: not a run directory (no config.yaml)")
        return EXIT_BAD_INPUT
    cfg = OmegaConf.load(config_path)
    if OmegaConf.select(cfg, "trainer.resume") is not None:
        print(f"note: the original resumed from {cfg.trainer.resume}; the replay starts from "
              f"scratch, so its early steps have nothing to compare with", file=sys.stderr)
        with open_dict(cfg):
            cfg.trainer.resume = None
    new_dir = new_dir or run_dir / "replays" / time.strftime("%Y%m%d-%H%M%S")
    if (run_dir / ".hydra").is_dir():  # the overrides a resume command repeats
        shutil.copytree(run_dir / ".hydra", new_dir / ".hydra", dirs_exist_ok=True)
    print(f"replaying {run_dir} in {new_dir}")
    try:
        execute(cfg, new_dir)
    except ConfigError as exc:
        print_error(str(exc))
        return EXIT_BAD_INPUT
    except (RunFailed, RunInterrupted) as exc:
        print_error(f"the replay did not complete: {exc}")
        return EXIT_DIFFERENT
    if not (run_dir / "metrics.jsonl").is_file():
        print("the original has no metrics.jsonl: nothing to compare")
        return 0
    difference = compare(training_losses(run_dir), training_losses(new_dir))
    if difference is None:
        print(f"identical: every training loss of {run_dir} repeated exactly")
        return 0
    if OmegaConf.select(cfg, "optimizer.name") in ASYNCHRONOUS:
        print(f"{difference} — expected: asynchronous replicas meet in an order no config fixes")
        return 0
    print_error(difference)
    return EXIT_DIFFERENT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.replay",
                                     description="Run a run again from its config.yaml and "
                                                 "compare the losses.")
    parser.add_argument("run_dir", type=Path, help="the run directory to replay")
    parser.add_argument("--run-dir", dest="new_dir", type=Path, default=None,
                        help="where the replay goes (default: RUN_DIR/replays/<time>/)")
    args = parser.parse_args(argv)
    return replay(args.run_dir, args.new_dir)


if __name__ == "__main__":
    sys.exit(main())
