"""What a GPU run adds, checked in one process on the CPU: validation in global batches, the
summary's GPU figures (FLOPs per step, TFLOP/s per GPU, MFU, the peak table, peak device memory;
torch.cuda's queries faked), the calibration of a device (its measurements run on the CPU's
tensors), and the set-up that keeps a CUDA build of torch."""

from __future__ import annotations

import contextlib
import io
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from runner.cli.validation import validate
from runner.config.schema import RunConfig
from runner.core import GridShape, ProcessGrid
from runner.training.evaluation import EVAL_TARGETS, _chunks, evaluate, validation
from runner.training.summary import (
    FLOP_COUNTING_RATES,
    gpu_figures,
    gpu_peak,
    model_flops_per_step,
    utilisation,
)
from runner.zoo.models import mlp
from strategies import STRATEGIES, PricingContext


def run_config(**trainer: Any) -> RunConfig:
    cfg = OmegaConf.create({
        "seed": 0, "grid": {"pr": 1, "pc": 1}, "dataset": {"name": "digits"},
        "model": {"name": "mlp"}, "strategy": {"name": "data"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "trainer": {"steps": 4, "batch_size": 64, "eval_every": 2, "threads": 1, **trainer}})
    return validate(cfg, world_size=1)


# -- validation in global batches ----------------------------------------------------------------

@pytest.mark.parametrize("rows,per_row,batch,ranks", [
    (37, 1, 8, 1), (37, 1, 8, 4), (37, 1, None, 2), (360, 1, 64, 4), (5, 1, 4, 4),
    (100, 64, 1000, 2), (100, 64, 16, 2), (3, 4096, 8, 2), (0, 1, 8, 1)])
def test_pieces_are_batches_of_at_most_the_batch_size_covering_the_set(
        rows: int, per_row: int, batch: int | None, ranks: int) -> None:
    pieces = _chunks(rows, per_row, batch, ranks)
    assert pieces[0].start == 0 and pieces[-1].stop == rows
    assert all(a.stop == b.start for a, b in itertools.pairwise(pieces))
    sizes = [p.stop - p.start for p in pieces]
    assert max(sizes) - min(sizes) <= 1  # cut evenly: no small remainder last
    if rows >= ranks:
        assert min(sizes) >= ranks  # every rank of the batch group gets rows of every piece
    most = rows if batch is None else batch
    if per_row > 1:
        most = min(most, max(1, EVAL_TARGETS // per_row))
    if rows // ranks >= -(-rows // max(most, 1)):  # the size rule, where the set allows it
        assert max(sizes) <= max(most, 1)
    assert len(pieces) == max(1, min(-(-rows // max(most, 1)), rows // ranks))


def test_a_classifier_is_scored_in_pieces_of_the_batch_size() -> None:
    assert [p.stop - p.start for p in _chunks(1000, 1, 256)] == [250] * 4
    assert _chunks(1000, 1) == [slice(0, 1000)]  # no batch size: the whole set at once
    # pieces of 4 rows where 4 ranks split the batch: never fewer rows than ranks
    assert [p.stop - p.start for p in _chunks(5, 1, 4, ranks=4)] == [5]


def _data_model(model: torch.nn.Module, shape: tuple[int, ...]) -> Any:
    return STRATEGIES.get("data")().parallelize(model, shape, ProcessGrid(1, 1))


def test_evaluation_in_batches_equals_one_forward_over_the_set() -> None:
    torch.manual_seed(0)
    model = _data_model(mlp((1, 8, 8), 10, hidden=(30, 21)).double(), (1, 8, 8))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(101, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (101,), generator=gen)
    whole = evaluate(model, x, y)
    for batch in (1, 7, 32, 100, 101, 500):
        part = evaluate(model, x, y, batch_size=batch)
        assert part.loss == pytest.approx(whole.loss, rel=1e-13, abs=0)
        assert part.accuracy == whole.accuracy
    assert model.training  # left in training mode


def test_a_language_models_validation_in_batches_equals_its_pieces() -> None:
    from runner.zoo.models import ZooGPT

    torch.manual_seed(0)
    gpt = ZooGPT((16,), vocab_size=50, width=16, layers=1, heads=2).double()
    model = _data_model(gpt, (16,))
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 50, (21, 16), generator=gen)
    y = torch.randint(0, 50, (21, 16), generator=gen)
    optimizer = SimpleNamespace(has_centre=False)
    whole = validation(model, optimizer, x, y, everyone=True)  # type: ignore[arg-type]
    part = validation(model, optimizer, x, y, everyone=True, batch_size=4)  # type: ignore[arg-type]
    assert whole is not None and part is not None and set(part) == set(whole)
    for key, value in whole.items():
        assert part[key] == pytest.approx(value, rel=1e-12), key


# -- the summary's GPU figures -------------------------------------------------------------------

@pytest.mark.parametrize("name,precision,peak,label", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12, "H100 SXM bf16"),
    ("NVIDIA H100 80GB HBM3", "fp32", 67e12, "H100 SXM fp32"),
    ("NVIDIA H100 PCIe", "bf16", 756e12, "H100 PCIe bf16"),
    ("NVIDIA H100 NVL", "fp16", 835e12, "H100 NVL fp16"),
    ("NVIDIA H200", "bf16", 989e12, "H200 SXM bf16"),
    ("NVIDIA H200 NVL", "fp32", 60e12, "H200 NVL fp32"),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12, "A100 bf16"),
    ("NVIDIA A100-PCIE-40GB", "fp32", 19.5e12, "A100 fp32"),
])
def test_the_peak_table_knows_the_gpus_by_the_names_torch_gives(
        name: str, precision: str, peak: float, label: str) -> None:
    assert gpu_peak(name, precision) == (peak, label)


def test_a_gpu_not_in_the_table_has_no_peak_and_no_mfu() -> None:
    assert gpu_peak("Tesla T4", "bf16") == (None, "unknown")
    assert utilisation(4e12, 0.5, 2, None) == (4e12, None)


def test_mfu_is_the_step_flops_per_second_per_gpu_over_the_peak() -> None:
    per_gpu, mfu = utilisation(flops_per_step=6e12, step_s=0.02, gpus=4, peak=989e12)
    assert per_gpu == pytest.approx(6e12 / 0.02 / 4)  # 75 TFLOP/s on each of 4 GPUs
    assert mfu == pytest.approx(75e12 / 989e12)


def test_the_flops_of_a_step_are_the_products_of_forward_and_backward() -> None:
    """The default MLP (64→128→128→10) on 64 rows: each Linear's forward 2·B·in·out, its
    weight gradient as much, its input gradient as much except the first layer's (its input,
    the data, needs none)."""
    batch = 64
    forward = [2 * batch * i * o for i, o in ((64, 128), (128, 128), (128, 10))]
    expected = 2 * sum(forward) + sum(forward[1:])
    assert model_flops_per_step(run_config(batch_size=batch)) == expected
    # a convolution's gradients are a forward each; a first layer's input has none
    counting = STRATEGIES.get("data")(pricing=PricingContext(rates=FLOP_COUNTING_RATES))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1))
    seconds = counting.predict_compute_seconds(conv, (3, 16, 16), GridShape(1, 1), 4)
    assert seconds == pytest.approx(2 * (2 * 4 * 8 * 16 * 16 * 3 * 9))


