"""`python -m runner.replay`: a run again from its saved config, losses compared."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT, assert_ok, read_metrics, run_cli

RUN = ["trainer.steps=8", "trainer.eval_every=null", "trainer.batch_size=32", "seed=5"]


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.replay", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_a_two_rank_run_replays_to_the_same_losses(tmp_path: Path) -> None:
    original, again = tmp_path / "original", tmp_path / "again"
    assert_ok(run_cli(*RUN, "strategy=data", "grid.pr=1", "grid.pc=2",
                      f"hydra.run.dir={original}"))
    result = replay(str(original), "--run-dir", str(again))
    assert_ok(result)
    assert "identical" in result.stdout
    assert len([m for m in read_metrics(again) if "split" not in m]) == 8
    assert (again / ".hydra" / "overrides.yaml").exists()  # a resume command can repeat them


def test_a_changed_config_is_caught_at_its_first_step(tmp_path: Path) -> None:
    original = tmp_path / "original"
    assert_ok(run_cli(*RUN, "grid.pr=1", "grid.pc=1", f"hydra.run.dir={original}"))
    edited = tmp_path / "edited"
    shutil.copytree(original, edited)
    config = yaml.safe_load((edited / "config.yaml").read_text())
    config["optimizer"]["lr"] = config["optimizer"]["lr"] * 2
    (edited / "config.yaml").write_text(yaml.safe_dump(config))
    # the loss of step 1 is taken before the first update: the learning rate shows at step 2
    result = replay(str(edited), "--run-dir", str(tmp_path / "edited_again"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "losses differ from step 2" in result.stderr


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    result = replay(str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path}: not a run directory (no config.yaml)"
