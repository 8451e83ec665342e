"""`python -m runner.replay`: a run again from its saved config, losses compared.

One real 1-rank run per module; replays of it (and of an edited copy) run through the real
command line. Bad input is checked in-process: it never gets as far as training.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.replay import compare, main, uncompared
from tests.conftest import ROOT, assert_ok, read_metrics, run_cli, train_losses

RUN = ["strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=8", "trainer.eval_every=null",
       "trainer.batch_size=32", "seed=5"]


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.replay", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "original"
    assert_ok(run_cli(*RUN, f"hydra.run.dir={path}"))
    return path


def test_a_run_replays_to_the_same_losses(original: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the default destination is inside the run
    shutil.copytree(original, source)
    result = replay(str(source))
    assert_ok(result)
    (again,) = (source / "replays").iterdir()  # the default: RUN_DIR/replays/<time>/
    assert f"identical: the 8 training losses of {source} repeated exactly" in result.stdout
    assert train_losses(again) == train_losses(original) and len(train_losses(again)) == 8
    assert json.loads((again / "summary.json").read_text())["status"] == "completed"
    assert (again / ".hydra" / "overrides.yaml").exists()  # a resume command can repeat them


def test_a_changed_config_is_caught_at_its_first_step(original: Path, tmp_path: Path) -> None:
    edited = tmp_path / "edited"
    shutil.copytree(original, edited)
    config = yaml.safe_load((edited / "config.yaml").read_text())
    config["optimizer"]["lr"] = config["optimizer"]["lr"] * 2
    config["trainer"]["resume"] = "auto"  # cleared by the replay, and said so
    (edited / "config.yaml").write_text(yaml.safe_dump(config))
    again = tmp_path / "edited_again"
    result = replay(str(edited), "--run-dir", str(again))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "trainer.resume=auto; the replay starts from scratch" in result.stderr
    # the loss of step 1 is taken before the first update: the learning rate shows at step 2
    before, after = train_losses(original), train_losses(again)
    assert before[0] == after[0] and before[1] != after[1]
    worst = max(abs(a - b) for a, b in zip(before, after, strict=True))
    assert (f"error: losses differ from step 2: {before[1]!r} then, {after[1]!r} now "
            f"(largest difference {worst:.3g})") in result.stderr
    assert len([m for m in read_metrics(again) if "split" not in m]) == 8


def test_only_the_steps_both_runs_logged_are_compared() -> None:
    original = {1: 2.5, 2: 2.25, 3: float("nan")}  # stopped after step 3 (NaN: diverged alike)
    replay_losses = {1: 2.5, 2: 2.25, 3: float("nan"), 4: 2.0, 5: 1.5}
    assert compare(original, replay_losses) is None
    assert uncompared(original, replay_losses) == "not compared: 2 step(s) only the replay " \
                                                  "logged (4..5)"
    assert compare({1: 2.5, 2: 2.0}, {1: 2.5, 2: 2.125}) == (
        "losses differ from step 2: 2.0 then, 2.125 now (largest difference 0.125)")
    assert compare({1: 2.5}, {2: 2.5}) == "no step is logged by both runs: nothing to compare"


def test_bad_input_is_one_line(original: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: not a run directory (no config.yaml)\n"
    # replaying into the original would overwrite the very losses it is compared with
    metrics = (original / "metrics.jsonl").read_text()
    assert main([str(original), "--run-dir", str(original)]) == 2
    assert capsys.readouterr().err == (f"error: {original} already holds a run: choose another "
                                       "--run-dir\n")
    assert (original / "metrics.jsonl").read_text() == metrics
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("trainer: [unclosed\n")
    assert main([str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {broken / 'config.yaml'}: cannot be read") and \
        err.count("\n") == 1
    (broken / "config.yaml").write_text("grid: {pr: 0, pc: 1}\n")  # refused by the validator
    assert main([str(broken), "--run-dir", str(tmp_path / "never")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