@pytest.mark.parametrize("model,dataset,batch,above", [
    ({"name": "resnet", "widths": [8, 16], "blocks": [1, 1]},
     {"name": "synthetic", "shape": [3, 16, 16]}, 8, 0.0),
    ({"name": "cnn"}, {"name": "digits"}, 16, 0.0),
    # attention's backward: the compute model's 2.5 forwards (the scores recomputed), PyTorch's
    # counter's 2: this small GPT's count is 1/7 above
    ({"name": "gpt", "width": 32, "layers": 2, "heads": 2},
     {"name": "tokens", "vocab_size": 128, "seq_len": 32}, 4, 1 / 7),
])
def test_the_flop_count_is_pytorchs_flop_counters(model: dict[str, Any], dataset: dict[str, Any],
                                                   batch: int, above: float) -> None:
    """The count against `torch.utils.flop_counter` over one forward and backward of the
    plain model on a batch: products and convolutions alike, attention apart."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from runner.training.assembly import assemble

    run = validate(OmegaConf.create({
        "seed": 0, "grid": {"pr": 1, "pc": 1}, "dataset": dataset, "model": model,
        "strategy": {"name": "data"}, "optimizer": {"name": "sgd", "lr": 0.05},
        "trainer": {"batch_size": batch}}), world_size=1)
    parts = assemble(run)
    data = parts.dataset.load()
    counter = FlopCounterMode(display=False)
    with counter:
        out = parts.model(data.train_x[:batch])
        F.cross_entropy(out.flatten(0, -2), data.train_y[:batch].flatten()).backward()
    assert model_flops_per_step(run) == pytest.approx(counter.get_total_flops() * (1 + above))


def _setup(device: torch.device, precision: str = "bf16") -> Any:
    return SimpleNamespace(device=device, grid=ProcessGrid(1, 1), run=run_config(batch_size=64),
                           precision=SimpleNamespace(name=precision))


def test_on_the_cpu_the_gpu_figures_are_null() -> None:
    figures = gpu_figures(_setup(torch.device("cpu")), 0.01)
    assert figures == {"model_flops_per_step": None, "tflops_per_gpu": None, "mfu": None,
                       "gpu_peak": None, "gpus": None, "device_memory_peak_bytes": None}


def test_on_a_gpu_the_figures_come_from_the_flops_the_step_time_and_the_peak(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    figures = gpu_figures(_setup(torch.device("cuda", 0)), 0.001)
    flops = model_flops_per_step(run_config(batch_size=64))
    assert figures["model_flops_per_step"] == flops
    assert figures["gpus"] == 1 and figures["device_memory_peak_bytes"] == 3 << 30
    assert figures["tflops_per_gpu"] == pytest.approx(flops / 0.001 / 1e12)
    assert figures["mfu"] == pytest.approx(flops / 0.001 / 989e12)
    assert figures["gpu_peak"] == {"name": "H200 SXM bf16", "tflops": 989.0}


def test_a_cpu_runs_summary_says_the_gpu_figures_are_not_measured(tmp_path: Path) -> None:
    from runner.records.console import summary_table
    from runner.records.rundir import RunDir
    from runner.training.loop import train

    run = run_config(steps=3, eval_every=3)
    directory = RunDir(tmp_path / "run")
    directory.create(OmegaConf.create({"seed": 0}))
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train(run, directory, ProcessGrid(1, 1))
    for key in ("model_flops_per_step", "tflops_per_gpu", "mfu", "gpu_peak", "gpus",
                "device_memory_peak_bytes"):
        assert key in summary and summary[key] is None, key
    shown = io.StringIO()
    from rich.console import Console

    Console(file=shown, width=200).print(summary_table(summary))
    assert "GPU" not in shown.getvalue()


# -- the calibration of a GPU ----------------------------------------------------------------------

def test_the_timer_measures_products_in_its_dtype_on_its_device() -> None:
    """The measurements a GPU's calibration makes, run here on the CPU's tensors: a product
    band and a convolution in bfloat16, timed between the timer's synchronisations."""
    from runner.plan.calibration import _conv_point, _gemm_band, _Timer

    timer = _Timer(1, "cpu", torch.bfloat16)
    assert timer.randn(2, 3).dtype == torch.bfloat16 and not timer.cuda
    band = _gemm_band(16, timer, most_flops=1e6)
    assert band and all(flops > 0 and rate > 0 for flops, rate in band)
    flops, rate = _conv_point(1e5, 4, 4, 8, timer)
    assert flops > 0 and rate > 0


