"""Checkpoint and resume through the real command line, with real MPI ranks.

Exactness is bitwise: a run resumed from a checkpoint must repeat the uninterrupted run's losses
to the last bit (same grid, synchronous optimizers). Re-sharding onto another grid and strategy
must continue from the same global weights, so its losses agree to float64 rounding.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.checkpoint.layout import CheckpointError, latest_checkpoint
from runner.checkpoint.read import Checkpoint
from runner.checkpoint.resume import verify_resume
from runner.core.placement import Placement
from tests.conftest import ROOT, assert_ok, read_metrics, read_summary, run_cli
from tests.gates import Gate

BASE = ["trainer.eval_every=null", "trainer.batch_size=32", "trainer.dtype=float64", "seed=3"]
GRID = [*BASE, "strategy=grid", "grid.pr=2", "grid.pc=2", "optimizer.momentum=0.9"]
DATA2 = [*BASE, "strategy=data", "grid.pr=1", "grid.pc=2"]
EASGD = [*DATA2, "optimizer=sync_easgd", "+optimizer.momentum=0.5"]


def losses(run_dir: Path) -> dict[int, float]:
    lines = [m for m in read_metrics(run_dir) if "split" not in m]
    steps = [m["step"] for m in lines]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {m["step"]: m["loss"] for m in lines}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def reference(tmp: Path) -> Path:
    """40 uninterrupted steps on a 2 x 2 grid (its checkpoints, at 20 and 40, change nothing:
    the other runs' exact equality with its losses shows it)."""
    run_dir = tmp / "ref40"
    assert_ok(run_cli(*GRID, "trainer.steps=40", "trainer.checkpoint_every=20",
                      f"hydra.run.dir={run_dir}"))
    return run_dir


# strategy=model resumed under comm.backend=torch: its collectives through torch.distributed
@pytest.mark.parametrize("target", [["strategy=model", "grid.pr=4", "grid.pc=1",
                                     "comm.backend=torch"],
                                    ["strategy=data", "grid.pr=1", "grid.pc=4"]],
                         ids=["model_4x1", "data_1x4"])
def test_a_2x2_grid_checkpoint_resumes_on_another_grid(tmp: Path, reference: Path,
                                                       target: list[str]) -> None:
    run_dir = tmp / f"reshard_{target[0].split('=')[1]}"
    checkpoint = reference / "checkpoints" / "step-00000020"
    assert_ok(run_cli(*GRID, *target, "trainer.steps=40", f"trainer.resume={checkpoint}",
                      f"hydra.run.dir={run_dir}"))
    expected, got = losses(reference), losses(run_dir)
    assert sorted(got) == list(range(21, 41))
    # the same global weights, momentum and data order: only the order of float64 sums differs
    assert max(abs(got[s] - expected[s]) for s in got) < 1e-12


def test_sync_easgd_20_steps_resumed_for_20_more_repeat_40_steps(tmp: Path) -> None:
    """Worker weights, velocities, the centre, RNG and data order all restored."""
    reference, halves = tmp / "easgd_40", tmp / "easgd_20_20"
    assert_ok(run_cli(*EASGD, "trainer.steps=40", f"hydra.run.dir={reference}"))
    assert_ok(run_cli(*EASGD, "trainer.steps=20", "trainer.checkpoint_every=20",
                      f"hydra.run.dir={halves}"))
    assert latest_checkpoint(halves / "checkpoints").name == "step-00000020"
    assert_ok(run_cli(*EASGD, "trainer.steps=40", "trainer.resume=auto",
                      f"hydra.run.dir={halves}"))
    resumed = losses(halves)
    assert sorted(resumed) == list(range(1, 41))  # the metrics continue, nothing doubled
    assert resumed == losses(reference)


def test_a_stopped_run_resumes_to_exactly_the_uninterrupted_losses(tmp: Path,
                                                                   reference: Path) -> None:
    """SIGTERM to the command mid-run: a checkpoint, exit 130, and a printed command that
    continues the run (in its own directory, metrics continued) to the reference's losses bit
    for bit: 2 x 2 grid, momentum, data order, all restored. The ranks are held at step 4
    (`tests.gates`: the default MLP, its weights the same) until the stop reaches them."""
    run_dir = tmp / "interrupted"
    gate = Gate(tmp / "interrupted_gate", hold_at=4)
    command = [sys.executable, "-m", "runner", *GRID, "trainer.steps=40", *gate.overrides,
               f"hydra.run.dir={run_dir}"]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    gate.wait_held(4, job=job)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 130, f"exit {job.returncode}\n{out}\n{err}"
    assert err.count("stopping: the ranks finish their step") == 1, err
    summary = read_summary(run_dir)
    # held in step 4's forward, every rank has noted the stop when step 5 agrees on it
    assert summary["status"] == "interrupted" and summary["step"] == 5, summary
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint == latest_checkpoint(run_dir / "checkpoints")
    resume = next(line for line in err.splitlines() if "python -m runner" in line)
    words = shlex.split(resume[resume.index("python -m runner"):])
    assert words[:3] == ["python", "-m", "runner"] and "trainer.resume=auto" in words
    # the printed command continues the run (its ranks held once already: they pass the gate)
    # to the reference's losses
    assert_ok(run_cli(*words[3:]))
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, 41))  # the metrics continue, nothing doubled
    assert resumed == losses(reference)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    assert summary["resumed_from"]["checkpoint"] == str(checkpoint)
    assert not (reference / "tensorboard").exists()  # logger=tensorboard is off by default


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp: Path) -> None:
    run_dir = tmp / "diverged"
    result = run_cli(*DATA2, "trainer.steps=20", "trainer.checkpoint_every=5",
                     "debug.fail_at_step=7", "debug.fail_on_rank=1", "debug.fail_mode=nan",
                     f"hydra.run.dir={run_dir}")
    assert result.returncode != 0
    assert "the loss is nan at step 7" in result.stderr
    assert "step-00000005" in result.stderr  # the message names the checkpoint that stays
    assert latest_checkpoint(run_dir / "checkpoints").name == "step-00000005"
    assert not (run_dir / "checkpoints" / "step-00000007").exists()
    assert Checkpoint(run_dir / "checkpoints" / "step-00000005").step == 5


