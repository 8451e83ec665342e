"""Pure pieces of the engine, in one process: sampling, schedules, sweep rows, error lines."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.cli.compose import one_line
from runner.cli.sweep import SweepJob, sweep_failures, sweep_rows
from runner.config.options import with_defaults
from runner.optim.sync import SynchronousSGD, scheduled_lr
from runner.records.rundir import MetricsWriter
from runner.training.assembly import OPTIMIZER_INPUTS
from runner.training.sampling import EpochSampler
from strategies.exchange.buckets import group_by_size


def test_sampler_is_a_seeded_permutation_per_epoch() -> None:
    sampler = EpochSampler(num_samples=10, batch_size=3, seed=7)
    epoch = torch.cat([sampler.next_batch() for _ in range(3)])  # 9 of 10, last one dropped
    assert len(set(epoch.tolist())) == 9
    assert sampler.next_batch().tolist() != [] and sampler.epoch == 1
    again = EpochSampler(num_samples=10, batch_size=3, seed=7)
    assert torch.equal(torch.cat([again.next_batch() for _ in range(3)]), epoch)
    other = EpochSampler(num_samples=10, batch_size=3, seed=8)
    assert not torch.equal(torch.cat([other.next_batch() for _ in range(3)]), epoch)


def test_a_new_run_in_the_same_directory_starts_new_metrics(tmp_path) -> None:
    for run in (1, 2):
        writer = MetricsWriter(tmp_path / "metrics.jsonl")
        writer.write({"run": run})
        writer.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"run": 2}']


def test_learning_rate_schedules() -> None:
    assert scheduled_lr(0.1, 0, 100, "constant", 0) == 0.1
    assert scheduled_lr(0.1, 0, 100, "constant", 4) == pytest.approx(0.025)
    assert scheduled_lr(0.1, 3, 100, "constant", 4) == pytest.approx(0.1)
    assert scheduled_lr(0.1, 4, 104, "cosine", 4) == pytest.approx(0.1)
    assert scheduled_lr(0.1, 54, 104, "cosine", 4) == pytest.approx(0.05)
    assert math.isclose(scheduled_lr(0.1, 104, 104, "cosine", 4), 0.0, abs_tol=1e-12)


def test_sgd_names_every_bad_hyper_parameter() -> None:
    def check(**options: object) -> list[str]:  # as validation calls it: defaults filled in
        return SynchronousSGD.check(**with_defaults(SynchronousSGD, options, OPTIMIZER_INPUTS))

    problems = check(lr=0, momentum=1.0, weight_decay=-1, schedule="step")
    assert len(problems) == 4
    assert check(lr=0.1, momentum=0.9) == []


def test_buckets_group_consecutive_parameters_under_the_cap() -> None:
    items = [(4 * n, torch.float32) for n in (10, 10, 10, 100, 5)]
    groups = group_by_size(items, caps=[40, 80])  # bytes: first bucket 40, then 80
    assert groups == [[0], [1, 2], [3], [4]]
    mixed = [(4, torch.float32), (8, torch.float64), (4, torch.float32)]
    assert group_by_size(mixed, caps=[100]) == [[0], [1], [2]]  # one dtype per bucket


def test_sweep_rows_mark_failed_jobs() -> None:
    jobs = [SweepJob(0, ["grid.pc=1"], "/r/0", {"final_loss": 0.5, "val_accuracy": 0.9}),
            SweepJob(1, ["grid.pc=3"], "/r/1", None, "not divisible")]
    rows = sweep_rows(jobs)
    assert rows[0]["status"] == "completed" and rows[0]["final_loss"] == 0.5
    assert rows[1]["status"] == "failed" and rows[1]["overrides"] == "grid.pc=3"
    assert sweep_failures(rows) == ["job 1 (grid.pc=3): not divisible"]


def test_hydra_errors_become_one_line() -> None:
    text = ("In 'config': Could not find 'model/foo'\n\nAvailable options in 'model':\n\tcnn\n"
            "\tmlp\nConfig search path:\n\tprovider=hydra, path=pkg://hydra.conf\n")
    assert one_line(Exception(text)) == "unknown model 'foo'; available: cnn, mlp"
    assert one_line(Exception("bad input '[1'\nSee https://hydra.cc/x for details")) == \
        "bad input '[1'"


def test_dropped_gradient_buckets_free_their_memory() -> None:
    import gc
    import weakref

    import torch

    from runner.core import CommCounter, CountedComm
    from strategies.exchange.buckets import GradientBuckets

    layer = torch.nn.Linear(100, 100)
    buckets = GradientBuckets(list(layer.parameters()), CountedComm(None, CommCounter()), 0.5,
                              1 << 20)
    alive = weakref.ref(buckets)
    del buckets
    gc.collect()
    # the parameters' hooks must not keep the buckets (a model's worth of gradients) alive
    assert alive() is None
    layer(torch.randn(2, 100)).sum().backward()  # and the orphaned hooks do nothing harmful


def test_a_resumed_run_continues_its_metrics_after_the_checkpoint(tmp_path: Path) -> None:
    """Lines after the checkpoint's step (those steps run again) and a line cut short by a crash
    are dropped; the rest is kept and appended to."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {s}}}\n' for s in range(1, 8))
                    + '{"step": 5, "split": "val", "loss": 1}\n{"step": 8, "lo')
    writer = MetricsWriter(path, continue_after=5)
    writer.write({"step": 6, "loss": 60})
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(m["step"], m["loss"]) for m in lines] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5),
                                                       (5, 1), (6, 60)]
    MetricsWriter(path).close()  # a fresh run starts a new file
    assert path.read_text() == ""


