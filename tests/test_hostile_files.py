"""Run directories are data: files made to break a reader never crash `runner.report` or
`runner.replay`.

Beyond the readers' bounds (a file over its size limit, a line nested deeper than 32 levels, an
integer of more than 100 digits) a file is refused in one line naming it and its line, exit 2;
the replay refuses before it trains. Within the bounds, a number that is not finite or absurd
(or text where a number belongs) is left out of the report's figures and numbers, and said so;
text and override lists of any size neither stall the figures nor name impossible paths.
The report's files are written by hand (it only reads them); the replay's come from one real
1-rank run per module.

Nothing of a run directory runs as code or reaches a terminal raw: Hydra's rerun of a pickled
config is refused before the pickle is read; a YAML tag is refused by file, line and tag, and an
interpolation (a secret from the environment, a bomb, a self-reference) by key, never resolved;
control characters and bidi overrides from any file are printed as visible escapes, and rich
markup in a file's text is printed as written.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.replay import main as replay_main
from runner.report.__main__ import main as report_main
from tests.conftest import ROOT, assert_ok, run_cli, run_module

TRAIN = {"step": 1, "time_s": 0.25, "loss": 2.5, "lr": 0.1, "step_time_s": 0.25,
         "comm_time_s": 0.05, "comm_bytes": 1024, "comm_share": 0.2, "samples_per_s": 128.0}
VAL = {"step": 1, "split": "val", "time_s": 0.25, "loss": 2.4, "accuracy": 0.5}
SUMMARY = {"status": "completed", "strategy": "data", "optimizer": "sgd",
           "grid": {"pr": 1, "pc": 1}, "world_size": 1, "steps": 2, "final_loss": 2.25,
           "val_loss": 2.2, "val_accuracy": 0.5, "wall_time_s": 1.5, "median_step_time_s": 0.25,
           "comm_bytes_per_step": 1024, "predicted_comm_bytes_per_step": 1024,
           "comm_time_s_per_step": 0.05, "predicted_comm_time_s_per_step": 0.05,
           "comm_time_share": 0.2}
DEEP_LIST = "[" * 50_000 + "]" * 50_000
DEEP_OBJECT = '{"a":' * 50_000 + "1" + "}" * 50_000
LONG_INTEGER = '{"step": 2, "loss": ' + "7" * 5_001 + "}"


def metrics_lines(second: str | None = None) -> list[str]:
    """Two training steps and their validation lines; `second` replaces line 2."""
    lines = [json.dumps(TRAIN), json.dumps(VAL), json.dumps({**TRAIN, "step": 2}),
             json.dumps({**VAL, "step": 2})]
    if second is not None:
        lines[1] = second
    return lines


def run_dir(path: Path, second: str | None = None) -> Path:
    """A run directory as gridrun writes one, with line 2 of its metrics.jsonl replaced."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("\n".join(metrics_lines(second)) + "\n")
    (path / "summary.json").write_text(json.dumps(SUMMARY))
    (path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"steps": 2}}))
    return path


