"""Nothing in a run directory makes gridrun write outside it.

A symbolic link planted where gridrun writes (a file, a folder, the lock, the report, the
replays, a sweep's job or table) points at a file or folder outside the run; each tool is run
on the directory and must leave the outside byte for byte as it was, refuse in one line naming
the link, exit 2, and print no traceback. A FIFO where the metrics go ends a resume at once.
The command-line cases share one real 2-rank run with checkpoints (copied per case); the
writers the ranks use are also tried directly, for a link put in place after the head looked.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from runner.records import safe_paths
from runner.records.logs import setup_rank_logging
from runner.records.rundir import MetricsWriter, RunDir, write_json
from tests.conftest import assert_ok, read_metrics, run_cli, run_module

STEPS = ["strategy=data", "grid.pr=1", "grid.pc=2", "trainer.eval_every=null",
         "trainer.batch_size=16", "trainer.checkpoint_every=2"]
OUTSIDE_TEXT = b"# the user's own file: gridrun must not touch it\n"


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("links") / "original"
    assert_ok(run_cli(*STEPS, "trainer.steps=4", f"hydra.run.dir={path}"))
    return path


def copied(original: Path, path: Path) -> Path:
    shutil.copytree(original, path, symlinks=True)
    return path


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every file under `path` (or `path` itself) by name, with its bytes (None: a folder)."""
    if path.is_file():
        return {"": path.read_bytes()}
    found: dict[str, bytes | None] = {"": None}
    for item in sorted(path.rglob("*")):
        found[str(item.relative_to(path))] = item.read_bytes() if item.is_file() else None
    return found


def plant(run: Path, name: str, outside: Path, folder: bool) -> Path:
    """Replace `run/name` by a link to `outside` (a file with text of its own, or a folder
    holding one); the link's path."""
    place = run / name
    if folder:
        outside.mkdir()
        (outside / "keep.txt").write_bytes(OUTSIDE_TEXT)
    else:
        outside.write_bytes(OUTSIDE_TEXT)
    if place.is_dir() and not place.is_symlink():
        shutil.rmtree(place)
    elif place.exists() or place.is_symlink():
        place.unlink()
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(outside, target_is_directory=folder)
    return place


def assert_refused(result: object, link: Path, output: str) -> None:
    code = getattr(result, "returncode", result)
    assert code == 2, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if "a symbolic link: refused" in line]
    assert lines == [f"error: {link}: a symbolic link: refused (gridrun writes only inside "
                     f"the run directory)"], output


# -- a resumed run: the head refuses before any rank starts --------------------------------------

@pytest.mark.parametrize(("name", "folder"), [
    ("metrics.jsonl", False), ("summary.json", False), (".lock", False),
    ("logs/rank0.log", False), ("logs/rank1.log", False), ("logs", True), (".ranks", True),
    (".hydra", True), ("tensorboard", True),
], ids=lambda value: str(value))
def test_a_resume_refuses_a_link_where_it_writes(name: str, folder: bool, original: Path,
                                                 tmp_path: Path) -> None:
    run = copied(original, tmp_path / "run")
    link = plant(run, name, tmp_path / "outside", folder)
    before = snapshot(tmp_path / "outside")
    result = run_cli(*STEPS, "trainer.steps=6", "trainer.resume=auto", f"hydra.run.dir={run}")
    assert_refused(result, link, result.stdout + result.stderr)
    assert snapshot(tmp_path / "outside") == before
    assert link.is_symlink()


def test_a_resume_through_a_linked_root_writes_inside_it(original: Path, tmp_path: Path) -> None:
    """The run directory itself may be a link the user made (`outputs/latest`): it leads to
    the run, and the resumed ranks write their logs and metrics there."""
    run = copied(original, tmp_path / "run")
    latest = tmp_path / "latest"
    latest.symlink_to(run, target_is_directory=True)
    logged = (run / "logs" / "rank1.log").stat().st_size
    assert_ok(run_cli(*STEPS, "trainer.steps=6", "trainer.resume=auto",
                      f"hydra.run.dir={latest}"))
    assert [r["step"] for r in read_metrics(run) if "split" not in r] == list(range(1, 7))
    assert (run / "logs" / "rank1.log").stat().st_size > logged
    assert not any(item.is_symlink() for item in run.rglob("*"))


