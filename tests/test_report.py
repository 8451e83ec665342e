"""`python -m runner.report`: figures and report.md for a run and for a sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from tests.conftest import ROOT, assert_ok, read_summary, run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RUN = ["strategy=data", "grid.pr=1", "trainer.steps=12", "trainer.eval_every=4",
       "trainer.batch_size=32"]


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.report", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def assert_images(markdown: Path) -> list[Path]:
    """Every image report.md links is a real PNG beside it; returns them."""
    text = markdown.read_text()
    images = [markdown.parent / line.split("](")[1].rstrip(")")
              for line in text.splitlines() if line.startswith("![")]
    assert images
    for image in images:
        assert image.read_bytes()[:8] == PNG_SIGNATURE
        height, width = matplotlib.image.imread(image).shape[:2]
        assert width >= 400 and height >= 200
    return images


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("report") / "run"
    assert_ok(run_cli(*RUN, "grid.pc=2", f"hydra.run.dir={path}"))
    return path


def test_a_run_report_has_its_plots_and_numbers(run_dir: Path) -> None:
    result = report(str(run_dir))
    assert_ok(result)
    markdown = run_dir / "report" / "report.md"
    images = assert_images(markdown)
    assert {p.name for p in images} == {"loss.png", "accuracy.png", "communication.png"}
    text = markdown.read_text()
    summary = read_summary(run_dir)
    assert f"{summary['final_loss']:.4f}" in text and f"{summary['val_accuracy']:.4f}" in text
    assert f"{summary['predicted_comm_bytes_per_step']:,.0f}" in text


def test_a_run_still_going_is_reported(run_dir: Path, tmp_path: Path) -> None:
    """No summary yet, and the last metrics line cut short by the writer."""
    going = tmp_path / "going"
    going.mkdir()
    (going / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (going / "metrics.jsonl").write_text("\n".join(lines[:6]) + "\n" + lines[6][:20])
    assert_ok(report(str(going), "--out", str(tmp_path / "out")))
    assert_images(tmp_path / "out" / "report.md")


def test_a_sweep_report_has_one_line_per_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    assert_ok(run_cli("-m", *RUN, "grid.pc=1,2", f"hydra.sweep.dir={sweep}"))
    result = report(str(sweep))
    assert_ok(result)
    markdown = sweep / "report" / "report.md"
    images = assert_images(markdown)
    assert len(images) >= 2  # the curves, and the bars of step time against the prediction
    text = markdown.read_text()
    for job in ("grid.pc=1", "grid.pc=2"):
        assert job in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "grid.pc=" in line]
    assert len(rows) >= 2


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    result = report(str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    (tmp_path / "empty").mkdir()
    result = report(str(tmp_path / "empty"))
    assert result.returncode == 2 and "neither a run directory" in result.stderr


def test_metrics_json_is_what_the_report_reads(run_dir: Path) -> None:
    """The report's inputs are the contract's keys: a renamed key must break this test."""
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert {"step", "time_s", "loss", "step_time_s", "comm_time_s"} <= set(first)
