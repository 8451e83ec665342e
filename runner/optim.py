"""Replica optimizers: how the batch replicas (the `Pc` dimension) agree.

`sgd` is the synchronous baseline: the strategy averages gradients over the replicas every step,
then every rank applies the same SGD update to its shard, so replicas stay identical. The elastic
averaging family lives in `easgd.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch.optim.sgd import sgd

from runner.core import ProcessGrid
from runner.registry import register_optimizer
from strategies import ParallelModel


def scheduled_lr(base_lr: float, step: int, total_steps: int, schedule: str,
                 warmup_steps: int) -> float:
    """Learning rate for 0-based `step`: linear warm-up, then constant or cosine decay to 0."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        return 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup_steps) / span))
    return base_lr


class ReplicaOptimizer:
    """Base of the `optimizer` config group. Built with the parallel model, the grid and the
    number of steps; `step(i)` runs after the backward of 0-based step i."""

    syncs_gradients: ClassVar[bool] = True  # the strategy all-reduces replica gradients
    # Replicas never wait for each other: the training loop must not add a collective over
    # replicas to a step (the logged loss is then replica 0's).
    asynchronous: ClassVar[bool] = False
    has_centre: ClassVar[bool] = False  # evaluation also scores a centre variable
    # Replicas' weights differ (the EASGD family): a checkpoint keeps each replica's own.
    per_replica: ClassVar[bool] = False

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 **options: Any) -> None:
        """Subclasses take their options as keyword arguments with defaults: their signature
        is their schema (`runner.options`)."""

    @staticmethod
    def check(*args: Any, **options: Any) -> list[str]:
        """Every problem with these options, given whole (the constructor's defaults filled in
        for the ones the config leaves out: the defaults live in `__init__` alone)."""
        return []

    def step(self, step: int) -> None:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        raise NotImplementedError

    @contextmanager
    def centre_weights(self) -> Iterator[None]:
        """Inside the block the model holds the centre variable (when `has_centre`)."""
        raise NotImplementedError
        yield

    def close(self) -> None:
        """Collective over all ranks: release what the optimizer holds (MPI windows)."""

    # -- what a checkpoint keeps ------------------------------------------------------------

    def state_kinds(self) -> tuple[str, ...]:
        """The kinds of per-parameter state this optimizer keeps (momentum, velocity)."""
        return ()

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        """Per kind, one tensor per model parameter, in `model.parameters()` order (None where
        there is none yet)."""
        return {}

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        """Restore what `param_states` returned (re-sharded to this rank's parameters)."""


@register_optimizer("sgd")
class SynchronousSGD(ReplicaOptimizer):
    """Synchronous SGD with optional momentum, Nesterov and weight decay: PyTorch's SGD rule,
    through its functional form (`torch.optim.sgd.sgd`). The `torch.optim.SGD` class would add
    nothing but its wrapper, whose first use imports torch._dynamo and sympy: 1-2 s of every
    rank's start-up."""

    SCHEDULES = ("constant", "cosine")

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, schedule: str = "constant",
                 warmup_steps: int = 0) -> None:
        self.base_lr, self.current_lr, self.total_steps = lr, lr, total_steps
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        self.schedule, self.warmup_steps = schedule, warmup_steps
        self.params = list(model.parameters())
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)
        # Momentum and weight decay move every row of an embedding table every step: its
        # row-sparse gradient (after a sparse exchange) is then applied densely. PyTorch's own
        # sparse momentum would concatenate rows without end and slow down step after step.
        self.dense_update = momentum > 0 or weight_decay > 0

    @staticmethod
    def check(lr: float, momentum: float, weight_decay: float, nesterov: bool, schedule: str,
              warmup_steps: int) -> list[str]:
        errors = []
        if not lr > 0:
            errors.append(f"optimizer.lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            errors.append(f"optimizer.momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            errors.append(f"optimizer.weight_decay must be >= 0, got {weight_decay}")
        if nesterov and momentum == 0:
            errors.append("optimizer.nesterov needs optimizer.momentum > 0")
        if schedule not in SynchronousSGD.SCHEDULES:
            known = ", ".join(SynchronousSGD.SCHEDULES)
            errors.append(f"optimizer.schedule must be one of {known}, got '{schedule}'")
        if warmup_steps < 0:
            errors.append(f"optimizer.warmup_steps must be >= 0, got {warmup_steps}")
        return errors

    def step(self, step: int) -> None:
        self.current_lr = scheduled_lr(self.base_lr, step, self.total_steps, self.schedule,
                                       self.warmup_steps)
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = []
        for i in with_grad:
            grad = self.params[i].grad
            assert grad is not None
            grads.append(grad.to_dense() if self.dense_update and grad.is_sparse else grad)
        buffers = [self.momentum_buffers[i] for i in with_grad]
        with torch.no_grad():
            sgd([self.params[i] for i in with_grad], grads, buffers,
                has_sparse_grad=any(g.is_sparse for g in grads), foreach=None,
                weight_decay=self.weight_decay, momentum=self.momentum, lr=self.current_lr,
                dampening=0.0, nesterov=self.nesterov, maximize=False)
        for i, buffer in zip(with_grad, buffers, strict=True):
            self.momentum_buffers[i] = buffer

    @property
    def lr(self) -> float:
        return float(self.current_lr)

    def state_kinds(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        return {"momentum": list(self.momentum_buffers)} if self.momentum else {}

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        for i, buffer in enumerate(states.get("momentum", [])[:len(self.params)]):
            if buffer is not None:
                self.momentum_buffers[i] = buffer
