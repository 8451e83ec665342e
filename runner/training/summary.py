"""What a run leaves in its records: the metrics line's extras, `summary.json`
(README, "Run directory": every key is part of the contract other tools read).

On GPUs the summary also gives the model's FLOP/s per GPU and its model FLOPs utilisation
(MFU): the FLOPs of a training step as the compute model counts them (`model_flops_per_step`:
the products of the forward and backward of the whole model on the global batch, as one
process would run them), per second of the median step, per GPU, against the GPU's dense peak
in the run's precision (`GPU_PEAKS`); and the most device memory any rank allocated. On the CPU
these are null: not measured."""

from __future__ import annotations

import math
import socket
import statistics
from typing import Any

import torch

from runner.checkpoint.resume import resume_command
from runner.config.schema import OBJECTIVES, RunConfig
from runner.core import GridShape
from runner.cost.collectives import comm_seconds, step_bytes
from runner.cost.compute import LAYER_KINDS, ComputeRates, make_curve, make_gemm_table
from runner.records.logs import get_logger
from runner.records.rundir import git_commit, versions, write_json
from runner.training import assembly
from runner.training.memory import held_memory
from runner.training.precision import DynamicLossScale, Precision
from runner.training.state import RunSetup, TrainingState
from strategies import STRATEGIES, ParallelModel, PricingContext


def sparse_line(model: ParallelModel) -> dict[str, Any]:
    """The metrics line's record of the sparse tables' exchange this step (nothing without)."""
    report = model.exchange_report()
    if not report:
        return {}
    return {"sparse": {name: {k: v for k, v in table.items() if k != "steps_by_mode"}
                       for name, table in report.items()}}


def interrupted_summary(setup: RunSetup, state: TrainingState,
                        signal_name: str) -> dict[str, Any]:
    """The summary of a run stopped by a signal after writing its checkpoint."""
    command = resume_command(setup.run_dir.path)
    step, checkpoint = state.step, state.last_checkpoint
    message = (f"interrupted by {signal_name} after step {step}: checkpoint written to "
               f"{checkpoint}; to continue: {command}")
    summary = {"status": "interrupted", "step": step, "signal": signal_name,
               "checkpoint": str(checkpoint), "resume_command": command, "message": message,
               "run_dir": str(setup.run_dir.path)}
    if setup.rank == 0:
        write_json(setup.run_dir.summary, summary)
    get_logger().info("%s", message)
    return summary


def _outcome(setup: RunSetup, state: TrainingState) -> dict[str, Any]:
    """What ran and what it reached: the run's names, its final loss and its evaluation."""
    run, grid, evaluation = setup.run, setup.grid, state.evaluation
    return {
        "status": "completed",
        "strategy": run.strategy.name,
        "optimizer": run.optimizer.name,
        "grid": {"pr": grid.pr, "pc": grid.pc},
        "world_size": grid.size,
        "comm_backend": run.comm.backend,
        "steps": run.trainer.steps,
        "final_loss": state.loss,
        "val_loss": evaluation["loss"] if evaluation else None,
        "val_accuracy": evaluation["accuracy"] if evaluation else None,
        # a language model's (next-token objective): exp(val_loss); None for a classifier
        "val_perplexity": evaluation.get("perplexity") if evaluation else None,
        # with a centre variable: val_* are the centre's, workers_val_* the replicas' mean
        "workers_val_loss": evaluation.get("workers_loss") if evaluation else None,
        "workers_val_accuracy": evaluation.get("workers_accuracy") if evaluation else None,
    }


def _timing(setup: RunSetup, state: TrainingState, wall: float,
            median_step: float) -> dict[str, Any]:
    """The step times measured and predicted, and the throughput of the median step."""
    seconds, predicted = state.history.seconds, setup.predicted_step
    batch_size = setup.run.trainer.batch_size
    tokens = setup.targets_per_sample  # a language model's sequence length; 1: a classifier
    return {
        "wall_time_s": wall,
        "mean_step_time_s": statistics.fmean(seconds),
        "median_step_time_s": median_step,
        "predicted_step_time_s": predicted.total_s if predicted is not None else None,
        "predicted_compute_time_s": predicted.compute_s if predicted is not None else None,
        # the part of the measured communication time that is waiting for peers sharing cores
        "predicted_wait_time_s": predicted.wait_s if predicted is not None else None,
        "samples_per_s": batch_size / median_step,
        # a language model's targets per second (batch × sequence length); None for a classifier
        "tokens_per_s": batch_size * tokens / median_step if tokens > 1 else None,
    }