def test_a_resume_with_a_fifo_for_its_metrics_ends_at_once(original: Path,
                                                           tmp_path: Path) -> None:
    run = copied(original, tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    began = time.monotonic()
    result = run_cli(*STEPS, "trainer.steps=6", "trainer.resume=auto", f"hydra.run.dir={run}",
                     timeout=60)  # a hang fails the test here
    output = result.stdout + result.stderr
    assert time.monotonic() - began < 60
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    assert f"error: {run / 'metrics.jsonl'}: not a regular file: refused" in output.splitlines()


# -- runner.report and runner.replay -------------------------------------------------------------

@pytest.mark.parametrize(("name", "folder"), [
    ("report", True), ("report/loss.png", False), ("report/communication.png", False),
    ("report/report.md", False),
], ids=lambda value: str(value))
def test_the_report_refuses_a_link_where_it_writes(name: str, folder: bool, original: Path,
                                                   tmp_path: Path) -> None:
    run = copied(original, tmp_path / "run")
    link = plant(run, name, tmp_path / "outside", folder)
    before = snapshot(tmp_path / "outside")
    result = run_module("runner.report", str(run))
    assert_refused(result, link, result.stdout + result.stderr)
    assert snapshot(tmp_path / "outside") == before


def test_the_report_writes_into_an_out_folder_the_user_linked(original: Path,
                                                              tmp_path: Path) -> None:
    """`--out` is the user's own choice: a link there is theirs to make."""
    run = copied(original, tmp_path / "run")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert_ok(run_module("runner.report", str(run), "--out", str(tmp_path / "out")))
    assert (tmp_path / "elsewhere" / "report.md").is_file()


def test_the_replay_refuses_a_linked_replays_folder(original: Path, tmp_path: Path) -> None:
    run = copied(original, tmp_path / "run")
    link = plant(run, "replays", tmp_path / "outside", True)
    before = snapshot(tmp_path / "outside")
    result = run_module("runner.replay", str(run))
    assert_refused(result, link, result.stdout + result.stderr)
    assert snapshot(tmp_path / "outside") == before


# -- a sweep -------------------------------------------------------------------------------------

def test_a_sweep_refuses_a_linked_job_folder_and_table(tmp_path: Path) -> None:
    """Both refused before anything is written through them: the job (before Hydra writes its
    .hydra/ there) and the sweep's table; the sweep ends with exit 2."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    job = plant(sweep, "0", tmp_path / "job-outside", True)
    table = plant(sweep, "sweep_summary.csv", tmp_path / "table-outside", False)
    before = snapshot(tmp_path / "job-outside"), snapshot(tmp_path / "table-outside")
    result = run_cli("-m", "strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=2",
                     f"hydra.sweep.dir={sweep}")
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    refused = "a symbolic link: refused (gridrun writes only inside the run directory)"
    assert f"{job}: {refused}" in output
    assert f"error: {table}: {refused}" in output.splitlines()
    assert (snapshot(tmp_path / "job-outside"), snapshot(tmp_path / "table-outside")) == before


def test_a_sweep_refuses_a_linked_record_before_hydra_writes_it(tmp_path: Path) -> None:
    """Hydra writes a sweep's multirun.yaml before any of gridrun's code runs: a link there in
    a sweep directory named on the command line is refused first, exit 2, nothing written."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    record = plant(sweep, "multirun.yaml", tmp_path / "record-outside", False)
    before = snapshot(tmp_path / "record-outside")
    result = run_cli("-m", "strategy=data", "grid.pr=1", "grid.pc=1,2", "trainer.steps=2",
                     f"hydra.sweep.dir={sweep}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {record}: a symbolic link: refused (gridrun writes only inside the run "
        f"directory)"]
    assert snapshot(tmp_path / "record-outside") == before
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


# -- the writers a rank uses, for a link put in place after the head looked -----------------------

@pytest.fixture
def directory(tmp_path: Path) -> RunDir:
    (tmp_path / "run" / "logs").mkdir(parents=True)
    return RunDir(tmp_path / "run")


def test_the_metrics_writer_refuses_a_link_and_a_fifo(directory: RunDir, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE_TEXT)
    directory.metrics.symlink_to(outside)
    for continue_after in (None, 3):
        with pytest.raises(safe_paths.LinkRefused, match="a symbolic link: refused"):
            MetricsWriter(directory.metrics, continue_after=continue_after)
    assert outside.read_bytes() == OUTSIDE_TEXT
    directory.metrics.unlink()
    os.mkfifo(directory.metrics)
    for continue_after in (None, 3):  # neither waits for a writer nor a reader
        with pytest.raises(safe_paths.NotRegularRefused, match="not a regular file: refused"):
            MetricsWriter(directory.metrics, continue_after=continue_after)


def test_a_hard_link_to_an_outside_file_is_not_written_in_place(directory: RunDir,
                                                                tmp_path: Path) -> None:
    """A file with another name outside (a snapshot made with `cp -al`) is made the run's own
    copy before it is appended to or truncated: the outside name keeps its bytes."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE_TEXT)
    os.link(outside, directory.rank_log(0))
    logger = setup_rank_logging(directory.rank_log(0), 0)
    logger.info("resumed")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    assert directory.rank_log(0).read_bytes().startswith(OUTSIDE_TEXT)
    assert directory.rank_log(0).read_text().rstrip().endswith("resumed")
    os.link(outside, directory.metrics)
    writer = MetricsWriter(directory.metrics)
    writer.write({"step": 1})
    writer.close()
    assert directory.metrics.read_text() == '{"step": 1}\n'
    assert outside.read_bytes() == OUTSIDE_TEXT
    assert outside.stat().st_nlink == 1


def test_the_rank_log_and_summary_refuse_links_on_the_way(directory: RunDir,
                                                          tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    shutil.rmtree(directory.logs)
    directory.logs.symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(safe_paths.LinkRefused, match=f"^{directory.logs}: a symbolic link"):
        setup_rank_logging(directory.rank_log(1), 1)
    directory.summary.symlink_to(tmp_path / "outside" / "summary.json")
    with pytest.raises(safe_paths.LinkRefused, match=f"^{directory.summary}: a symbolic link"):
        write_json(directory.summary, {"status": "completed"})
    ranks = directory.path / ".ranks"
    ranks.symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(safe_paths.LinkRefused, match=f"^{ranks}: a symbolic link"):
        write_json(ranks / "rank-0.json", {"rank": 0})
    assert list((tmp_path / "outside").iterdir()) == []


def test_a_checkpoint_folder_is_not_made_or_emptied_through_a_link(directory: RunDir,
                                                                   tmp_path: Path) -> None:
    """A linked `checkpoints/` (the head's resume refuses it first) or step folder: the
    writer neither empties what the link points to nor writes there."""
    from runner.checkpoint.layout import step_dir
    from runner.checkpoint.write import _fresh_directory

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(OUTSIDE_TEXT)
    directory.checkpoints.symlink_to(outside, target_is_directory=True)
    with pytest.raises(safe_paths.LinkRefused, match=f"^{directory.checkpoints}: a symbolic"):
        _fresh_directory(step_dir(directory.checkpoints, 2))
    directory.checkpoints.unlink()
    directory.checkpoints.mkdir()
    step_dir(directory.checkpoints, 2).symlink_to(outside, target_is_directory=True)
    with pytest.raises(safe_paths.LinkRefused):
        _fresh_directory(step_dir(directory.checkpoints, 2))
    assert snapshot(outside) == {"": None, "keep.txt": OUTSIDE_TEXT}
