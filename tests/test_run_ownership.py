"""A run directory belongs to one run. Starting a run into a directory that records an earlier
run (its metrics, its outcome, its checkpoints) is refused in one line naming the directory and
what it holds, with every file of it left as it was, unless it is a resume of that same run:
from its own checkpoints, under its own config but for what a resume may change
(`runner.cli.preflight.RESUMABLE`). A resume keeps what it rewrites under `earlier-<time>/`.

In-process through the head's own check (`runner.cli.app.precheck`), on copies of one real run;
two cases through the command line.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from runner.cli.app import precheck
from runner.records.rundir import release_run_dirs
from tests.conftest import assert_ok, read_metrics, read_summary, run_cli

BASE = ["strategy=data", "grid.pr=1", "grid.pc=1", "trainer.eval_every=null", "seed=3"]
STEPS = ["trainer.steps=4", "trainer.checkpoint_every=2"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 4-step run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("owned") / "run"
    assert_ok(run_cli(*BASE, *STEPS, f"hydra.run.dir={run_dir}"))
    return run_dir


def _copy(finished: Path, tmp_path: Path, name: str = "run") -> Path:
    copy = tmp_path / name
    shutil.copytree(finished, copy)
    return copy


def _contents(run_dir: Path) -> dict[str, str]:
    """Every file under `run_dir` and the hash of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _check(*overrides: str) -> str | None:
    try:
        return precheck([*BASE, *overrides])
    finally:
        release_run_dirs()


def test_a_new_run_into_a_finished_runs_directory_is_refused(finished: Path,
                                                             tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    before = _contents(run_dir)
    problem = _check(*STEPS, "seed=4", f"hydra.run.dir={run_dir}")
    assert problem is not None and "\n" not in problem
    assert f"hydra.run.dir={run_dir} holds an earlier run (metrics.jsonl (5 lines), " \
           f"summary.json (completed), checkpoints/)" in problem
    assert "trainer.resume=auto" in problem
    assert _contents(run_dir) == before


def test_another_runs_checkpoint_into_a_finished_runs_directory_is_refused(
        finished: Path, tmp_path: Path) -> None:
    mine, other = _copy(finished, tmp_path, "mine"), _copy(finished, tmp_path, "other")
    before = _contents(mine)
    problem = _check("trainer.steps=6", f"trainer.resume={other}/checkpoints/step-00000002",
                     f"hydra.run.dir={mine}")
    assert problem is not None and "is another run's checkpoint" in problem
    assert _contents(mine) == before


@pytest.mark.parametrize("change,named", [
    (["optimizer.lr=0.2"], "optimizer.lr: 0.1 → 0.2"),
    (["trainer.batch_size=32"], "trainer.batch_size: 64 → 32"),
    (["seed=4"], "seed: 3 → 4"),
    (["model.hidden=[32]"], "model.hidden:"),
])
def test_a_resume_under_another_config_is_refused_naming_what_changed(
        finished: Path, tmp_path: Path, change: list[str], named: str) -> None:
    run_dir = _copy(finished, tmp_path)
    before = _contents(run_dir)
    problem = _check("trainer.steps=6", "trainer.resume=auto", *change,
                     f"hydra.run.dir={run_dir}")
    assert problem is not None and "under another config" in problem, problem
    assert named in problem, problem
    assert _contents(run_dir) == before


def test_a_resume_without_a_checkpoint_in_a_directory_with_records_is_refused(
        finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    before = _contents(run_dir)
    problem = _check(*STEPS, "trainer.resume=auto", f"hydra.run.dir={run_dir}")
    assert problem is not None and "no checkpoint to continue it from" in problem
    assert _contents(run_dir) == before


def test_a_resume_of_the_same_run_may_train_longer_on_another_grid(finished: Path,
                                                                   tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    config = (run_dir / "config.yaml").read_bytes()
    summary = (run_dir / "summary.json").read_bytes()
    try:
        problem = precheck(["strategy=data", "grid.pr=1", "grid.pc=2", "trainer.eval_every=null",
                            "seed=3", "trainer.steps=6", "trainer.resume=auto",
                            f"hydra.run.dir={run_dir}"])
    finally:
        release_run_dirs()
    assert problem is None
    [earlier] = run_dir.glob("earlier-*")
    assert (earlier / "config.yaml").read_bytes() == config
    assert (earlier / "summary.json").read_bytes() == summary
    assert (earlier / ".hydra" / "overrides.yaml").is_file()


def test_a_fresh_or_empty_directory_is_a_runs_own(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert _check(*STEPS, f"hydra.run.dir={tmp_path / 'empty'}") is None
    assert _check(*STEPS, f"hydra.run.dir={tmp_path / 'new'}") is None
    assert _check(*STEPS, "trainer.resume=auto", f"hydra.run.dir={tmp_path / 'new2'}") is None


def test_through_the_command_line_a_rerun_is_refused_and_a_resume_continues(
        finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    before = _contents(run_dir)
    rerun = run_cli(*BASE, *STEPS, f"hydra.run.dir={run_dir}")
    assert rerun.returncode == 2, rerun.stderr
    assert len(rerun.stderr.strip().splitlines()) == 1 and "holds an earlier run" in rerun.stderr
    assert _contents(run_dir) == before
    resumed = run_cli(*BASE, "trainer.steps=6", "trainer.checkpoint_every=2",
                      "trainer.resume=auto", f"hydra.run.dir={run_dir}")
    assert_ok(resumed)
    assert [m["step"] for m in read_metrics(run_dir) if "split" not in m] == [1, 2, 3, 4, 5, 6]
    assert read_summary(run_dir)["steps"] == 6
    [earlier] = run_dir.glob("earlier-*")
    assert (earlier / "summary.json").read_bytes() == (finished / "summary.json").read_bytes()


def test_a_resume_with_nothing_left_to_train_is_refused(finished: Path, tmp_path: Path) -> None:
    run_dir = _copy(finished, tmp_path)
    problem = _check(*STEPS, "trainer.resume=auto", f"hydra.run.dir={run_dir}")
    assert problem is not None and "nothing to train" in problem, problem
    assert "is at step 4 and trainer.steps=4" in problem


def test_a_manifest_claiming_a_step_beyond_any_run_is_refused(finished: Path,
                                                              tmp_path: Path) -> None:
    import json

    source = _copy(finished, tmp_path, "source")
    manifest = source / "checkpoints" / "step-00000004" / "manifest.json"
    record = json.loads(manifest.read_text())
    record["step"] = 10 ** 30
    manifest.write_text(json.dumps(record))
    problem = _check("trainer.steps=6", f"trainer.resume={manifest.parent}",
                     f"hydra.run.dir={tmp_path / 'new'}")
    assert problem is not None and f"'step' is {10 ** 30}, not a step" in problem, problem