def _communication(setup: RunSetup, state: TrainingState,
                   rates: list[float]) -> dict[str, Any]:
    """The bytes and seconds of a step's communication, measured and predicted, and every
    rank's steps per second."""
    history, costs, ops = state.history, setup.costs, setup.predicted_ops
    return {
        "comm_bytes_per_step": statistics.fmean(history.comm_bytes),
        "predicted_comm_bytes_per_step": step_bytes(ops) if ops is not None else None,
        "comm_time_s_per_step": statistics.fmean(history.comm_seconds),
        "predicted_comm_time_s_per_step": comm_seconds(ops, costs) if ops is not None else None,
        "alpha_beta": {"alpha": costs.alpha, "beta": costs.beta, "source": costs.source},
        "comm_time_share": sum(history.comm_seconds) / history.total_s,
        "steps_per_s_by_rank": rates,
    }


def _model_layout(setup: RunSetup, state: TrainingState) -> dict[str, Any]:
    """How the strategy laid the model out, and the memory it holds."""
    model = setup.model
    return {
        "sparse_exchange": model.exchange_report() or None,
        "layouts": getattr(model, "layouts", None),
        # a parallel plan by module name: the attention attributes it divided
        "plan_adjustments": getattr(model, "plan_adjustments", None),
        # where that plan came from: strategy.plan, the model's declared plan, or derived from
        # the module structure
        "plan_source": getattr(model, "plan_source", None),
        # strategy=auto on a module tree: what it chose and every candidate's predicted step
        "auto_choice": getattr(model, "auto_choice", None),
        "param_bytes_per_rank": model.param_bytes(),
        # rank 0's bytes for the model by what holds them, counted and predicted
        "memory_per_rank": held_memory(model, setup.optimizer),
        "predicted_memory_per_rank": setup.predicted_memory,
        # the most bytes of tensors kept for backward at once in a step, rank 0's largest
        "activation_bytes_peak": max(state.history.activation_bytes, default=None),
        "accumulate_steps": setup.run.trainer.accumulate_steps,
        # trainer.activation_checkpointing: the modules recomputed, and those a strategy rebuilt
        "activation_checkpointing": getattr(model, "recomputed", None),
        # trainer.compile: the modules compiled, compiled around and eager; the compile seconds
        "compile": model.compiled.report() if model.compiled is not None else None,
    }


def _provenance(setup: RunSetup, state: TrainingState) -> dict[str, Any]:
    """What repeats the run: its seed, the code's versions, where it began and where it left
    its checkpoint."""
    start = setup.start
    return {
        "seed": setup.run.seed,
        "versions": versions(),
        "git_commit": git_commit() if setup.grid.rank == 0 else None,
        "run_dir": str(setup.run_dir.path),
        "resumed_from": ({"checkpoint": str(start.checkpoint_path), "step": start.step}
                         if start.checkpoint is not None else None),
        "checkpoint": (str(state.last_checkpoint) if state.last_checkpoint is not None
                       else None),
    }


def completed_summary(setup: RunSetup, state: TrainingState, rates: list[float],
                      devices: list[str], wall: float) -> dict[str, Any]:
    """`summary.json` of a run that trained every step: `rates` (steps per second) and
    `devices` are every rank's, `wall` the seconds since the rank began."""
    run, grid = setup.run, setup.grid
    median_step = statistics.median(state.history.seconds)
    summary: dict[str, Any] = {**_outcome(setup, state),
                               **_timing(setup, state, wall, median_step),
                               **_communication(setup, state, rates),
                               **_model_layout(setup, state),
                               **_provenance(setup, state)}
    summary["objective"] = {"name": run.objective, "direction": OBJECTIVES[run.objective],
                            "value": summary[run.objective]}
    logged_loss = setup.optimizer.logged_loss() if grid.pc > 1 else "global batch"
    summary.update(logged_loss=logged_loss, devices=devices,
                   device_buffers=grid.devices.describe(grid.backend, grid.size),
                   precision=precision_summary(setup.precision, setup.scaler))
    summary.update(gpu_figures(setup, median_step))
    return summary


def objective_value(summary: dict[str, Any]) -> float:
    """What a completed run returns to a Hydra sweeper: its objective as a float (NaN when the
    run has no such value, e.g. workers_val_loss without a centre: Optuna records a failed
    trial)."""
    value = summary.get("objective", {}).get("value")
    return float("nan") if value is None else float(value)


def precision_summary(precision: Precision, scaler: DynamicLossScale | None) -> dict[str, Any]:
    """`trainer.precision` as run, with fp16's loss scale at the end and the steps it skipped."""
    record: dict[str, Any] = {"name": precision.name}
    if scaler is not None:
        record.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped_steps,
                      skipped=scaler.history[-20:])
    return record


# -- the GPU figures: FLOP/s per GPU, MFU, peak device memory ----------------------------------

