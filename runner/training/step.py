"""One training step, the same on every rank for every strategy and optimizer.

Rows: each rank is fed its batch group's rows and scores its own sub-shard of them (the row
contract in `strategies/base.py`); its loss is (P/B) × the sum over its rows, so the mean over the
P ranks is the global mean loss for any split of the rows. With `trainer.accumulate_steps` = N
those rows come as N micro-batches, each scored the same way (still P/B: their sums add up to
the step's), their gradients summed locally and exchanged once, from the last one's backward.

Host synchronisations: a step reads nothing from the device unless it must. Its loss is read
only where the loop asks (`read_loss`: logged steps and the few others `runner.training.loop`
names), through a copy queued right after the last forward (`HostCopy`), so the wait covers
the forward alone and the backward keeps the device busy meanwhile. fp16 reads one flag every
step: whether any gradient overflowed, which decides on the host whether the update is
skipped (its loss, when read, comes in the same copy). Everything else the step decides on
(the stop request, the collective skip) is a host fact, all-reduced in host memory.
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
from runner.training.state import DeviceStepTimes, RunSetup
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


def host_values(buffer: torch.Tensor) -> list[float]:
    """The values of a buffer held in host memory (a collective's control values): read
    through NumPy, which refuses a device tensor, so a read here can never wait for a device."""
    if buffer.device.type != "cpu":
        raise ValueError(f"host_values reads host buffers only, not {buffer.device} tensors")
    values: list[float] = buffer.to(torch.float64).numpy().tolist()  # host: checked above
    return values


class HostCopy:
    """Device scalars on their way to the host. The copy is queued on the device's stream at
    once (non-blocking, into page-locked memory, on a GPU; on the CPU the values are already on
    the host) and `values` waits for that copy alone, not for the work queued after it."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        dtype = tensors[0].dtype  # 0/1 flags are exact in any floating type
        packed = torch.stack([t.detach().reshape(()).to(dtype) for t in tensors])
        self._done: torch.cuda.Event | None = None
        self._host = packed
        if packed.device.type == "cuda":
            # host: page-locked, the device's copy lands here
            self._host = torch.empty(packed.shape, dtype=dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(packed.device))

    def values(self) -> list[float]:
        """The values: the step's one wait for the device (where it has one)."""
        if self._done is not None:
            self._done.synchronize()
        values: list[float] = self._host.tolist()
        return values


def reduce_control(loss: float | None, dtype: torch.dtype, comm: CountedComm, stop: bool,
                   overflow: bool | None = None) -> tuple[float | None, bool, bool]:
    """One all-reduce over `comm`, in host memory: the mean over its ranks of `loss` (each the
    (P/B)-scaled sum of its rows: over the world the global batch's mean, over a model group
    that replica's rows), whether any rank was asked to stop and (fp16: `overflow` given)
    whether any rank's gradients overflowed, so that they all stop, or skip, at the same step.
    `loss` None: not read this step (on every rank alike); its slot travels all the same, so
    every step moves the bytes the planner predicts."""
    if comm.size == 1:  # nothing to agree on: no buffer to build and read back
        return loss, stop, bool(overflow)
    values = [0.0 if loss is None else loss, float(stop)]
    values += [] if overflow is None else [float(overflow)]
    buffer = torch.tensor(values, dtype=dtype)  # host: control (and, when read, the loss)
    comm.allreduce_(buffer, label="loss")
    reduced = host_values(buffer)
    mean = None if loss is None else reduced[0] / comm.size
    return mean, bool(reduced[1]), overflow is not None and bool(reduced[2])


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
                total = loss.detach() if total is None else total + loss.detach()
                (loss if scaler is None else loss * scaler.scale).backward()
    model.finish_gradient_sync()
    assert total is not None, "a step has at least one micro-batch"
    return total


def train_step(setup: RunSetup, feeds: Sequence[Feed], step: int, loss_comm: CountedComm,
               stop_requested: bool, *, meter: SavedTensorMeter | None = None,
               read_loss: bool = True, device_times: DeviceStepTimes | None = None
               ) -> tuple[float | torch.Tensor, bool]:
    """Step `step` (1-based): the gradients of its micro-batches, then the replica optimizer's
    update and one all-reduce over `loss_comm`, in host memory, for the mean loss, whether any
    rank is stopping and (fp16) whether any rank's gradients overflowed, so that every rank
    skips the update alike (fp16 reduces before the update). Returns the mean loss, or with
    `read_loss` False (the same on every rank of `loss_comm`) this rank's loss unread, on its
    device; and whether to stop. `device_times` marks the end of the step's work on the device.

    Waits for the device once when `read_loss` (for the loss's copy, queued after the update:
    the step's one wait covers its whole work, as a loop's `loss.item()` after its optimizer's
    step does), once under fp16 (for the overflow flag, with the loss's copy when read, before
    the update), and otherwise never."""
    debug, scaler = setup.debug, setup.scaler
    if debug.slow_rank == setup.rank and debug.slow_seconds:  # a straggler on purpose
        time.sleep(debug.slow_seconds)
    loss = forward_backward_step(setup, feeds, step, meter)
    local: float | None = None
    if scaler is None:
        setup.optimizer.step(step - 1)
        if device_times is not None:
            device_times.end()
        local = HostCopy([loss]).values()[0] if read_loss else None
        mean, stopping, _ = reduce_control(local, loss.dtype, loss_comm, stop_requested)
        return (loss if mean is None else mean), stopping
    found = scaler.unscale_found(setup.model.parameters())
    if found is None:  # no gradients on this rank: nothing overflowed
        overflow = False
        local = HostCopy([loss]).values()[0] if read_loss else None
    else:  # one wait for the flag and, when read, the loss
        values = HostCopy([loss, found] if read_loss else [found]).values()
        local, overflow = (values[0] if read_loss else None), bool(values[-1])
    mean, stopping, overflowed = reduce_control(local, loss.dtype, loss_comm, stop_requested,
                                                overflow)
    scaler.update(step, overflowed)
    if not overflowed:
        setup.optimizer.step(step - 1)
    if device_times is not None:
        device_times.end()
    return (loss if mean is None else mean), stopping
