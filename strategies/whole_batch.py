"""A data-parallel forward that computes what couples the rows of a batch as one process does.

Most of a model treats each sample alone, and a rank holding 1/P of the batch computes its rows
exactly. Two kinds of operation do not: batch normalization (its statistics are over every
row) and random draws (one process draws the masks of all B rows from one generator, in one
call). Models nobody here wrote make both in their own code: timm's `BatchNormAct2d` calls
`F.batch_norm` itself, a stochastic-depth branch calls `x.new_empty((B, 1, 1, 1)).bernoulli_()`,
`nn.MultiheadAttention` drops attention weights inside `F.multi_head_attention_forward`. So
instead of replacing modules by type (which drops what a subclass adds), the forward of a
data-parallel model runs inside two of torch's modes, which see what the model's code does:

- `BatchStatistics` (a `TorchFunctionMode`: every torch function the code calls) reroutes
  `F.batch_norm` with batch statistics to the statistics of every rank's rows
  (`norm.SyncBatchNormFunction`, with its adjoint backward) and updates the running statistics
  with them by the caller's own momentum, as the native kernel does;
- `GlobalDraws` (a `TorchDispatchMode`: every operator, also inside composite functions and
  torch's reference attention) makes each random operator whose dim 0 is made of the batch's
  rows (B, or B·H when heads are folded into it) draw for the whole global batch, of which the
  rank keeps its rows. Every rank makes the same call on the same generator state as the one
  process did, so every generator stays where the one process's is. Which draws are made of
  rows is learned before training from two training forwards of 2 and 3 samples
  (`probe.draw_plan`): a dim 0 that grows with them. A draw of a fixed shape is the same on
  every rank and is left alone; one over rows in another dim (a sequence-first layout) is
  refused by validation, by module. The price: each rank draws the global batch's masks.

`DataParallel.parallelize` enters each mode only for a model that needs it (a training forward
of the model says so): a model of plain modules runs as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from runner.core import CountedComm
from strategies.norm import SyncBatchNormFunction
from strategies.probe import DrawPlan, is_random_op, op_name

_HALF = (torch.float16, torch.bfloat16)


class BatchStatistics(TorchFunctionMode):
    """Inside it, `F.batch_norm` with batch statistics normalizes by those of every rank of
    `comm`. `label` names the module whose call it is (set by a hook of that module)."""

    def __init__(self, comm: CountedComm) -> None:
        super().__init__()
        self.comm = comm
        self.label = "bn:functional"
        self.calls = 0  # calls rerouted

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self._batch_norm(*args, **kwargs)
        return func(*args, **kwargs)

    def _batch_norm(self, x: torch.Tensor, running_mean: torch.Tensor | None,
                    running_var: torch.Tensor | None, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, training: bool = False,
                    momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
        if not training:  # running statistics: nothing couples the rows
            kept: torch.Tensor = F.batch_norm(x, running_mean, running_var, weight, bias, False,
                                              momentum, eps)
            return kept
        self.calls += 1
        compute = x.float() if x.dtype in _HALF else x
        y, mean, var, count = SyncBatchNormFunction.apply(compute, weight, bias, self.comm, eps,
                                                          self.label)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                n = float(count.item())
                unbiased = var * (n / (n - 1)) if n > 1 else var
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype),
                                                     alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        out: torch.Tensor = y.to(x.dtype)
        return out


def _empty_globally(x: torch.Tensor, dim0: int) -> torch.Tensor:
    """An uninitialised tensor like `x` with `dim0` in dim 0, its dimensions laid out in memory
    in `x`'s order (so a draw walks its elements as a draw on the one process's tensor, which
    `empty_like` made with the same layout, does)."""
    shape = [dim0, *x.shape[1:]]
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: (-strides[d], d))
    base = x.new_empty([shape[d] for d in order])
    return base.permute([order.index(d) for d in range(x.dim())])


class GlobalDraws(TorchDispatchMode):
    """Inside it, this rank's forward of rows [`start`, `start` + `rows`) of a global batch of
    `global_rows` rows draws one process's random numbers, each random operator as `plan`
    (`probe.draw_plan`, learned from two training forwards) says: its dim 0 made of rows
    (`cuts[i]` entries a row), or a fixed shape left alone."""

    def __init__(self, plan: DrawPlan, start: int, rows: int, global_rows: int) -> None:
        super().__init__()
        self.cuts = plan.cuts
        self.start, self.rows, self.global_rows = start, rows, global_rows
        self.calls = 0  # random operators seen in this forward

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = op_name(func)
        if name.startswith(_FUSED_ATTENTION) and _dropout_p(args, kwargs) > 0:
            raise RandomDrawError(f"{func} drops attention weights inside one fused kernel, "
                                  f"which no rank can cut into one process's rows; select "
                                  f"torch's math attention backend, or set the dropout to 0")
        if not is_random_op(func):
            return func(*args, **kwargs)
        index, self.calls = self.calls, self.calls + 1
        if index >= len(self.cuts):
            raise RandomDrawError(f"{func}: more random draws in this forward than in the "
                                  f"forwards it was planned from ({len(self.cuts)})")
        per_row = self.cuts[index]
        if per_row is None or kwargs.get("generator") is not None:
            return func(*args, **kwargs)  # a fixed shape, or a generator of the model's own
        whole = self.global_rows * per_row
        mine = slice(self.start * per_row, (self.start + self.rows) * per_row)
        first = args[0] if args else None
        if name.endswith("_") and isinstance(first, torch.Tensor):
            drawn = _empty_globally(first, whole)
            func(drawn, *args[1:], **kwargs)
            first.copy_(drawn[mine])
            return first
        if name == "native_dropout" and isinstance(first, torch.Tensor):
            p = args[1] if len(args) > 1 else kwargs["p"]
            _, mask = func(_empty_globally(first, whole).fill_(1), *args[1:], **kwargs)
            keep = mask[mine]
            return first * keep * (1.0 / (1.0 - p)), keep
        if name in ("bernoulli", "rand_like", "randn_like") and isinstance(first, torch.Tensor):
            drawn = _empty_globally(first, whole)
            if name == "bernoulli":  # a probability per element, one draw each whatever it is
                drawn.fill_(0.5)[mine] = first
            return func(drawn, *args[1:], **kwargs)[mine]
        if name in ("rand", "randn"):
            return func([whole, *list(args[0])[1:]], *args[1:], **kwargs)[mine]
        raise RandomDrawError(f"{func} draws over the batch's rows, which no rank can cut "
                              f"into one process's")


_FUSED_ATTENTION = ("_scaled_dot_product_flash", "_scaled_dot_product_efficient",
                    "_scaled_dot_product_cudnn", "_flash_attention", "_efficient_attention")


def _dropout_p(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The dropout probability a fused attention operator was given (0.0: none)."""
    if "dropout_p" in kwargs:
        return float(kwargs["dropout_p"])
    numbers = [a for a in args[3:6] if isinstance(a, float)]
    return numbers[0] if numbers else 0.0


class RandomDrawError(RuntimeError):
    """A random draw over the batch's rows that no rank can cut out of the global batch's."""