@pytest.mark.parametrize(("momentum", "weight_decay", "nesterov"),
                         [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 1e-3, True),
                          (0.5, 0.1, False)])
def test_sgd_is_pytorchs_sgd_bit_for_bit(momentum: float, weight_decay: float,
                                         nesterov: bool) -> None:
    """`sgd` applies PyTorch's rule through its functional form: the same weights as
    torch.optim.SGD, bit for bit, over a cosine schedule with warm-up."""
    from runner.core import ProcessGrid

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))

    reference, ours = net(), net()
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=momentum,
                                weight_decay=weight_decay, nesterov=nesterov)
    sgd = SynchronousSGD(ours, ProcessGrid(1, 1), 30, lr=0.1, momentum=momentum,
                         weight_decay=weight_decay, nesterov=nesterov, schedule="cosine",
                         warmup_steps=3)
    for step in range(30):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        for model in (reference, ours):
            model.zero_grad()
            model(x).pow(2).mean().backward()
        for group in torch_sgd.param_groups:
            group["lr"] = scheduled_lr(0.1, step, 30, "cosine", 3)
        torch_sgd.step()
        sgd.step(step)
    assert sgd.lr == torch_sgd.param_groups[0]["lr"]
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), ours.parameters(),
                                                 strict=True))


def test_a_process_collects_its_oldest_objects_seldom_while_it_starts_then_as_usual() -> None:
    """In a fresh interpreter (the collector's state is the process's): full collections are
    deferred through the imports, and once the run trains what start-up made is frozen out of
    the collector's sight and CPython's thresholds are back; a second call changes nothing."""
    code = """if True:
        import gc
        from runner.records.process import defer_full_collections, start_up_done
        defaults = gc.get_threshold()
        defer_full_collections()
        assert gc.get_threshold() == (*defaults[:2], 1000), gc.get_threshold()
        import torch  # noqa: F401
        before = gc.get_freeze_count()
        start_up_done()
        assert gc.get_threshold() == defaults, gc.get_threshold()
        frozen = gc.get_freeze_count()
        assert frozen > before + 50_000, (before, frozen)
        start_up_done()
        assert gc.get_freeze_count() == frozen and gc.get_threshold() == defaults
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "ok", result.stderr