def refused(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    """The one line of a refusal (exit 2, no traceback)."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err.removeprefix("error: ").rstrip("\n")


# runner.report


@pytest.mark.parametrize("line", [DEEP_LIST, DEEP_OBJECT], ids=["list", "object"])
def test_a_metrics_line_nested_50000_deep_is_refused_by_line(
        line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path / "run", line)
    err = refused(capsys, report_main([str(run)]))
    assert err == f"{run / 'metrics.jsonl'}:2: nested deeper than 32 levels: refused"
    assert not (run / "report").exists()


def test_an_integer_of_5001_digits_is_refused_by_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path / "run", LONG_INTEGER)
    err = refused(capsys, report_main([str(run)]))
    assert err == (f"{run / 'metrics.jsonl'}:2: an integer of 5,001 digits (at most 100 are "
                   "read): refused")


@pytest.mark.parametrize("value", ["1e308", "-1e308", "Infinity", "NaN", '"high"', "[1]"])
def test_values_that_are_no_usable_number_are_left_out_and_said_so(
        value: str, tmp_path: Path) -> None:
    """Every number of a training line, a validation line and summary.json set to `value`:
    the report is written, those values are plotted nowhere, and a note names the first."""
    train = json.dumps({k: "X" if k != "step" else 2 for k in TRAIN}).replace('"X"', value)
    val = json.dumps({**{k: "X" for k in VAL}, "step": 2, "split": "val"}).replace('"X"', value)
    run = tmp_path / "run"
    run.mkdir()
    lines = metrics_lines()
    (run / "metrics.jsonl").write_text("\n".join([*lines[:2], train, val]) + "\n")
    summary = json.dumps({k: "X" if isinstance(v, (int, float)) else v
                          for k, v in SUMMARY.items()})
    (run / "summary.json").write_text(summary.replace('"X"', value))
    assert report_main([str(run)]) == 0
    text = (run / "report" / "report.md").read_text()
    assert {p.name for p in (run / "report").glob("*.png")} == {
        "loss.png", "accuracy.png", "communication.png"}
    assert (f"- 11 value(s) in metrics.jsonl are no finite number of a usable size: left out "
            f"(first: line 3, time_s={json.loads(train)['time_s']!r})") in text


def test_a_summary_nested_100000_deep_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path / "run")
    (run / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    err = refused(capsys, report_main([str(run)]))
    assert err == f"{run / 'summary.json'}:1: nested deeper than 32 levels: refused"


def test_an_integer_of_5001_digits_in_summary_json_is_refused_by_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path / "run")
    summary = json.dumps({**SUMMARY, "note": "9" * 200, "steps": 0}, indent=2)
    (run / "summary.json").write_text(summary.replace('"steps": 0', '"steps": ' + "9" * 5_001))
    line = summary.splitlines().index('  "steps": 0,') + 1
    err = refused(capsys, report_main([str(run)]))
    assert err == (f"{run / 'summary.json'}:{line}: an integer of 5,001 digits (at most 100 are "
                   "read): refused")


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "- " * 100_000 + "x"],
                         ids=["flow", "block"])
def test_a_config_yaml_nested_100000_deep_is_refused(
        text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path / "run")
    (run / "config.yaml").write_text(text)
    err = refused(capsys, report_main([str(run)]))
    assert err == f"{run / 'config.yaml'}:1: nested deeper than 32 levels: refused"


def test_a_config_yaml_whose_aliases_multiply_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ten aliases of ten aliases, six times over: a million values in 200 bytes."""
    run = run_dir(tmp_path / "run")
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 10)}]" for k in range(1, 6)]
    (run / "config.yaml").write_text("\n".join(lines) + "\n")
    err = refused(capsys, report_main([str(run)]))
    assert err == (f"{run / 'config.yaml'}: more than 100,000 values (an alias counted each "
                   "time it is used): refused")


def sweep_dir(path: Path, error: str) -> Path:
    """A sweep of two jobs, job 1 failed with `error`."""
    path.mkdir(parents=True)
    with (path / "sweep_summary.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job", "overrides", "status", "run_dir", "error"])
        writer.writerow([0, "grid.pc=1", "completed", "", ""])
        writer.writerow([1, "grid.pc=2", "failed", "", error])
    run_dir(path / "0")
    (path / "0" / ".hydra").mkdir()
    (path / "0" / ".hydra" / "overrides.yaml").write_text("- grid.pc=1\n")
    return path


def test_a_sweep_csv_field_of_200_kB_is_read(tmp_path: Path) -> None:
    limit = csv.field_size_limit()
    sweep = sweep_dir(tmp_path / "sweep", "x" * 200_000)
    assert report_main([str(sweep)]) == 0
    rows = [line for line in (sweep / "report" / "report.md").read_text().splitlines()
            if line.startswith("| 1 |")]
    assert len(rows) == 1 and rows[0].endswith(f"| {'x' * 200_000} |")
    assert csv.field_size_limit() == limit  # csv's limit is the process's: given back


