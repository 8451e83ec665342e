"""`python -m runner.replay`: a run again from its saved config, losses compared.

One real 1-rank run and one 2-rank run per module; replays of them (and of edited copies) run
through the real command line. Bad input is checked in-process: it never gets as far as training.
A run's files are data: its launcher is shown, not run, unless the replay is told to.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.replay import compare, kept_override, main, replay_config, uncompared
from tests import warm_ranks
from tests.conftest import (
    MPIEXEC,
    assert_ok,
    read_metrics,
    read_summary,
    run_cli,
    run_module,
    train_losses,
)

RUN = ["strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=8", "trainer.eval_every=null",
       "trainer.batch_size=32", "seed=5"]
RUN_2_RANKS = ["strategy=data", "grid.pr=1", "grid.pc=2", "trainer.steps=4",
               "trainer.eval_every=null", "trainer.batch_size=32", "seed=5"]


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    return run_module("runner.replay", *args)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "original"
    assert_ok(run_cli(*RUN, f"hydra.run.dir={path}"))
    return path


@pytest.fixture(scope="module")
def original_2_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose replay starts a launcher (P > 1)."""
    path = tmp_path_factory.mktemp("replay") / "two_ranks"
    assert_ok(run_cli(*RUN_2_RANKS, f"hydra.run.dir={path}"))
    return path


def marker_launcher(marker: Path) -> list[str]:
    """A launcher that leaves `marker` behind, then starts the ranks with the bundled mpiexec:
    whether it ran shows in the file system, and the replay trains either way."""
    return ["sh", "-c", f'touch {shlex.quote(str(marker))} && exec "$0" "$@"', MPIEXEC]


def edit_config(run_dir: Path, **sections: Any) -> None:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config.update(sections)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def default_launch(run_dir: Path, ranks: int) -> str:
    """The launch a head shows: its own interpreter (`tests.warm_ranks`) and the mpiexec
    beside it."""
    python = warm_ranks.python()
    return "launcher: " + shlex.join([str(Path(python).parent / "mpiexec"), "-n", str(ranks),
                                      python, "-m", "runner.cli.worker", str(run_dir)])


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


def test_a_run_s_own_launcher_is_shown_not_run(original_2_ranks: Path, tmp_path: Path) -> None:
    """A copied run names a launcher (as a list, the form older files hold): the replay shows
    it and trains with the bundled mpiexec; --trust-launcher runs it."""
    source, marker = tmp_path / "source", tmp_path / "marker"
    shutil.copytree(original_2_ranks, source)
    edit_config(source, launcher={"command": marker_launcher(marker), "nproc_flag": "-n",
                                  "args": []})
    overrides = source / ".hydra" / "overrides.yaml"
    saved = yaml.safe_load(overrides.read_text())
    overrides.write_text(yaml.safe_dump([*saved, "launcher.command=sh", "+hydra.job.chdir=true"]))
    again = tmp_path / "again"
    result = replay(str(source), "--run-dir", str(again))
    assert_ok(result)
    assert not marker.exists()
    assert f"replaying {source} in {again}\n{default_launch(again, 2)}\n" in result.stdout
    assert "identical: the 4 training losses" in result.stdout
    assert read_summary(again)["status"] == "completed" and (again / "logs/rank1.log").exists()
    assert "note: the run's own launcher is not used (launcher.command=['sh', '-c'" in \
        result.stderr and "(--trust-launcher runs the run's own)" in result.stderr
    # the resume command of the replay repeats none of the run's launcher or Hydra overrides
    assert yaml.safe_load((again / ".hydra" / "overrides.yaml").read_text()) == saved
    assert yaml.safe_load((again / "config.yaml").read_text())["launcher"] == {
        "command": None, "nproc_flag": "-n", "args": [], "slurm": None}

    trusted = tmp_path / "trusted"
    result = replay(str(source), "--run-dir", str(trusted), "--trust-launcher")
    assert_ok(result)
    assert marker.exists()
    assert f"launcher: {shlex.join(marker_launcher(marker))} -n 2 " in result.stdout
    assert "identical: the 4 training losses" in result.stdout


