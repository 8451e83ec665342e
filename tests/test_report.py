"""`python -m runner.report`: figures and report.md for a run and for a sweep.

One real sweep per module (a 1-rank job, a 2-rank job, and a job the validator refuses), whose
job directories also serve as the run directories: each launch pays torch's start-up. A run's
files are data: their text is reported as written, no interpolation resolved.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from tests.conftest import assert_ok, read_summary, run_cli, run_module

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SECRET = "hunter2-not-for-reports"
RUN = ["strategy=data", "grid.pr=1", "trainer.steps=12", "trainer.eval_every=4",
       "trainer.batch_size=32"]


def report(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_module("runner.report", *args, timeout=120, env=env)


def assert_images(markdown: Path) -> list[Path]:
    """Every image report.md links is a real PNG beside it, and every PNG there is linked."""
    text = markdown.read_text()
    images = [markdown.parent / name for name in re.findall(r"^!\[[^\]]*\]\(([^)]+)\)$", text,
                                                            re.MULTILINE)]
    assert images
    assert sorted(images) == sorted(markdown.parent.glob("*.png"))
    for image in images:
        assert image.read_bytes()[:8] == PNG_SIGNATURE
        height, width = matplotlib.image.imread(image).shape[:2]
        assert width >= 800 and height >= 400
    return images


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "sweep"
    # 64 ranks for a global batch of 32: refused before anything starts, so it costs nothing
    result = run_cli("-m", *RUN, "grid.pc=1,2,64", f"hydra.sweep.dir={path}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "job 2 (" in result.stderr
    return path


def test_a_run_report_has_its_plots_and_numbers(sweep: Path, tmp_path: Path) -> None:
    run_dir = sweep / "1"  # the 2-rank job
    result = report(str(run_dir))
    assert_ok(result)
    markdown = run_dir / "report" / "report.md"
    images = assert_images(markdown)
    assert {p.name for p in images} == {"loss.png", "accuracy.png", "communication.png"}
    assert all(str(path) in result.stdout for path in [markdown, *images])
    text = markdown.read_text()
    s = read_summary(run_dir)
    assert "# Run report: data · grid 1×2 · sgd" in text
    assert f"| final training loss | {s['final_loss']:.4f} |" in text
    assert f"| validation accuracy | {s['val_accuracy']:.4f} |" in text
    assert f"| median step time | {s['median_step_time_s'] * 1e3:.3f} ms |" in text
    bytes_row = (f"| bytes | {s['comm_bytes_per_step']:,.0f} | "
                 f"{s['predicted_comm_bytes_per_step']:,.0f} | 1.00 |")
    assert bytes_row in text  # every byte predicted
    time_ratio = s["comm_time_s_per_step"] / s["predicted_comm_time_s_per_step"]
    assert (f"| time | {s['comm_time_s_per_step'] * 1e3:.3f} ms | "
            f"{s['predicted_comm_time_s_per_step'] * 1e3:.3f} ms | {time_ratio:.2f} |") in text
    # --out elsewhere writes the same files there and leaves the run directory alone
    assert_ok(report(str(run_dir), "--out", str(tmp_path / "elsewhere")))
    assert {p.name for p in assert_images(tmp_path / "elsewhere" / "report.md")} == {
        p.name for p in images}


def test_a_run_still_going_is_reported(sweep: Path, tmp_path: Path) -> None:
    """No summary yet, and the last metrics line cut short by the writer."""
    going = tmp_path / "going"
    going.mkdir()
    shutil.copy(sweep / "1" / "config.yaml", going)
    lines = (sweep / "1" / "metrics.jsonl").read_text().splitlines()
    (going / "metrics.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])
    assert_ok(report(str(going), "--out", str(tmp_path / "out")))
    text = (tmp_path / "out" / "report.md").read_text()
    assert {p.name for p in assert_images(tmp_path / "out" / "report.md")} == {
        "loss.png", "accuracy.png", "communication.png"}
    last = json.loads(lines[5])
    assert "| status | in progress or interrupted |" in text
    assert f"| steps | {last['step']} logged of 12 |" in text
    assert f"| final training loss | {last['loss']:.4f} |" in text
    assert "last line of metrics.jsonl is incomplete" in text


def test_a_run_without_validation_or_prediction_is_reported(sweep: Path, tmp_path: Path) -> None:
    """An asynchronous optimizer's summary has no prediction; eval_every=null logs no val lines
    (until the last step: here they are all dropped)."""
    run_dir = tmp_path / "run"
    shutil.copytree(sweep / "1", run_dir, ignore=shutil.ignore_patterns("report"))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(x for x in lines if '"split"' not in x))
    summary = read_summary(run_dir)
    summary.update(predicted_comm_bytes_per_step=None, predicted_comm_time_s_per_step=None,
                   val_loss=None, val_accuracy=None)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert_ok(report(str(run_dir)))
    text = (run_dir / "report" / "report.md").read_text()
    assert {p.name for p in assert_images(run_dir / "report" / "report.md")} == {
        "loss.png", "communication.png"}
    assert f"| bytes | {summary['comm_bytes_per_step']:,.0f} | — | — |" in text
    assert "No validation lines" in text and "| validation accuracy | — |" in text


def test_a_sweep_report_has_one_line_per_job_and_lists_the_failed_one(sweep: Path) -> None:
    result = report(str(sweep))
    assert_ok(result)
    markdown = sweep / "report" / "report.md"
    assert {p.name for p in assert_images(markdown)} == {"sweep_curves.png", "sweep_times.png"}
    text = markdown.read_text()
    rows = [line for line in text.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [row.split(" | ")[1:3] for row in rows] == [
        ["grid.pc=1", "completed"], ["grid.pc=2", "completed"], ["grid.pc=64", "failed"]]
    error = list(csv.DictReader((sweep / "sweep_summary.csv").open()))[2]["error"]
    assert error and rows[2].endswith(f"| {error} |")
    for job in (0, 1):
        assert f"| {read_summary(sweep / str(job))['final_loss']:.4f} |" in rows[job]
    assert "Not plotted (failed, or nothing logged): job 2." in text
    assert "Overrides every job shares: `strategy=data grid.pr=1 trainer.steps=12" in text


def test_the_sweep_figure_has_a_legend_entry_per_plotted_job(sweep: Path) -> None:
    from runner.report.data import load_sweep
    from runner.report.plots import sweep_curves_figure

    figure = sweep_curves_figure(load_sweep(sweep).jobs)
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["0: grid.pc=1", "1: grid.pc=2"]
    by_step = figure.axes[0]
    assert [len(line.get_xdata()) for line in by_step.get_lines()] == [12, 12]


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    result = report(str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr == f"error: {tmp_path / 'missing'}: no such directory\n"
    (tmp_path / "empty").mkdir()
    result = report(str(tmp_path / "empty"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {tmp_path / 'empty'} is neither a run directory")
    assert not (tmp_path / "empty" / "report").exists()


def test_metrics_json_is_what_the_report_reads(sweep: Path) -> None:
    """The report's inputs are the contract's keys: a renamed key must break this test."""
    lines = [json.loads(x) for x in (sweep / "1" / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "time_s", "loss", "step_time_s", "comm_time_s", "comm_bytes"} <= set(lines[0])
    assert {"step", "split", "time_s", "loss", "accuracy"} <= set(lines[4])


def test_a_run_s_text_is_reported_as_written(sweep: Path, tmp_path: Path) -> None:
    """An interpolation in config.yaml is shown, not resolved (the secret stays in the
    environment), and a name that reads as mathtext is drawn as text, not typeset."""
    run_dir = tmp_path / "run"
    shutil.copytree(sweep / "1", run_dir, ignore=shutil.ignore_patterns("report"))
    (run_dir / "summary.json").unlink()  # the names and steps then come from config.yaml
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["strategy"]["name"] = "$\\foo{$"  # an unknown TeX command: a parse error if typeset
    config["trainer"]["steps"] = "${oc.env:GRIDRUN_SECRET}"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    result = report(str(run_dir), env={"GRIDRUN_SECRET": SECRET})
    assert_ok(result)
    text = (run_dir / "report" / "report.md").read_text()
    assert SECRET not in text + result.stdout + result.stderr
    assert "| steps | 12 logged of ${oc.env:GRIDRUN_SECRET} |" in text
    assert "# Run report: $\\foo{$ · grid 1×2 · sgd" in text
    assert {p.name for p in assert_images(run_dir / "report" / "report.md")} == {
        "loss.png", "accuracy.png", "communication.png"}


def test_a_sweep_s_overrides_are_reported_as_written(sweep: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.report import write_report

    monkeypatch.setenv("GRIDRUN_SECRET", SECRET)
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("report"))
    overrides = copy / "0" / ".hydra" / "overrides.yaml"
    saved = yaml.safe_load(overrides.read_text())
    overrides.write_text(yaml.safe_dump([*saved, "+note=${oc.env:GRIDRUN_SECRET}"]))
    markdown, *_ = write_report(copy)
    text = markdown.read_text()
    assert SECRET not in text
    assert re.search(r"^\| 0 \| grid\.pc=1 \+note=\$\{oc\.env:GRIDRUN_SECRET\} \| completed \|",
                     text, re.MULTILINE), text