@pytest.mark.parametrize("gpus,cores,plan", [
    (1, 16, (2, "mpi")), (0, 16, (2, "mpi")), (2, 16, (2, "torch")), (8, 16, (8, "torch")),
    (16, 64, (8, "torch")), (4, 2, (2, "torch"))])
def test_a_gpu_machines_all_reduce_sweep_runs_one_rank_per_gpu(
        gpus: int, cores: int, plan: tuple[int, str]) -> None:
    from runner.plan.calibration import device_collective_plan

    assert device_collective_plan(gpus, cores) == plan


def test_the_device_sweep_is_fitted_as_the_hosts() -> None:
    from runner.plan.calibration import DEVICE_SIZES, fit_collective

    alpha, beta, p = 2e-5, 5e-11, 4
    seconds = [2 * alpha * 2 + 2 * beta * (p - 1) / p * n for n in DEVICE_SIZES]
    fitted = fit_collective({"ranks": p, "sizes": DEVICE_SIZES, "seconds": seconds})
    assert fitted["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert fitted["beta"] == pytest.approx(beta, rel=1e-9)


def _fake_compute(rate: float) -> dict[str, Any]:
    from runner.cost.compute import DEFAULT_RATES

    return {**DEFAULT_RATES.to_dict(), "gemm": {"16": [[1e6, rate], [1e9, rate]]},
            "conv": [[1e6, rate]], "memory": 2e12}


def _fake_device_measurement(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """measure_device's parts faked: float32 products at 50 TFLOP/s, bfloat16 at 700; the
    all-reduce sweep's MPI job recorded, not started."""
    from runner.plan import calibration

    started: list[tuple[str, int, int]] = []

    def run(kinds: list[str], ranks: int, repeats: int) -> dict[str, dict[str, Any]]:
        started.extend((kind, ranks, repeats) for kind in kinds)
        sizes = calibration.DEVICE_SIZES
        return {kind: {"ranks": ranks, "sizes": sizes,
                       "seconds": [4e-5 + 1e-11 * n for n in sizes],
                       "path": "staged through host buffers (MPI)"} for kind in kinds}

    monkeypatch.setattr(calibration, "measure_compute",
                        lambda threads=1, device="cpu": _fake_compute(
                            50e12 if device.startswith("cuda") else 1e11))
    monkeypatch.setattr(calibration, "_products", lambda timer: {
        k: v for k, v in _fake_compute(700e12).items() if k in ("gemm", "conv")})
    monkeypatch.setattr(calibration, "_run", run)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return started


def test_a_gpus_calibration_is_its_rates_in_both_precisions_and_its_all_reduce(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.plan.calibration import measure_device

    started = _fake_device_measurement(monkeypatch)
    record = measure_device(repeats=3)
    assert record["name"] == "NVIDIA H100 80GB HBM3"
    assert started == [("device_mpi", 2, 3)]  # one GPU: two ranks sharing it, staged
    assert record["compute"]["gemm"]["16"][0][1] == 50e12
    bf16 = record["compute_bf16"]
    assert bf16["gemm"]["16"][0][1] == 700e12 and bf16["memory"] == 2e12  # the rest: fp32's
    collective = record["collective"]
    assert collective["backend"] == "mpi" and collective["ranks"] == 2
    assert collective["alpha"] == pytest.approx(2e-5) and collective["beta"] == pytest.approx(
        1e-11 / (2 * (2 - 1) / 2))


def test_calibration_stores_the_gpu_by_name_and_runs_on_it_are_priced_with_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """measure() with a GPU keeps the host's figures and adds the GPU's under "devices"; the
    loaders give the GPU's α, β and rates (bf16's for a bf16 run) to a run on that GPU, the
    host's to any other."""
    from runner.config import machine
    from runner.plan import calibration

    path = tmp_path / "calibration.json"
    monkeypatch.setenv("GRIDRUN_CALIBRATION", str(path))
    _fake_device_measurement(monkeypatch)
    host_sweep = {"ranks": 2, "sizes": calibration.SIZES,
                  "seconds": [1e-5 + 1e-9 * n for n in calibration.SIZES],
                  "calls": {"allreduce": 3e-6}, "sync": 1e-4}
    monkeypatch.setattr(calibration, "usable_cores", lambda: 2)
    monkeypatch.setattr(calibration, "measure_local",
                        lambda: {"table_pass": 1e-10, "sparse_row": 1e-9})
    monkeypatch.setattr(calibration, "_run", lambda kinds, ranks, repeats: {
        kind: host_sweep if not kind.startswith("device") else {
            "ranks": ranks, "sizes": calibration.DEVICE_SIZES,
            "seconds": [4e-5 + 1e-11 * n for n in calibration.DEVICE_SIZES], "path": "x"}
        for kind in kinds})
    stored = calibration.measure(repeats=1, device=True)
    name = "NVIDIA H100 80GB HBM3"
    assert list(stored["devices"]) == [name] and path.exists()
    assert machine.calibrated_devices() == [name]

    host = machine.load_machine_costs()
    gpu = machine.load_machine_costs(device=name)
    assert gpu.alpha == pytest.approx(2e-5) and gpu.alpha != host.alpha
    assert gpu.calls == host.calls and name in gpu.source  # the runner's own costs: the host's
    assert machine.load_machine_costs(device="another GPU").alpha == host.alpha
    assert machine.load_machine_costs(1e-6, 1e-9, device=name).alpha == 1e-6  # given wins

    assert machine.load_compute_rates().gemm_seconds(16, 1000, 1000) > 1e-6  # the host's
    fp32 = machine.load_compute_rates(name)
    bf16 = machine.load_compute_rates(name, "bf16")
    assert fp32.gemm_seconds(16, 1000, 1000) == pytest.approx(2 * 16e6 / 50e12)
    assert bf16.gemm_seconds(16, 1000, 1000) == pytest.approx(2 * 16e6 / 700e12)
    assert "bf16" in bf16.source and name in fp32.source
    assert machine.load_compute_rates(name, "fp16").source == bf16.source


def test_a_run_is_priced_by_the_gpu_it_runs_on(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    import json

    from runner.config.machine import pricing_device

    path = tmp_path / "calibration.json"
    monkeypatch.setenv("GRIDRUN_CALIBRATION", str(path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pricing_device("cpu") is None and pricing_device("cuda") is None  # not calibrated
    path.write_text(json.dumps({"collective": {"alpha": 1, "beta": 1},
                                "devices": {"NVIDIA H200": {}}}))
    # planned away from the GPUs: the one GPU calibrated; `auto` without a GPU is the CPU
    assert pricing_device("cuda") == "NVIDIA H200" and pricing_device("auto") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4")
    assert pricing_device("auto") == pricing_device("cuda") == "NVIDIA A100-SXM4"
    assert pricing_device("cpu") is None


class _StepEvent:
    """A CUDA event's stand-in: `record` notes a time on a fake device clock, and the device
    has completed the events recorded up to `_StepEvent.completed`."""

    clock = 0.0
    completed = 0.0
    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = _StepEvent.clock

    def query(self) -> bool:
        return self.at <= _StepEvent.completed

    def synchronize(self) -> None:
        _StepEvent.waits += 1
        _StepEvent.completed = max(_StepEvent.completed, self.at)

    def elapsed_time(self, end: _StepEvent) -> float:
        return (end.at - self.at) * 1000  # milliseconds, as CUDA's


def test_a_gpu_steps_time_is_the_devices_read_where_the_step_reads_its_loss(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's clock says when a step was queued; the history takes the device's times of
    the steps the device has completed where a step reads its loss, without waiting for the
    device there; a step it has not completed yet is read later, or after the last step."""
    from runner.training.state import DeviceStepTimes, StepHistory

    monkeypatch.setattr(torch.cuda, "Event", _StepEvent)
    times, history = DeviceStepTimes(True), StepHistory()
    for step, device_seconds in enumerate([0.5, 0.25, 0.75]):
        times.begin(len(history.seconds))
        _StepEvent.clock += device_seconds
        times.end()
        if step < 2:
            history.add(0.001, 0, 0.0)  # queued at once: the host's time
    _StepEvent.completed = _StepEvent.clock  # the third step's loss read: the device is there
    found = times.resolve(history)
    assert found == {0: 0.5, 1: 0.25, 2: 0.75} and _StepEvent.waits == 0
    assert history.seconds == [0.5, 0.25]  # the third is the current step's, added after
    history.add(found[2], 0, 0.0)  # as the loop records it
    times.begin(3)
    _StepEvent.clock += 0.125
    times.end()  # fp16: its flag read before the update, the device not at its end yet
    assert times.resolve(history) == {} and _StepEvent.waits == 0
    history.add(0.002, 0, 0.0)
    times.finish(history)  # after the last step: waits for the device
    assert history.seconds == [0.5, 0.25, 0.75, 0.125] and _StepEvent.waits == 1
    assert DeviceStepTimes(False).resolve(history) == {}  # the CPU: nothing recorded