def test_sweep_rows_naming_no_possible_directory_are_reported(tmp_path: Path) -> None:
    """A job number of 300 digits and a run_dir of 5000 characters name no directory any file
    system takes (asking one raised 'File name too long'): those jobs have no run."""
    sweep = sweep_dir(tmp_path / "sweep", "")
    with (sweep / "sweep_summary.csv").open("a", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["9" * 300, "a=1", "completed", "", ""])
        writer.writerow([2, "a=2", "completed", "/x" * 2500, ""])
    assert report_main([str(sweep)]) == 0
    text = (sweep / "report" / "report.md").read_text()
    assert f"| {'9' * 300} | a=1 | completed | — |" in text
    assert "| 2 | a=2 | completed | — |" in text


def test_overrides_shared_by_jobs_are_found_in_linear_time(tmp_path: Path) -> None:
    """Two jobs of 50,000 overrides each: comparing them pairwise took minutes."""
    from runner.report.data import Job, varying_overrides

    overrides = [f"+k{i}=v" for i in range(50_000)]
    jobs = [Job(0, [*overrides, "a=1"], "completed", None, None),
            Job(1, [*overrides, "a=2"], "completed", None, None)]
    start = time.perf_counter()
    common, labels = varying_overrides(jobs)
    assert time.perf_counter() - start < 5.0
    assert common == overrides and labels == {0: "a=1", 1: "a=2"}


def test_overrides_yaml_nested_deep_in_a_sweep_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = sweep_dir(tmp_path / "sweep", "")
    overrides = sweep / "0" / ".hydra" / "overrides.yaml"
    overrides.write_text("- " * 100_000 + "x")
    err = refused(capsys, report_main([str(sweep)]))
    assert err == f"{overrides}:1: nested deeper than 32 levels: refused"


def test_a_file_over_its_size_limit_is_refused_unread(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Sparse files: their size is real, their blocks cost nothing."""
    run = run_dir(tmp_path / "run")
    with (run / "metrics.jsonl").open("ab") as f:
        f.truncate(300 * 2**20)
    err = refused(capsys, report_main([str(run)]))
    assert err == (f"{run / 'metrics.jsonl'}: 300.0 MiB, more than the 256.0 MiB read from a "
                   "metrics.jsonl: refused")
    (run / "metrics.jsonl").write_text("\n".join(metrics_lines()) + "\n")
    with (run / "summary.json").open("ab") as f:
        f.truncate(5 * 2**20)
    err = refused(capsys, report_main([str(run)]))
    assert err == (f"{run / 'summary.json'}: 5.0 MiB, more than the 4.0 MiB read from a "
                   "summary.json: refused")


def test_a_run_file_is_read_only_from_inside_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A link in the run directory, to a file or through a folder outside, is not read: what
    lies outside (a secret standing for ~/.ssh/...) never reaches the report or its output."""
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "summary.json"
    secret.write_text(json.dumps({**SUMMARY, "status": "SECRET-VALUE"}))
    run = run_dir(tmp_path / "run")
    (run / "summary.json").unlink()
    (run / "summary.json").symlink_to(secret)
    err = refused(capsys, report_main([str(run)]))
    assert err == (f"{run / 'summary.json'}: a symbolic link (a run's files are read only from "
                   f"inside it): refused")
    assert "SECRET" not in err and not (run / "report").exists()
    sweep = sweep_dir(tmp_path / "sweep", "")
    hydra = sweep / "0" / ".hydra"
    shutil.move(hydra, outside / ".hydra")
    hydra.symlink_to(outside / ".hydra")
    err = refused(capsys, report_main([str(sweep)]))
    assert err.startswith(f"{hydra / 'overrides.yaml'}: "), err
    assert f"{hydra}" in err and "symbolic link" in err


def test_a_metrics_line_over_1_mib_is_refused_by_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path / "run", json.dumps({"step": 2, "note": "x" * 2**20}))
    err = refused(capsys, report_main([str(run)]))
    assert err == f"{run / 'metrics.jsonl'}:2: a line of more than 1.0 MiB: refused"


