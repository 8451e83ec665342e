"""What a run leaves in its records: the metrics line's extras, `summary.json`
(README, "Run directory": every key is part of the contract other tools read)."""

from __future__ import annotations

import statistics
from typing import Any

from runner.checkpoint.resume import resume_command
from runner.config.schema import OBJECTIVES
from runner.core.cost import comm_seconds, step_bytes
from runner.records.logs import get_logger
from runner.records.rundir import git_commit, versions, write_json
from runner.training.memory import held_memory
from runner.training.precision import DynamicLossScale, Precision
from runner.training.state import RunSetup, TrainingState
from strategies import ParallelModel


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


def completed_summary(setup: RunSetup, state: TrainingState, rates: list[float],
                      devices: list[str], wall: float) -> dict[str, Any]:
    """`summary.json` of a run that trained every step: `rates` (steps per second) and
    `devices` are every rank's, `wall` the seconds since the rank began."""
    run, grid, model, costs = setup.run, setup.grid, setup.model, setup.costs
    history, evaluation, start = state.history, state.evaluation, setup.start
    predicted_ops, predicted_step = setup.predicted_ops, setup.predicted_step
    tokens = setup.targets_per_sample  # a language model's sequence length; 1: a classifier
    median_step = statistics.median(history.seconds)
    summary: dict[str, Any] = {
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
        "wall_time_s": wall,
        "mean_step_time_s": statistics.fmean(history.seconds),
        "median_step_time_s": median_step,
        "predicted_step_time_s": (predicted_step.total_s if predicted_step is not None
                                  else None),
        "predicted_compute_time_s": (predicted_step.compute_s if predicted_step is not None
                                     else None),
        # the part of the measured communication time that is waiting for peers sharing cores
        "predicted_wait_time_s": (predicted_step.wait_s if predicted_step is not None
                                  else None),
        "samples_per_s": run.trainer.batch_size / median_step,
        # a language model's targets per second (batch × sequence length); None for a classifier
        "tokens_per_s": (run.trainer.batch_size * tokens / median_step if tokens > 1 else None),
        "comm_bytes_per_step": statistics.fmean(history.comm_bytes),
        "predicted_comm_bytes_per_step": (step_bytes(predicted_ops)
                                          if predicted_ops is not None else None),
        "comm_time_s_per_step": statistics.fmean(history.comm_seconds),
        "predicted_comm_time_s_per_step": (comm_seconds(predicted_ops, costs)
                                           if predicted_ops is not None else None),
        "alpha_beta": {"alpha": costs.alpha, "beta": costs.beta, "source": costs.source},
        "comm_time_share": sum(history.comm_seconds) / history.total_s,
        "steps_per_s_by_rank": rates,
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
        "activation_bytes_peak": max(history.activation_bytes, default=None),
        "accumulate_steps": run.trainer.accumulate_steps,
        # trainer.activation_checkpointing: the modules recomputed, and those a strategy rebuilt
        "activation_checkpointing": getattr(model, "recomputed", None),
        "seed": run.seed,
        "versions": versions(),
        "git_commit": git_commit() if grid.rank == 0 else None,
        "run_dir": str(setup.run_dir.path),
        "resumed_from": ({"checkpoint": str(start.checkpoint_path), "step": start.step}
                         if start.checkpoint is not None else None),
        "checkpoint": (str(state.last_checkpoint) if state.last_checkpoint is not None
                       else None),
    }
    summary["objective"] = {"name": run.objective, "direction": OBJECTIVES[run.objective],
                            "value": summary[run.objective]}
    logged_loss = setup.optimizer.logged_loss() if grid.pc > 1 else "global batch"
    summary.update(logged_loss=logged_loss, devices=devices,
                   device_buffers=grid.devices.describe(grid.backend, grid.size),
                   precision=precision_summary(setup.precision, setup.scaler))
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