def _rank_pids(run_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"runner.cli.worker" in cmdline and str(run_dir).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def test_a_failed_checkpoint_write_keeps_the_previous_one(tmp: Path) -> None:
    """A real write error: after the first checkpoint the ranks' file-size limit drops below a
    shard's size, so the next shard write fails (EFBIG) on every rank. The ranks are held at
    step 6 (`tests.gates`) while the limit drops."""
    run_dir = tmp / "disk"
    gate = Gate(tmp / "disk_gate", hold_at=6)
    command = [sys.executable, "-m", "runner", *DATA2, "trainer.steps=40",
               "trainer.checkpoint_every=5", *gate.overrides, f"hydra.run.dir={run_dir}"]
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    first = run_dir / "checkpoints" / "step-00000005"
    try:
        gate.wait_held(2, job=job)
        assert (first / "manifest.json").exists()  # written before any rank began step 6
        shard = (first / "rank-00000.pt").stat().st_size
        for pid in _rank_pids(run_dir):
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (shard // 2, shard // 2))
    finally:
        gate.release()
    out, err = job.communicate(timeout=120)
    assert job.returncode not in (0, 2), f"{out}\n{err}"
    assert "not written" in err and "File too large" in err
    assert f"the latest complete one is {first}" in err
    assert latest_checkpoint(run_dir / "checkpoints") == first
    Checkpoint(first).rank_state(0)  # still whole and loadable


def test_an_unwritable_run_directory_is_refused_before_anything_starts(tmp: Path) -> None:
    blocker = tmp / "a_file"
    blocker.write_text("")
    result = run_cli("trainer.steps=2", f"hydra.run.dir={blocker}/run")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: cannot make the run directory {blocker}/run: "
                                     f"{blocker} is not a directory")


def test_checkpoints_load_weights_only(tmp: Path, reference: Path) -> None:
    """A shard that smuggles in an arbitrary object is refused in one line, and the object's
    code never runs: caught by its size or hash, and, when the forger rewrites the manifest's
    record too, by the weights-only unpickler."""
    source = reference / "checkpoints" / "step-00000020"
    forged = tmp / "forged"
    forged.mkdir()
    for item in source.iterdir():
        (forged / item.name).write_bytes(item.read_bytes())
    marker = tmp / "code_ran"
    payload = torch.load(source / "rank-00000.pt", weights_only=True)
    payload["rng"] = _Smuggled(str(marker))
    torch.save(payload, forged / "rank-00000.pt")
    with pytest.raises(CheckpointError, match=r"rank-00000.pt: (truncated|sha256 mismatch)"):
        Checkpoint(forged).rank_state(0)
    data = (forged / "rank-00000.pt").read_bytes()
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["shards"]["rank-00000.pt"] = {"bytes": len(data),
                                           "sha256": hashlib.sha256(data).hexdigest()}
    (forged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as caught:
        Checkpoint(forged).rank_state(0)
    assert str(caught.value) == (f"checkpoint {forged}: rank-00000.pt: refused by weights_only "
                                 f"loading: Trying to load unsupported GLOBAL posix.system "
                                 f"whose module posix is blocked")
    assert not marker.exists()


class _Smuggled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_a_checkpoint_of_another_model_is_refused(reference: Path) -> None:
    checkpoint = Checkpoint(reference / "checkpoints" / "step-00000020")
    out = torch.empty(3, 64, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"1.weight has shape \[128, 64\]"):
        checkpoint.read_into("model", None, Placement("1.weight", (256, 64), 0, 3), out)


def _meta_model(*overrides: str) -> torch.nn.Module:
    from runner.cli.compose import compose
    from runner.cli.validation import validate
    from runner.training import assembly

    run = validate(compose([*GRID, *overrides]), world_size=4)
    spec = assembly.build_dataset(run.dataset).spec()
    return assembly.model_for(run.model, spec, assembly.dtype_of(run), device="meta")


def test_the_head_verifies_a_2x2_grid_checkpoint(reference: Path) -> None:
    """Rows written by 4 ranks in Pr blocks tile every parameter; another model is refused."""
    newest = reference / "checkpoints" / "step-00000040"
    assert verify_resume(str(reference), reference / "checkpoints", _meta_model()) == (newest,
                                                                                      [])
    with pytest.raises(CheckpointError, match=r"not a checkpoint of this model: 1.weight has "
                                              r"shape \[128, 64\] in the checkpoint and "
                                              r"\[256, 64\]"):
        verify_resume("auto", reference / "checkpoints", _meta_model("model.hidden=[256,128]"))


def test_a_damaged_checkpoint_is_refused_before_any_rank_starts(tmp: Path,
                                                                 reference: Path) -> None:
    """Through the command line: the head verifies the checkpoint `trainer.resume` names (every
    shard's hash) and refuses rank 2's shard with a flipped bit in one line, exit 2, before any
    rank starts (a shard damaged after that check is caught where a rank loads it:
    tests/test_checkpoint_integrity.py)."""
    damaged = tmp / "damaged"
    shutil.copytree(reference / "checkpoints" / "step-00000020", damaged)
    shard = bytearray((damaged / "rank-00002.pt").read_bytes())
    shard[len(shard) // 2] ^= 0x01
    (damaged / "rank-00002.pt").write_bytes(shard)
    result = run_cli(*GRID, "trainer.steps=40", f"trainer.resume={damaged}",
                     f"hydra.run.dir={tmp / 'from_damaged'}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"checkpoint {damaged}: rank-00002.pt: sha256 mismatch" in lines[0]
    assert not (tmp / "from_damaged").exists()


def test_auto_resumes_past_a_damaged_newest_checkpoint(tmp: Path, reference: Path) -> None:
    """resume=auto passes over the newest checkpoint when it does not verify, says so, and
    resumes from the one before: the losses after it are the uninterrupted run's."""
    run_dir = tmp / "auto_fallback"
    shutil.copytree(reference, run_dir)
    newest = run_dir / "checkpoints" / "step-00000040"
    (newest / "rank-00001.pt").write_bytes((newest / "rank-00001.pt").read_bytes()[:100])
    result = run_cli(*GRID, "trainer.steps=40", "trainer.resume=auto",
                     f"hydra.run.dir={run_dir}")
    assert_ok(result)
    assert "note: skipped checkpoints/step-00000040: rank-00001.pt: truncated" in result.stderr
    summary = read_summary(run_dir)
    assert summary["resumed_from"]["step"] == 20
    assert losses(run_dir) == losses(reference)


def test_auto_with_every_checkpoint_damaged_refuses_and_keeps_the_run(tmp: Path,
                                                                      reference: Path) -> None:
    """resume=auto never starts afresh over a run whose checkpoints are all damaged: one line
    naming each checkpoint and why, exit 2, before any rank starts; the run's metrics, outcome
    and checkpoints are left exactly as they were (nothing truncated, set aside or pruned)."""
    run_dir = tmp / "all_damaged"
    shutil.copytree(reference, run_dir)
    for number, shard in ((40, "rank-00001.pt"), (20, "rank-00003.pt")):
        path = run_dir / "checkpoints" / f"step-{number:08d}" / shard
        path.write_bytes(path.read_bytes()[:100])
    before = {path.relative_to(run_dir): path.read_bytes()
              for path in sorted(run_dir.rglob("*")) if path.is_file()}
    result = run_cli(*GRID, "trainer.steps=60", "trainer.resume=auto",
                     f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: trainer.resume=auto: no checkpoint of "
                           f"{run_dir / 'checkpoints'} verifies (checkpoints/step-00000040: "
                           f"rank-00001.pt: truncated"), line
    assert "checkpoints/step-00000020: rank-00003.pt: truncated" in line
    assert "another hydra.run.dir" in line
    after = {path.relative_to(run_dir): path.read_bytes()
             for path in sorted(run_dir.rglob("*")) if path.is_file()}
    assert after == before