# Dense peak FLOP/s of a GPU (no structured sparsity), (bf16, fp32), by a piece of the name torch
# gives it, the first that matches (lower case; the longer names first). From NVIDIA's data
# sheets. fp16 runs at bf16's rate; fp32 is the plain FP32 rate, which products run at while
# TF32 is off (`torch.backends.cuda.matmul.allow_tf32`, off by default).
GPU_PEAKS: tuple[tuple[str, str, float, float], ...] = (
    ("h200 nvl", "H200 NVL", 835e12, 60e12),
    ("h200", "H200 SXM", 989e12, 67e12),
    ("h100 nvl", "H100 NVL", 835e12, 60e12),
    ("h100 pcie", "H100 PCIe", 756e12, 51e12),
    ("h100", "H100 SXM", 989e12, 67e12),  # "NVIDIA H100 80GB HBM3"
    ("a100", "A100", 312e12, 19.5e12),  # SXM and PCIe alike
)


def gpu_peak(device_name: str, precision: str) -> tuple[float | None, str]:
    """The dense peak FLOP/s of the GPU named `device_name` (`torch.cuda.get_device_name`) in
    `precision` (fp32, bf16, fp16), and what it is ("H100 SXM bf16"); (None, "unknown") for a
    GPU not in GPU_PEAKS."""
    name = device_name.lower()
    for piece, label, half, single in GPU_PEAKS:
        if piece in name:
            return (single, f"{label} fp32") if precision == "fp32" else (
                half, f"{label} {precision}")
    return None, "unknown"


def utilisation(flops_per_step: float, step_s: float, gpus: int,
                peak: float | None) -> tuple[float, float | None]:
    """(FLOP/s per GPU, MFU): a step's model FLOPs per second of the step, shared by `gpus`
    GPUs, and that as a share of one GPU's `peak` (None where the peak is not known)."""
    per_gpu = flops_per_step / step_s / max(gpus, 1)
    return per_gpu, (per_gpu / peak if peak else None)


def _flop_counting_rates() -> ComputeRates:
    """Rates under which the compute model's seconds are FLOPs: a product or a convolution
    costs its flops (2·m·k·n; a convolution's gradients one forward each), everything else
    (passes over memory, dispatch, allocation, the per-step overheads) nothing."""
    one = make_curve([(1.0, 1.0)])
    return ComputeRates(
        gemm=make_gemm_table([(1.0, 1.0)]), conv=one, memory=math.inf, dispatch=0.0,
        gemm_narrow_output=1.0, linear_overhead=0.0, conv_narrow=one,
        conv_backward=(1.0, 1.0), conv_narrow_backward=(1.0, 1.0), conv_overhead=0.0,
        layers=tuple((kind, ((1.0, 0.0, 0.0),)) for kind in LAYER_KINDS),
        backward_start=0.0, fresh_memory=math.inf, step_overhead=0.0, source="flop count")


FLOP_COUNTING_RATES = _flop_counting_rates()


def model_flops_per_step(run: RunConfig) -> float:
    """The FLOPs of one training step of `run` as the compute model counts them: forward and
    backward of the whole model on the global batch, as one process would run them (what
    `strategy=data` prices at 1 × 1, at FLOP_COUNTING_RATES): matrix products and
    convolutions, attention's products with its backward as the model prices it; not the
    elementwise work, the update, a recomputation or what a split repeats on several ranks."""
    assembly.import_plugins(run)
    spec = assembly.build_dataset(run.dataset, assembly.objective_of(run.model)).spec()
    model = assembly.probe_model(run.model, spec, assembly.dtype_of(run))
    counting = STRATEGIES.get("data")(pricing=PricingContext(rates=FLOP_COUNTING_RATES))
    with torch.random.fork_rng(devices=[]):  # a probe's draws leave the run's alone
        return float(counting.predict_compute_seconds(model, tuple(spec.input_shape),
                                                      GridShape(1, 1), run.trainer.batch_size))


def gpu_figures(setup: RunSetup, median_step: float) -> dict[str, Any]:
    """The summary's GPU figures (null where a rank computed on the CPU: not measured).
    Collective over the world: every rank's host, device and peak allocation."""
    device = setup.device
    cuda = device.type == "cuda"
    mine = (socket.gethostname(), str(device),
            torch.cuda.max_memory_allocated(device) if cuda else None)
    ranks = setup.grid.world.allgather_object(mine)
    figures: dict[str, Any] = {"model_flops_per_step": None, "tflops_per_gpu": None,
                               "mfu": None, "gpu_peak": None, "gpus": None,
                               "device_memory_peak_bytes": None}
    if not cuda or any(peak is None for _, _, peak in ranks):
        return figures
    gpus = len({(host, name) for host, name, _ in ranks})  # ranks may share a GPU
    flops = model_flops_per_step(setup.run)
    peak, which = gpu_peak(torch.cuda.get_device_name(device), setup.precision.name)
    per_gpu, mfu = utilisation(flops, median_step, gpus, peak)
    figures.update(model_flops_per_step=flops, tflops_per_gpu=per_gpu / 1e12, mfu=mfu,
                   gpu_peak={"name": which, "tflops": None if peak is None else peak / 1e12},
                   gpus=gpus, device_memory_peak_bytes=max(int(p or 0) for _, _, p in ranks))
    return figures
