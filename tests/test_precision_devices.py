"""Mixed precision, loss scaling, device placement and host staging, in one process.

What needs ranks is in tests/test_cli_runs.py (staged, bf16 and fp16 runs against fp32) and
what needs a GPU in tests/test_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from runner.cli.app import precheck
from runner.config.schema import parse
from runner.core import CommCounter, CountedComm, DevicePaths, ProcessGrid
from runner.core.cost import MachineCosts
from runner.core.staging import StagedTransport
from runner.core.torchdist import LocalTransport
from runner.records.rundir import RunDir, release_run_dirs
from runner.training.precision import DynamicLossScale, Precision
from runner.training.state import RunSetup, Start
from runner.training.step import Feed, train_step
from strategies.base import Score, cross_entropy_score


def test_half_precision_stores_floating_inputs_in_the_half_type() -> None:
    bf16 = Precision("bf16", "cpu")
    assert bf16.input_dtype(torch.float32) == torch.bfloat16
    assert Precision("fp16", "cpu").input_dtype(torch.float32) == torch.float16
    assert Precision("fp32", "cpu").input_dtype(torch.float64) == torch.float64
    with bf16.autocast():
        assert nn.Linear(3, 2)(torch.zeros(1, 3)).dtype == torch.bfloat16


def test_the_loss_scale_unscales_finds_overflow_backs_off_and_grows() -> None:
    scaler = DynamicLossScale(scale=8.0, growth_interval=2)
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    a.grad, b.grad = torch.tensor([8.0, 16.0, -8.0]), torch.tensor([4.0, 0.0])
    assert scaler.unscale([a, b]) is False
    assert a.grad.tolist() == [1.0, 2.0, -1.0] and b.grad.tolist() == [0.5, 0.0]
    b.grad = torch.tensor([float("inf"), 1.0])
    assert scaler.unscale([a, b]) is True
    scaler.update(3, overflow=True)
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1 and scaler.history == [3]
    scaler.update(4, overflow=False)
    scaler.update(5, overflow=False)
    assert scaler.scale == 8.0 and scaler.good_steps == 0
    restored = DynamicLossScale()
    restored.load_state(scaler.state())
    assert restored.state() == scaler.state()


class _NoExchange(nn.Sequential):
    """A ParallelModel's surface for one process: no gradient exchange to finish."""

    def finish_gradient_sync(self) -> None:
        return None

    def score(self, output: torch.Tensor, targets: torch.Tensor, correct: bool = False) -> Score:
        return cross_entropy_score(output, targets, correct)


class _Recorder:
    steps: list[int]

    def __init__(self) -> None:
        self.steps = []

    def step(self, index: int) -> None:
        self.steps.append(index)


def one_process_setup(model: nn.Module, optimizer: _Recorder, loss_comm: CountedComm,
                      precision: Precision, scaler: DynamicLossScale,
                      run_dir: Path) -> RunSetup:
    """A one-process run's setup around `model` and `optimizer`: one row per batch, so its loss
    scale is 1."""
    run = parse({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                 "strategy": {"name": "data"}, "optimizer": {"name": "sgd"},
                 "trainer": {"batch_size": 1}})
    return RunSetup(
        run=run, run_dir=RunDir(run_dir), grid=ProcessGrid(1, 1),
        model=model, optimizer=optimizer,  # type: ignore[arg-type]
        start=Start(), loss_comm=loss_comm, predicted_ops=None, predicted_step=None,
        costs=MachineCosts(), device=torch.device("cpu"), precision=precision, scaler=scaler,
        targets_per_sample=1, predicted_memory=None)


def test_an_overflowing_fp16_step_is_skipped_and_the_next_one_taken(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _NoExchange(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    comm = CountedComm(None, CommCounter())
    optimizer = _Recorder()
    # A scale beyond float16's range: the backward's half-precision gradients overflow.
    scaler = DynamicLossScale(scale=2.0 ** 40)
    setup = one_process_setup(model, optimizer, comm, Precision("fp16", "cpu"), scaler, tmp_path)
    assert setup.loss_scale == 1.0
    loss, stopping = train_step(setup, [Feed(x, y)], 1, comm, False)
    assert optimizer.steps == [] and scaler.skipped_steps == 1 and not stopping
    assert torch.isfinite(torch.tensor(loss))
    scaler.scale = 2.0 ** 8
    train_step(setup, [Feed(x, y)], 1, comm, False)
    assert optimizer.steps == [0] and scaler.skipped_steps == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_device_paths_stage_device_buffers_unless_the_transport_reads_them() -> None:
    assert not DevicePaths("cpu").staged and DevicePaths("cpu").describe("mpi") == "host"
    assert DevicePaths("cuda").staged
    assert DevicePaths("cuda").describe("torch") == "staged through host buffers (gloo)"
    assert not DevicePaths("cuda", direct=True).staged
    assert DevicePaths("cuda", direct=True).describe("torch") == "direct (NCCL)"
    assert DevicePaths("cpu", stage_host=True).staged


def test_staging_moves_through_pooled_host_buffers_and_copies_results_back() -> None:
    staged = StagedTransport(LocalTransport(), pinned=False, force=True)
    out = torch.zeros(4)
    staged.allreduce(torch.arange(4.0), out)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    gathered = torch.zeros(3)
    staged.allgatherv_(torch.tensor([5.0, 6.0, 7.0]), gathered, [3])
    assert gathered.tolist() == [5.0, 6.0, 7.0]
    started = torch.zeros(3)
    request = staged.iallgatherv_(torch.tensor([8.0, 9.0, 1.0]), started, [3])
    request.wait()
    assert started.tolist() == [8.0, 9.0, 1.0] and request.test()
    received = torch.zeros(2)
    request = staged.exchange([(torch.tensor([1.0, 2.0]), 0)], [(received, 0)], tag=0)
    assert received.tolist() == [0.0, 0.0]  # copied back when the exchange completes
    request.wait()
    assert received.tolist() == [1.0, 2.0] and request.test()
    allocated = staged.pool.allocated_bytes
    staged.allreduce(torch.arange(4.0), out)  # the same shapes again: the pool's buffers
    assert staged.pool.allocated_bytes == allocated


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_asked_for_where_there_is_none_is_refused_before_any_rank_starts(
        tmp_path) -> None:
    try:
        problem = precheck(["trainer.device=cuda", f"hydra.run.dir={tmp_path / 'run'}"])
    finally:
        release_run_dirs()
    assert problem is not None and problem.startswith("trainer.device=cuda: ")
    assert "trainer.device=cpu" in problem and not (tmp_path / "run").exists()