def test_an_explicit_launcher_is_used(original_2_ranks: Path, tmp_path: Path) -> None:
    source, marker = tmp_path / "source", tmp_path / "marker"
    shutil.copytree(original_2_ranks, source)
    command = shlex.join(marker_launcher(marker))
    again = tmp_path / "again"
    result = replay(str(source), "--run-dir", str(again), "--launcher-command", command)
    assert_ok(result)
    assert marker.exists()
    assert f"launcher: {command} -n 2 {shlex.quote(warm_ranks.python())} -m runner.cli.worker " \
           f"{again}\n" in result.stdout
    assert "identical: the 4 training losses" in result.stdout
    assert "not used" not in result.stderr  # the run's launcher was the default one


def test_a_run_s_debug_failure_is_not_replayed(original: Path, tmp_path: Path) -> None:
    """A copied run that would hang its only rank for ever replays to completion."""
    source = tmp_path / "source"
    shutil.copytree(original, source)
    config = yaml.safe_load((source / "config.yaml").read_text())
    edit_config(source, debug={**config["debug"], "fail_at_step": 3, "fail_mode": "hang"})
    again = tmp_path / "again"
    result = replay(str(source), "--run-dir", str(again))
    assert_ok(result)
    assert "note: the run's debug.fail_at_step=3 debug.fail_mode='hang' not replayed" in \
        result.stderr
    assert "launcher: none: 1 rank, trained in this process\n" in result.stdout
    assert "identical: the 8 training losses" in result.stdout


def test_the_replay_takes_no_program_or_outside_path_from_the_run() -> None:
    values: dict[str, Any] = {
        "seed": 1,
        "launcher": {"command": "sh -c 'id > /tmp/x'", "nproc_flag": "-np", "args": ["--evil"]},
        "hydra": {"run": {"dir": "/etc"}},
        "plan": {"world": 8, "out": "/tmp/plan.json"},
        "trainer": {"steps": 3, "resume": "/elsewhere/checkpoints/step_2"},
        "debug": {"fail_at_step": 2, "fail_on_rank": 1, "fail_mode": "kill", "slow_rank": 0,
                  "slow_seconds": 1e9, "isolate_comm": True},
    }
    before = json.dumps(values)
    cfg, notes = replay_config(values)
    assert json.dumps(values) == before  # the run's values are not edited in place
    assert cfg["launcher"] == {"command": None, "nproc_flag": "-n", "args": [], "slurm": None}
    assert "hydra" not in cfg and cfg["plan"]["out"] is None and cfg["plan"]["world"] == 4
    assert cfg["trainer"] == {"steps": 3, "resume": None}
    assert cfg["debug"] == {"fail_at_step": None, "fail_on_rank": 0, "fail_mode": "raise",
                            "slow_rank": None, "slow_seconds": 0.0, "isolate_comm": True}
    assert notes[1] == ("the run's own launcher is not used (launcher.command=\"sh -c 'id > "
                        "/tmp/x'\" launcher.nproc_flag='-np' launcher.args=['--evil']); this "
                        "replay runs the bundled mpiexec (--trust-launcher runs the run's own)")
    assert len(notes) == 4 and "hydra" in notes[0] and "resume" in notes[2]

    cfg, _ = replay_config(values, launcher_command="srun --mpi=pmix", nproc_flag="--ntasks")
    assert cfg["launcher"] == {"command": "srun --mpi=pmix", "nproc_flag": "--ntasks", "args": [],
                               "slurm": None}
    cfg, notes = replay_config(values, trust_launcher=True, keep_debug=True)
    assert cfg["launcher"] == values["launcher"] and cfg["debug"] == values["debug"]
    assert not any("launcher" in note or "debug" in note for note in notes)
    listed = {**values, "launcher": {"command": ["sh", "-c", "id > /tmp/x"]}}
    cfg, _ = replay_config(listed, trust_launcher=True)
    assert cfg["launcher"] == {"command": "sh -c 'id > /tmp/x'"}  # the schema's string

    overrides = ["strategy=data", "launcher.command=sh", "+launcher.args=[a]", "hydra.run.dir=/x",
                 "hydra/launcher=basic", "plan.out=/x", "trainer.resume=auto", "trainer.steps=3",
                 "debug.fail_mode=kill", "~debug.slow_rank", "debug.isolate_comm=true"]
    assert [o for o in overrides if kept_override(o)] == [
        "strategy=data", "trainer.steps=3", "debug.isolate_comm=true"]
    assert [o for o in overrides if kept_override(o, keep_debug=True)] == [
        "strategy=data", "trainer.steps=3", "debug.fail_mode=kill", "~debug.slow_rank",
        "debug.isolate_comm=true"]


