"""One training step, the same on every rank for every strategy and optimizer.

Rows: each rank is fed its batch group's rows and scores its own sub-shard of them (the row
contract in `strategies/base.py`); its loss is (P/B) × the sum over its rows, so the mean over the
P ranks is the global mean loss for any split of the rows. With `trainer.accumulate_steps` = N
those rows come as N micro-batches, each scored the same way (still P/B: their sums add up to
the step's), their gradients summed locally and exchanged once, from the last one's backward.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runner.core import CountedComm
from runner.training.memory import SavedTensorMeter
from runner.training.state import RunSetup
from strategies.base import MicroBatch


class InjectedFailure(RuntimeError):
    """Raised on purpose by `debug.fail_at_step` (tests of failure handling)."""


class StepFailure(RuntimeError):
    """A failure every rank meets at the same step (a non-finite loss, a checkpoint that could
    not be written): the job ends without any rank having to abort the others."""


class ReplicaFailure(RuntimeError):
    """A failure one replica meets alone (a non-finite loss on a step where the replicas did
    not meet): its rank ends the job for everyone (an abort)."""


def inject_failure(mode: str, rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
    """`debug.fail_mode` on this rank at this step: what a test of failure handling needs."""
    if mode == "raise":
        raise InjectedFailure(f"injected failure on rank {rank} at step {step} "
                              f"(debug.fail_at_step)")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":  # outside any collective: the other ranks wait in their next one
        while True:
            time.sleep(3600)
    if mode == "nan":
        return loss * float("nan")
    return loss


def mean_loss(loss: torch.Tensor, comm: CountedComm, stop: bool,
              overflow: bool | None = None) -> tuple[float, bool, bool]:
    """The mean over the rows of the ranks of `comm` (the mean of their (P/B)-scaled sums: over
    the world the global batch, over a model group that replica's rows), whether any of them
    was asked to stop, and (fp16: `overflow` given) whether any of their gradients overflowed:
    one all-reduce, so they all stop, or skip, at the same step."""
    values = [loss.item(), float(stop)] + ([] if overflow is None else [float(overflow)])
    buffer = torch.tensor(values, dtype=loss.dtype)  # host: control (and the logged loss)
    comm.allreduce_(buffer, label="loss")
    overflowed = overflow is not None and bool(buffer[2].item())
    return buffer[0].item() / comm.size, bool(buffer[1].item()), overflowed


@dataclass(frozen=True)
class Feed:
    """What one forward of a step is fed: this rank's inputs and its outputs' targets, and
    which micro-batch of the step they are (None: the whole step's rows)."""

    x: torch.Tensor
    y: torch.Tensor
    micro: MicroBatch | None = None


def forward_backward_step(setup: RunSetup, feeds: Sequence[Feed], step: int,
                          meter: SavedTensorMeter | None = None) -> torch.Tensor:
    """For each micro-batch: forward and loss (under the precision's autocast), backward (of
    the loss times fp16's scale), its gradients summed into the last's; the gradient
    exchanges the last micro-batch's backward started, completed. Returns the step's loss, the
    sum over the micro-batches (unscaled; float32 under autocast, whose cross-entropy is
    float32). `meter` counts the tensors kept for backward."""
    model, debug, scaler = setup.model, setup.debug, setup.scaler
    model.zero_grad()
    total: torch.Tensor | None = None
    with meter.step() if meter is not None else contextlib.nullcontext():
        for feed in feeds:
            with (model.feeding(feed.micro) if feed.micro is not None
                  else contextlib.nullcontext()):
                with setup.precision.autocast():
                    loss = model.score(model(feed.x), feed.y).loss_sum * setup.loss_scale
                if (debug.fail_at_step == step and setup.rank == debug.fail_on_rank
                        and total is None):
                    loss = inject_failure(debug.fail_mode, setup.rank, step, loss)
                (loss if scaler is None else loss * scaler.scale).backward()
            total = loss.detach() if total is None else total + loss.detach()
    model.finish_gradient_sync()
    assert total is not None, "a step has at least one micro-batch"
    return total


def train_step(setup: RunSetup, feeds: Sequence[Feed], step: int, loss_comm: CountedComm,
               stop_requested: bool, meter: SavedTensorMeter | None = None
               ) -> tuple[float, bool]:
    """Step `step` (1-based): the gradients of its micro-batches, then one all-reduce over
    `loss_comm` for the mean loss, whether any rank is stopping and (fp16) whether any rank's
    gradients overflowed, then the replica optimizer's update (skipped by every rank on an
    overflow)."""
    debug, scaler = setup.debug, setup.scaler
    if debug.slow_rank == setup.rank and debug.slow_seconds:  # a straggler on purpose
        time.sleep(debug.slow_seconds)
    loss = forward_backward_step(setup, feeds, step, meter)
    overflow = None if scaler is None else scaler.unscale(setup.model.parameters())
    mean, stopping, overflowed = mean_loss(loss, loss_comm, stop_requested, overflow)
    if scaler is not None:
        scaler.update(step, overflowed)
    if not overflowed:
        setup.optimizer.step(step - 1)
    return mean, stopping
