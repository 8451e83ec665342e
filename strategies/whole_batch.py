"""A data-parallel forward that computes what couples the rows of a batch as one process does.

Most of a model treats each sample alone, and a rank holding 1/P of the batch computes its rows
exactly. Two kinds of operation do not: batch normalization (its statistics are over every
row) and random draws (one process draws the masks of all B rows from one generator, in one
call). Models nobody here wrote make both in their own code: timm's `BatchNormAct2d` calls
`F.batch_norm` itself, a stochastic-depth branch calls `x.new_empty((B, 1, 1, 1)).bernoulli_()`.
So instead of replacing modules by type (which would drop what a subclass adds), the forward of
a data-parallel model runs inside `WholeBatch`, a `TorchFunctionMode` that sees every torch
call the model's code makes and reroutes just these:

- `F.batch_norm` with batch statistics: the statistics of every rank's rows
  (`norm.SyncBatchNormFunction`, with its adjoint backward), the running statistics updated
  with them by the module's own momentum, as the native kernel does;
- dropout (`F.dropout`, `dropout1d/2d/3d`, the attention weights' dropout of
  `F.scaled_dot_product_attention`) and in-place Bernoulli, uniform and normal draws on a
  tensor whose dim 0 is this rank's rows: the draws of the whole global batch (every rank makes
  the same call on the same generator state, as the one process did), of which this rank keeps
  its rows. Every rank's generator then stays where the one process's is.

A draw on a tensor whose dim 0 is not the batch (a sequence-first layout) cannot be cut into
rows: it is refused when it happens, by the shape it had.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from runner.core import CountedComm
from strategies.norm import SyncBatchNormFunction

# dropout functions whose output is the input times a mask scaled by 1/(1 - p)
_MASKED = {F.dropout: "dropout", F.dropout1d: "dropout1d", F.dropout2d: "dropout2d",
           F.dropout3d: "dropout3d"}
# in-place draws of a whole tensor
_IN_PLACE_DRAWS = {torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_}


class RandomDrawError(RuntimeError):
    """A random draw whose rows are not the batch's."""


def _like_globally(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A tensor of ones shaped like `x` with `rows` rows in dim 0, laid out in memory in the
    same order of dimensions (so a draw on it walks the elements as a draw on the one process's
    tensor does)."""
    shape = [rows, *x.shape[1:]]
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: (-strides[d], d))
    base = x.new_ones([shape[d] for d in order])
    inverse = [order.index(d) for d in range(x.dim())]
    return base.permute(inverse)


class WholeBatch(TorchFunctionMode):
    """Inside it, this rank's forward of rows [`start`, `start` + `rows`) of a global batch of
    `global_rows` computes batch statistics over `comm` (when given: `None` leaves them to the
    modules, as `batch_norm=local` asks) and one process's random draws."""

    def __init__(self, comm: CountedComm | None, start: int, rows: int,
                 global_rows: int) -> None:
        super().__init__()
        self.comm, self.start, self.rows, self.global_rows = comm, start, rows, global_rows
        self.batch_norms = 0  # calls rerouted (for tests and the log)
        self.draws = 0
        self.label = "bn:functional"  # the module whose F.batch_norm runs (set by its hook)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm and self.comm is not None:
            return self._batch_norm(*args, **kwargs)
        if func in _MASKED:
            return self._masked(func, *args, **kwargs)
        if func in _IN_PLACE_DRAWS and args and isinstance(args[0], torch.Tensor):
            return self._in_place(func, args[0], *args[1:], **kwargs)
        if func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0.0:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _mine(self, drawn: torch.Tensor) -> torch.Tensor:
        return drawn[self.start:self.start + self.rows]

    def _check_rows(self, x: torch.Tensor, what: str) -> None:
        if x.dim() == 0 or x.shape[0] != self.rows:
            raise RandomDrawError(
                f"{what} on a tensor of shape {tuple(x.shape)}, whose dim 0 is not this rank's "
                f"{self.rows} rows of the batch: strategy=data cannot reproduce one process's "
                f"draws (make the batch dim 0, or set the rate to 0)")

    def _masked(self, func: Callable[..., Any], x: torch.Tensor, p: float = 0.5,
                training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            kept: torch.Tensor = func(x, p, training, inplace)
            return kept
        self._check_rows(x, _MASKED[func])
        self.draws += 1
        # the one process's mask, already scaled: dropout of ones
        mask = self._mine(func(_like_globally(x, self.global_rows), p, True, False))
        out: torch.Tensor = x.mul_(mask) if inplace else x * mask
        return out

    def _in_place(self, func: Callable[..., Any], x: torch.Tensor, *args: Any,
                  **kwargs: Any) -> torch.Tensor:
        if "generator" in kwargs and kwargs["generator"] is not None:
            own: torch.Tensor = func(x, *args, **kwargs)  # the model's own generator
            return own
        self._check_rows(x, f"Tensor.{func.__name__}")
        self.draws += 1
        drawn = func(torch.empty_like(_like_globally(x, self.global_rows)), *args, **kwargs)
        with torch.no_grad():
            x.copy_(self._mine(drawn))
        return x

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        """Attention with dropout on its weights, as torch's reference (math) kernel computes
        it, the weights' mask drawn for the global batch (a fused kernel draws inside, where no
        rank could cut its rows out)."""
        self._check_rows(q, "scaled_dot_product_attention(dropout_p > 0)")
        self.draws += 1
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None
                                              else 1.0 / math.sqrt(q.shape[-1]))
        if is_causal:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,
                                device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf"))
                      if attn_mask.dtype == torch.bool else scores + attn_mask)
        weights = torch.softmax(scores, dim=-1)
        mask = self._mine(torch.dropout(_like_globally(weights, self.global_rows), dropout_p,
                                        True))
        out: torch.Tensor = (weights * mask) @ v
        return out

    def _batch_norm(self, x: torch.Tensor, running_mean: torch.Tensor | None,
                    running_var: torch.Tensor | None, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, training: bool = False,
                    momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
        if not training:  # running statistics: nothing couples the rows
            return F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum,
                                eps)
        assert self.comm is not None
        self.batch_norms += 1
        compute = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
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