def test_interpolations_in_run_files_are_refused(original: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRIDRUN_SECRET", "hunter2")
    source = tmp_path / "source"
    shutil.copytree(original, source)
    config = yaml.safe_load((source / "config.yaml").read_text())
    edit_config(source, model={**config["model"], "name": "${oc.env:GRIDRUN_SECRET}"})
    never = tmp_path / "never"
    assert main([str(source), "--run-dir", str(never)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: {source / 'config.yaml'}: model.name holds an interpolation "
                            "('${oc.env:GRIDRUN_SECRET}'); gridrun writes run files resolved, so "
                            "this one is not as gridrun wrote it: refused\n")
    assert "hunter2" not in captured.out + captured.err and not never.exists()

    shutil.copy(original / "config.yaml", source / "config.yaml")
    overrides = source / ".hydra" / "overrides.yaml"
    saved = yaml.safe_load(overrides.read_text())
    overrides.write_text(yaml.safe_dump([*saved, "+x=${oc.env:GRIDRUN_SECRET}"]))
    assert main([str(source), "--run-dir", str(never)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {overrides}: [{len(saved)}] holds an interpolation "
                          "('+x=${oc.env:GRIDRUN_SECRET}')") and err.count("\n") == 1
    assert not never.exists()


def test_the_launcher_flags_are_checked(original: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([str(original), "--trust-launcher", "--launcher-command", "srun"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        main([str(original), "--launcher-nproc-flag", "-np"])
    assert exit_.value.code == 2


def test_code_named_by_a_run_is_never_imported_without_trust(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A copied run whose config names `os.system` as its model, a dataset function and a
    plugin module of the working directory: refused before anything is imported, each named;
    nothing they would do is done."""
    marker = tmp_path / "ran"
    plugin = tmp_path / "evil_plugin_for_replay.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        source = tmp_path / "copied"
        shutil.copytree(original, source)
        edit_config(source, model={"_target_": "os.system", "command": f"touch {marker}"},
                    dataset={"_target_": "subprocess.getoutput", "cmd": f"touch {marker}"},
                    plugins=["evil_plugin_for_replay"])
        assert main([str(source), "--run-dir", str(tmp_path / "never")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {source / 'config.yaml'} names "
                                                       "code to import and call: ")
        for named in ("model._target_=os.system", "dataset._target_=subprocess.getoutput",
                      "plugins=['evil_plugin_for_replay']", "replay with --trust"):
            assert named in err, err
        assert not marker.exists() and "evil_plugin_for_replay" not in sys.modules
        assert not (tmp_path / "never").exists()
    finally:
        sys.path.remove(str(tmp_path))


def test_a_trusted_replay_imports_the_runs_own_code(tmp_path: Path) -> None:
    """With --trust a user model's run replays, after saying what it imports."""
    path = tmp_path / "user_model"
    assert_ok(run_cli(*RUN, "trainer.steps=3", "model._target_=tests.corpus_models.TupleOutput",
                      "dataset=synthetic", "dataset.shape=[3,8,8]", "dataset.classes=4",
                      f"hydra.run.dir={path}"))
    refused = replay(str(path), "--run-dir", str(tmp_path / "untrusted"))
    assert refused.returncode == 2 and "tests.corpus_models.TupleOutput" in refused.stderr
    result = replay(str(path), "--run-dir", str(tmp_path / "trusted"), "--trust")
    assert_ok(result)
    assert ("note: importing what the run names (--trust): "
            "model._target_=tests.corpus_models.TupleOutput") in result.stderr
    assert "identical: the 3 training losses" in result.stdout
