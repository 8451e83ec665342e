"""`logger=tensorboard`: the metrics lines also as TensorBoard scalars (off by default)."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import assert_ok, read_metrics, run_cli

RUN = ["grid.pr=1", "grid.pc=2", "strategy=data", "trainer.steps=6", "trainer.eval_every=3",
       "trainer.batch_size=32"]


def test_tensorboard_scalars_match_the_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "tb"
    assert_ok(run_cli(*RUN, "logger=tensorboard", f"hydra.run.dir={run_dir}"))
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    train = [(e.step, e.value) for e in events.Scalars("train/loss")]
    metrics = [m for m in read_metrics(run_dir) if "split" not in m]
    assert [s for s, _ in train] == [m["step"] for m in metrics]
    assert all(abs(v - m["loss"]) < 1e-6 for (_, v), m in zip(train, metrics, strict=True))
    assert [e.step for e in events.Scalars("val/accuracy")] == [3, 6]
