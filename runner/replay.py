"""`python -m runner.replay RUN_DIR [--run-dir NEW]`: run a run again from its `config.yaml`.

The replay starts from scratch (`trainer.resume` is cleared) in `RUN_DIR/replays/<time>/` unless
`--run-dir` says otherwise, then compares its per-step training losses with the original's:
exit 0 when they are identical, 1 when they differ (naming the first step that does), 2 for bad
input. Runs of an asynchronous optimizer are not deterministic: their difference is reported,
and the exit code is 0. No Hydra here: the saved config is already resolved.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from runner.config import ConfigError
from runner.console import print_error
from runner.launch import RunFailed, RunInterrupted, execute
from runner.report.data import read_metrics

EXIT_DIFFERENT, EXIT_BAD_INPUT = 1, 2


def training_losses(run_dir: Path) -> dict[int, float]:
    """Step → training loss from a run's `metrics.jsonl` (a line cut short is skipped)."""
    train, _, _ = read_metrics(run_dir / "metrics.jsonl")
    return {int(r["step"]): float(r["loss"]) for r in train if isinstance(r.get("loss"), float)}


def compare(original: dict[int, float], replay: dict[int, float]) -> str | None:
    """None when the losses of every step both runs logged are identical; otherwise where they
    first differ. Steps only one run logged are not a difference: an interrupted original
    stops early, and one resumed from another directory's checkpoint starts late."""
    common = sorted(set(original) & set(replay))
    if not common:
        return "no step is logged by both runs: nothing to compare"
    for step in common:
        a, b = original[step], replay[step]
        if a != b and not (a != a and b != b):  # NaN == NaN for this purpose
            worst = max(abs(original[s] - replay[s]) for s in common)
            return (f"losses differ from step {step}: {a!r} then, {b!r} now (largest "
                    f"difference {worst:.3g})")
    return None


def uncompared(original: dict[int, float], replay: dict[int, float]) -> str | None:
    """A note on the steps only one of the runs logged."""
    only_original, only_replay = set(original) - set(replay), set(replay) - set(original)
    parts = [f"{len(steps)} step(s) only the {who} logged ({min(steps)}..{max(steps)})"
             for who, steps in (("original", only_original), ("replay", only_replay)) if steps]
    return f"not compared: {'; '.join(parts)}" if parts else None


def _asynchronous(optimizer: str) -> bool:
    """Whether the optimizer's replicas meet in an order no config fixes."""
    from runner.registry import OPTIMIZERS, load_plugins

    load_plugins()
    try:
        return bool(OPTIMIZERS.get(optimizer).asynchronous)
    except Exception:  # an unknown name: the validator has refused it already
        return False


def _holds_a_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", "metrics.jsonl",
                                                     "summary.json"))


def replay(run_dir: Path, new_dir: Path | None = None) -> int:
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        print_error(f"{run_dir}: not a run directory (no config.yaml)")
        return EXIT_BAD_INPUT
    try:
        cfg = OmegaConf.load(config_path)
    except Exception as exc:  # malformed YAML raises yaml's or OmegaConf's errors alike
        print_error(f"{config_path}: cannot be read: {str(exc).splitlines()[0]}")
        return EXIT_BAD_INPUT
    if not isinstance(cfg, DictConfig):
        print_error(f"{config_path}: not a mapping of config keys")
        return EXIT_BAD_INPUT
    if OmegaConf.select(cfg, "trainer.resume") is not None:
        print(f"note: the original ran with trainer.resume={cfg.trainer.resume}; the replay "
              "starts from scratch (a resume from another directory's checkpoint logs no early "
              "steps: only the steps both runs logged are compared)", file=sys.stderr)
        with open_dict(cfg):
            cfg.trainer.resume = None
    new_dir = new_dir or run_dir / "replays" / time.strftime("%Y%m%d-%H%M%S")
    if _holds_a_run(new_dir):  # the original itself, say: its losses would be overwritten
        print_error(f"{new_dir} already holds a run: choose another --run-dir")
        return EXIT_BAD_INPUT
    made = not new_dir.exists()
    if (run_dir / ".hydra").is_dir():  # the overrides a resume command repeats
        shutil.copytree(run_dir / ".hydra", new_dir / ".hydra", dirs_exist_ok=True)
    print(f"replaying {run_dir} in {new_dir}")
    try:
        execute(cfg, new_dir)
    except ConfigError as exc:
        if made:  # nothing ran: leave nothing behind
            shutil.rmtree(new_dir, ignore_errors=True)
        print_error(str(exc))
        return EXIT_BAD_INPUT
    except (RunFailed, RunInterrupted) as exc:
        print_error(f"the replay did not complete: {exc}")
        return EXIT_DIFFERENT
    if not (run_dir / "metrics.jsonl").is_file():
        print("the original has no metrics.jsonl: nothing to compare")
        return 0
    original, again = training_losses(run_dir), training_losses(new_dir)
    difference = compare(original, again)
    note = uncompared(original, again)
    if note:
        print(note)
    if difference is None:
        common = len(set(original) & set(again))
        print(f"identical: the {common} training losses of {run_dir} repeated exactly")
        return 0
    if _asynchronous(str(OmegaConf.select(cfg, "optimizer.name"))):
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
