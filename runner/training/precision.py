"""Mixed precision: `trainer.precision` = fp32 | bf16 | fp16.

bf16 and fp16 run the forward and the loss under `torch.autocast` on the run's device: matrix
products and convolutions in the half type, the parameters, their gradients and the optimizer's
state in float32. The dataset's floating inputs are stored in the half type (the first layer's
autocast would cast them anyway): every activation a strategy moves between ranks, and its
gradient, is then a half-type tensor from the first layer on, half the bytes of float32, and the
planner prices them so (the strategies' `compute_dtype`).

fp16's narrow range needs loss scaling (`DynamicLossScale`): the loss is multiplied by S before
the backward, the gradients are divided by S after their exchange, and a step whose gradients hold
an inf or NaN on any rank is skipped on every rank (the flag travels in the step's loss
all-reduce), S halved; after `growth_interval` good steps in a row S doubles. The same rule as
`torch.amp.GradScaler`, written here because gridrun's replica optimizers are not `torch.optim`
optimizers and the overflow decision must be one collective decision across ranks.

The skip is decided on the host, so an fp16 step waits for the device once, for the flag
(`unscale_found` itself reads nothing): skipping on the device instead would need every replica
optimizer to mask its update and its state (momenta, Adam's step count) by a device flag, and
GradScaler itself reads the flag on the host too, except for fused optimizers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

HALF_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """A run's `trainer.precision` on its device."""

    name: str  # fp32, bf16, fp16
    device_type: str  # cpu, cuda

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast type (None: fp32, no autocast)."""
        return HALF_TYPES.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's context: autocast to the half type, or nothing."""
        dtype = self.compute_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def input_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype floating inputs are stored in: the half type, else the run's `dtype`."""
        return self.compute_dtype or dtype

    def loss_scale(self) -> DynamicLossScale | None:
        return DynamicLossScale() if self.name == "fp16" else None


@dataclass
class DynamicLossScale:
    """fp16's loss scale (see the module docstring)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0
    history: list[int] = field(default_factory=list)  # the steps skipped (for the summary)

    def unscale_found(self, parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
        """Divide every gradient by the scale, on their device, reading nothing: returns a
        one-element float32 flag on that device, nonzero when one of this rank's gradients
        holds an inf or NaN (None: this rank holds no gradient)."""
        grads = []
        for p in parameters:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:  # its values, in place (a coalesced copy would be lost)
                if not grad.is_coalesced():
                    p.grad = grad = grad.coalesce()
                grad = grad._values()
            grads.append(grad)
        if not grads:
            return None
        found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        inverse = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=found.device)
        for dtype_grads in _by_device_and_dtype(grads):
            torch._amp_foreach_non_finite_check_and_unscale_(dtype_grads, found, inverse)
        return found

    def unscale(self, parameters: Iterable[torch.nn.Parameter]) -> bool:
        """`unscale_found`, and the flag read at once (one wait for the device)."""
        found = self.unscale_found(parameters)
        return found is not None and bool(found.item())

    def update(self, step: int, overflow: bool) -> None:
        """After the step's collective decision: back off on overflow, else grow in time."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            self.history.append(step)
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


def _by_device_and_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The foreach kernel wants one device and one dtype per call."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return list(groups.values())