def test_text_from_a_run_is_shortened_in_figures(tmp_path: Path) -> None:
    """A strategy name of a megabyte took minutes to lay out as a figure title; report.md
    keeps it whole."""
    from runner.report.data import load_run
    from runner.report.plots import loss_figure

    run = run_dir(tmp_path / "run")
    (run / "summary.json").write_text(json.dumps({**SUMMARY, "strategy": "s" * 2**20}))
    figure = loss_figure(load_run(run))
    title = figure.get_suptitle()
    assert len(title) <= 120 and title.startswith("Loss: sss") and title.endswith("…")


def test_the_command_line_refuses_in_one_line(tmp_path: Path) -> None:
    run = run_dir(tmp_path / "run", DEEP_LIST)
    result = subprocess.run([sys.executable, "-m", "runner.report", str(run)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == (f"error: {run / 'metrics.jsonl'}:2: nested deeper than 32 levels: "
                             "refused\n")


# runner.replay


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "original"
    assert_ok(run_cli("strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=3",
                      "trainer.eval_every=null", "trainer.batch_size=16",
                      f"hydra.run.dir={path}"))
    return path


def copied(original: Path, path: Path) -> Path:
    shutil.copytree(original, path)
    return path


def with_line_2(run: Path, line: str) -> Path:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = line
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run / "metrics.jsonl"


@pytest.mark.parametrize(("line", "why"), [
    (DEEP_LIST, "nested deeper than 32 levels"),
    (DEEP_OBJECT, "nested deeper than 32 levels"),
    (LONG_INTEGER, "an integer of 5,001 digits (at most 100 are read)"),
], ids=["list", "object", "integer"])
def test_the_replay_refuses_a_hostile_metrics_line_before_it_trains(
        line: str, why: str, original: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    source = copied(original, tmp_path / "source")
    metrics = with_line_2(source, line)
    again = tmp_path / "again"
    err = refused(capsys, replay_main([str(source), "--run-dir", str(again)]))
    assert err == f"{metrics}:2: {why}: refused"
    assert not again.exists()  # nothing trained


def test_the_replay_refuses_an_oversized_metrics_file_before_it_trains(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = copied(original, tmp_path / "source")
    with (source / "metrics.jsonl").open("ab") as f:
        f.truncate(300 * 2**20)
    again = tmp_path / "again"
    err = refused(capsys, replay_main([str(source), "--run-dir", str(again)]))
    assert err.startswith(f"{source / 'metrics.jsonl'}: 300.0 MiB, more than the 256.0 MiB")
    assert not again.exists()


@pytest.mark.parametrize("name", ["config.yaml", ".hydra/overrides.yaml"])
def test_the_replay_refuses_yaml_nested_100000_deep(
        name: str, original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = copied(original, tmp_path / "source")
    (source / name).write_text("[" * 100_000 + "]" * 100_000)
    err = refused(capsys, replay_main([str(source), "--run-dir", str(tmp_path / "again")]))
    assert err == f"{source / name}:1: nested deeper than 32 levels: refused"


def test_the_replay_command_line_refuses_before_training(original: Path, tmp_path: Path) -> None:
    source = copied(original, tmp_path / "source")
    metrics = with_line_2(source, DEEP_OBJECT)
    again = tmp_path / "again"
    result = subprocess.run([sys.executable, "-m", "runner.replay", str(source), "--run-dir",
                             str(again)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == f"error: {metrics}:2: nested deeper than 32 levels: refused\n"
    assert result.stdout == "" and not again.exists()


def code_config(source: Path, plugins: list[str]) -> None:
    config = yaml.safe_load((source / "config.yaml").read_text())
    config["model"] = {"_target_": "no_such_models.Net"}
    config["optimizer"] = {**config["optimizer"], "_target_": "torch.optim.Adam"}
    config["plugins"] = plugins
    (source / "config.yaml").write_text(yaml.safe_dump(config))


def test_the_refusal_without_trust_says_what_was_checked_and_what_was_not_imported(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = copied(original, tmp_path / "source")
    code_config(source, ["no_such_plugin_a", "no_such_plugin_b"])
    err = refused(capsys, replay_main([str(source), "--run-dir", str(tmp_path / "again")]))
    assert ("checked without importing anything: config.yaml, .hydra/overrides.yaml, "
            "metrics.jsonl (read as data, nothing resolved)") in err
    assert ("not imported, so neither validated nor run: no_such_models.Net, torch.optim.Adam, "
            "no_such_plugin_a, no_such_plugin_b") in err
    assert "no_such_plugin_a" not in sys.modules


def test_trust_names_each_import_on_its_own_line_before_anything_runs(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin that cannot be imported stops the trusted replay in its validation: the lines
    that name what it imports come before that."""
    source = copied(original, tmp_path / "source")
    code_config(source, ["no_such_plugin_a", "no_such_plugin_b"])
    again = tmp_path / "again"
    rc = replay_main([str(source), "--run-dir", str(again), "--trust"])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and not again.exists()
    prefix = "note: importing what the run names (--trust): "
    assert err[:4] == [f"{prefix}model._target_=no_such_models.Net",
                       f"{prefix}optimizer._target_=torch.optim.Adam",
                       f"{prefix}plugins[0]=no_such_plugin_a",
                       f"{prefix}plugins[1]=no_such_plugin_b"]
    assert err[-1].startswith("error: ") and "no_such_plugin_a" in err[-1]


# A run directory's text is data: no pickle loaded, no tag constructed, no interpolation
# resolved, nothing printed raw

SECRET = "31337"  # digits: the seed it would be resolved into is an integer
NASTY = "\x1b[2J\x1b]0;pwned\x07\rfake\u202eevil"  # clear screen, window title, CR, bidi
RAW = ("\x1b", "\x07", "\r", "\u202e")
SHOWN = ("\\x1b[2J", "\\x1b]0;pwned\\x07", "\\rfake", "\\u202eevil")


def payload(marker: Path) -> bytes:
    """A pickle that makes the directory `marker` when it is loaded."""

    class Payload:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return os.mkdir, (str(marker),)

    return pickle.dumps(Payload())


def assert_escaped(text: str) -> None:
    assert not any(raw in text for raw in RAW), ascii(text)
    assert all(shown in text for shown in SHOWN), text


def test_hydra_s_rerun_of_a_pickled_config_is_refused_unloaded(tmp_path: Path) -> None:
    """`--experimental-rerun RUN/.hydra/config.pickle` (Hydra's flag, as written, with `=`,
    or abbreviated as argparse takes it) unpickled a payload: refused before it is read, by
    the runner and by the planner."""
    marker = tmp_path / "payload-ran"
    pickled = tmp_path / "run" / ".hydra" / "config.pickle"
    pickled.parent.mkdir(parents=True)
    pickled.write_bytes(payload(marker))
    for module, args in [("runner", ["--experimental-rerun", str(pickled)]),
                         ("runner", [f"--experimental-rerun={pickled}", "trainer.steps=1"]),
                         ("runner", ["--exp", str(pickled)]),
                         ("runner.plan", ["--experimental-rerun", str(pickled)])]:
        result = run_module(module, *args, timeout=120)
        flag = args[0].partition("=")[0]
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr == (f"error: {flag}: Hydra's rerun from a pickled config: refused "
                                 "(unpickling a file runs any code it names; python -m "
                                 "runner.replay RUN_DIR runs a run again from its "
                                 "config.yaml)\n")
        assert not marker.exists()
    pickle.loads(pickled.read_bytes())  # the payload is live: loaded, it runs
    assert marker.is_dir()


@pytest.fixture(scope="module")
def resumable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A completed 1-rank run with a checkpoint, and the overrides that continue it."""
    path = tmp_path_factory.mktemp("hostile") / "resumable"
    overrides = ["strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=2",
                 "trainer.eval_every=null", "trainer.batch_size=16", "trainer.checkpoint_every=2"]
    assert_ok(run_cli(*overrides, f"hydra.run.dir={path}"))
    return path, [o if o != "trainer.steps=2" else "trainer.steps=4" for o in overrides]


BOMB = {"seed": "${b40}", "b0": "x", **{f"b{i}": f"${{b{i - 1}}}${{b{i - 1}}}" for i in
                                        range(1, 41)}}  # 2**40 characters, resolved


@pytest.mark.parametrize(("values", "construct"), [
    ({"seed": "${oc.env:GRIDRUN_SECRET}"}, "seed holds an interpolation "
                                           "('${oc.env:GRIDRUN_SECRET}')"),
    ({"seed": "${oc.decode:${oc.env:GRIDRUN_SECRET}}"}, "seed holds an interpolation "
                                                        "('${oc.decode:${oc.env:GRIDRUN_SECRET}}')"),
    (BOMB, "seed holds an interpolation ('${b40}')"),
    ({"seed": "${seed}"}, "seed holds an interpolation ('${seed}')"),
], ids=["secret", "nested-resolvers", "bomb", "self-reference"])
def test_a_resume_refuses_an_interpolation_in_the_earlier_config_unresolved(
        values: dict[str, str], construct: str, resumable: tuple[Path, list[str]],
        tmp_path: Path) -> None:
    """The earlier run's config.yaml, compared with the resumed one's, was resolved: the
    secret printed as the seed that changed, the bomb resolved for minutes."""
    original, overrides = resumable
    run = copied(original, tmp_path / "run")
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, **values}, sort_keys=False))
    started = time.monotonic()
    result = run_cli(*overrides, "trainer.resume=auto", f"hydra.run.dir={run}",
                     env={"GRIDRUN_SECRET": SECRET}, timeout=120)
    assert time.monotonic() - started < 30  # loose: the bomb is never resolved
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(f"error: hydra.run.dir={run} holds an earlier run")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"its config.yaml cannot be read: {run / 'config.yaml'}: {construct}" in result.stderr
    assert SECRET not in result.stdout + result.stderr


TAGS = ["!!python/object/apply:os.mkdir [MARKER]", "!!python/name:os.system", "!mine 3"]


@pytest.mark.parametrize("tagged", TAGS, ids=["apply", "name", "custom"])
def test_a_yaml_tag_is_refused_by_name_and_line_everywhere(
        tagged: str, resumable: tuple[Path, list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A tag in config.yaml ended the resume in a traceback; the replay and the report refuse
    it as well, naming the file, its line and the tag; nothing is constructed."""
    original, overrides = resumable
    run = copied(original, tmp_path / "run")
    marker = tmp_path / "constructed"
    lines = (run / "config.yaml").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.startswith("seed:"))
    lines[line - 1] = f"seed: {tagged.replace('MARKER', str(marker))}"
    (run / "config.yaml").write_text("\n".join(lines) + "\n")
    tag = tagged.split()[0]
    why = (f"{run / 'config.yaml'}:{line}: a YAML tag '{tag}' (a run's files are data: no tag "
           "is constructed): refused")
    result = run_cli(*overrides, "trainer.resume=auto", f"hydra.run.dir={run}", timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    # the resume's refusal quotes the reader's first 200 characters
    assert f"cannot be read: {why[:why.index(' (a run')]}" in result.stderr
    assert refused(capsys, replay_main([str(run), "--run-dir", str(tmp_path / "again")])) == why
    assert refused(capsys, report_main([str(run)])) == why
    assert not marker.exists() and not (tmp_path / "again").exists()


def test_the_replay_and_the_report_never_resolve_an_interpolation_bomb(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The replay refuses it by key; the report shows the text as written."""
    run = copied(original, tmp_path / "run")
    (run / "summary.json").unlink()  # the report then names the strategy from config.yaml
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["strategy"]["name"] = "${b40}"
    (run / "config.yaml").write_text(yaml.safe_dump({**config, **BOMB}, sort_keys=False))
    started = time.monotonic()
    err = refused(capsys, replay_main([str(run), "--run-dir", str(tmp_path / "again")]))
    assert err.startswith(f"{run / 'config.yaml'}: seed holds an interpolation ('${{b40}}')")
    assert report_main([str(run)]) == 0
    assert time.monotonic() - started < 30
    assert "# Run report: ${b40} · grid 1×1 · sgd" in (run / "report" / "report.md").read_text()


def test_a_dollar_that_opens_no_interpolation_is_text_and_the_run_replays(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`$5`, `$HOME` and an escaped `\\${x}` are no interpolation to OmegaConf: a config
    holding them replays, its losses identical; `\\\\${x}` (an escaped backslash, then an
    interpolation) is refused."""
    run = copied(original, tmp_path / "run")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["launcher"]["args"] = ["$5", "$HOME", "a\\${x}", "$"]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert replay_main([str(run), "--run-dir", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert "identical: the 3 training losses" in out
    config["launcher"]["args"] = ["a\\\\${x}"]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    err = refused(capsys, replay_main([str(run), "--run-dir", str(tmp_path / "never")]))
    assert err.startswith(f"{run / 'config.yaml'}: launcher.args[0] holds an interpolation")


def test_text_from_a_run_s_files_reaches_the_terminal_escaped(tmp_path: Path) -> None:
    """An error in summary.json, a name in config.yaml, a metrics value and the directory's own
    name holding a screen clear, a window title, a carriage return and a bidi override: the
    report's output and report.md show each as a visible escape, never the raw bytes."""
    run = run_dir(tmp_path / f"run{NASTY}", json.dumps({**TRAIN, "step": 2, "loss": NASTY}))
    summary = {**SUMMARY, "status": "failed", "failed_rank": 0, "error": NASTY,
               "strategy": f"data{NASTY}"}
    (run / "summary.json").write_text(json.dumps(summary))
    result = subprocess.run([sys.executable, "-m", "runner.report", str(run)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert_ok(result)
    assert_escaped(result.stdout)
    text = (run / "report" / "report.md").read_text()
    assert_escaped(text)
    assert f"| status | failed on rank 0: {SHOWN[0]}" in text


def test_a_sweep_s_text_reaches_report_md_escaped(tmp_path: Path) -> None:
    sweep = sweep_dir(tmp_path / "sweep", NASTY)
    with (sweep / "sweep_summary.csv").open("a", newline="") as f:
        csv.writer(f).writerow([2, f"a={NASTY}", "completed", "", ""])
    assert report_main([str(sweep)]) == 0
    assert_escaped((sweep / "report" / "report.md").read_text())


def test_the_replay_s_error_quoting_a_run_s_name_is_one_escaped_line(
        original: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = copied(original, tmp_path / "run")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["strategy"]["name"] = f"data{NASTY}\nerror: a second line"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    err = refused(capsys, replay_main([str(run), "--run-dir", str(tmp_path / "again")]))
    assert_escaped(err)
    assert "\\nerror: a second line" in err


def test_the_result_table_shows_a_run_s_text_escaped_and_markup_literally(
        tmp_path: Path) -> None:
    """A real run whose directory's name holds rich markup (an unmatched closing tag made rich
    raise) and terminal escapes: the result table shows the name as written, escaped."""
    from runner.checkpoint.resume import hydra_quoted

    run = tmp_path / f"r[bold]x[/red]{NASTY}"
    result = run_cli("strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=1",
                     "trainer.eval_every=null", "trainer.batch_size=16",
                     f"hydra.run.dir={hydra_quoted(str(run))}")
    assert_ok(result)
    row = next(line for line in result.stdout.splitlines() if "run dir" in line)
    assert_escaped(row)
    assert "r[bold]x[/red]" in row


def test_summary_table_and_print_error_escape_what_they_are_given(
        capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from runner.records.console import print_error, printable, summary_table

    out = io.StringIO()
    console = Console(file=out, width=400, force_terminal=False)
    console.print(summary_table({**SUMMARY, "strategy": f"[/bold]{NASTY}",
                                 "optimizer": "[red]sgd[/red]"}))
    shown = out.getvalue()
    assert_escaped(shown)
    assert "[/bold]" in shown and "[red]sgd[/red]" in shown
    print_error(f"a{NASTY}\nb")
    assert capsys.readouterr().err == f"error: a{''.join(SHOWN)}\\nb\n"
    assert printable("a\nb\x9b\u2066\t", newlines=True) == "a\nb\\x9b\\u2066\\t"
