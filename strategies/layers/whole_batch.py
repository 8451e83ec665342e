"""A data-parallel forward that computes what couples the rows of a batch as one process does.

Most of a model treats each sample alone, and a rank holding 1/P of the batch computes its rows
exactly. Two kinds of operation do not: batch normalization (its statistics are over every
row) and random draws (one process draws the masks of all B rows from one generator in one
call, which no rank holding some of the rows can repeat for its own). Models nobody here wrote
make both in their own code: timm's `BatchNormAct2d` calls `F.batch_norm` itself, a
stochastic-depth branch calls `x.new_empty((B, 1, 1, 1)).bernoulli_()`, `nn.MultiheadAttention`
drops attention weights inside `F.multi_head_attention_forward`. So instead of replacing
modules by type (which drops what a subclass adds), the forward of a data-parallel model runs
inside two of torch's modes, which see what the model's code does:

- `BatchStatistics` (a `TorchFunctionMode`: every torch function the code calls) reroutes
  `F.batch_norm` with batch statistics to the statistics of every rank's rows
  (`norm.SyncBatchNormFunction`, with its adjoint backward) and updates the running statistics
  with them by the caller's own momentum, as the native kernel does;
- `RowDraws` (a `TorchDispatchMode`: every operator, also inside composite functions and
  torch's reference attention) draws each random operator over the batch's rows (dim 0 of B,
  or of B·H where heads are folded into it) row by row, global row r of the forward's i-th draw
  from a generator seeded by (the forward's key, i, r). A row's masks are then the same
  whichever rank holds it: P ranks draw what one process draws, each rank its own rows only,
  at a cost that does not grow with P. `F.scaled_dot_product_attention` runs as torch's math
  attention inside it (`probe.math_attention`): a fused GPU kernel draws its dropout mask
  inside itself, which no rank can cut. The forward's key is one number from the run's
  generator, drawn alike on every rank and in one process, so the run's generator (and a
  checkpoint of it) stays in step everywhere. Which draws are over rows is learned before
  training from two training forwards of 2 and 3 samples (`probe.draw_plan`): a dim 0 that
  grows with them. A draw of a fixed shape comes from the run's generator, the same on every
  rank; one over rows in another dim (a sequence-first layout) is refused by validation, by
  module. These are gridrun's masks, at every P: not the ones torch's generator would draw
  for the whole batch in one call (the same distribution, other numbers).

`DataParallel.parallelize` enters each mode only for a model that needs it (a training forward
of the model says so): a model of plain modules runs as it is. `RowDraws` runs in one process
too, so that one process is what P ranks reproduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from runner.core import CountedComm, ProcessGrid
from strategies.base import ParallelModel
from strategies.layers.norm import global_batch_norm
from strategies.probe import DrawPlan, is_random_op, math_attention, op_name


class BatchStatistics(TorchFunctionMode):
    """Inside it, `F.batch_norm` with batch statistics normalizes by those of every rank of
    `comm`. `label` names the module whose call it is (set by a hook of that module)."""

    def __init__(self, comm: CountedComm) -> None:
        super().__init__()
        self.comm = comm
        self.label = "bn:functional"

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
        return global_batch_norm(x, running_mean, running_var, weight, bias, momentum, eps,
                                 self.comm, self.label)


def forward_key() -> int:
    """The key of one training forward's draws: a number from the run's host generator (every
    rank, and one process, draws the same number: the generator stays in step everywhere)."""
    return int(torch.randint(0, 2**62, (1,)).item())  # host: a key from the host generator


class RowDraws(TorchDispatchMode):
    """Inside it, this rank's forward of rows [`start`, `start` + `rows`) of the global batch
    draws each random operator that `plan` (`probe.draw_plan`) says is over the batch's rows
    row by row: global row r of draw i from a generator seeded by (`key`, i, r). A row's masks
    are then the same whichever rank holds it, at every P and in one process, and each rank
    draws its rows only. Draws of a fixed shape come from the run's generator as they are."""

    def __init__(self, plan: DrawPlan, key: int, start: int, rows: int,
                 first_draw: int = 0, pieces: int = 1, piece: int = 0) -> None:
        super().__init__()
        self.plan, self.cuts, self.key = plan, plan.cuts, key
        self.start, self.rows = start, rows
        # a model split over `pieces` ranks (this one `piece`): a draw over a tensor split
        # along one dim draws the row's whole and keeps this rank's contiguous piece of it
        self.pieces, self.piece = pieces, piece
        self.calls = first_draw  # random operators seen in this forward
        self._attention = math_attention()

    def again(self) -> RowDraws:
        """A mode that makes the draws this one makes from now on over again (a checkpointed
        module's recomputation): the same key and rows, its draw indices from here."""
        return RowDraws(self.plan, self.key, self.start, self.rows, first_draw=self.calls,
                        pieces=self.pieces, piece=self.piece)

    def __enter__(self) -> RowDraws:
        self._attention.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._attention.__exit__(*exc)

    def _generators(self, device: torch.device) -> list[torch.Generator]:
        """One generator per row of this rank, for the current draw."""
        made = []
        for row in range(self.start, self.start + self.rows):
            generator = torch.Generator(device=device)
            generator.manual_seed(hash((self.key, self.calls - 1, row)) & (2**63 - 1))
            made.append(generator)
        return made

    def _each_row(self, x: torch.Tensor, per_row: int, method: str,
                  args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """`x`'s rows (`per_row` entries of dim 0 each in one process) drawn in place by
        `method`, each from its row's generator; on a split model, a rank's piece of the row's
        whole draw."""
        options = {k: v for k, v in (kwargs or {}).items() if k != "generator"}
        piece = self._piece(x, per_row)
        if piece is not None:
            if any(isinstance(a, torch.Tensor) and a.dim() for a in args):
                raise RandomDrawError("a draw with a probability per element over a tensor the "
                                      "plan splits, which no rank can draw whole")
            whole, dim, start, size = piece
            for i, generator in enumerate(self._generators(x.device)):
                block = torch.empty(whole, dtype=x.dtype, device=x.device)
                getattr(block, method)(*args, generator=generator, **options)
                rows = slice(i * (x.shape[0] // self.rows), (i + 1) * (x.shape[0] // self.rows))
                x[rows] = block.narrow(dim, start, size)
            return
        for i, generator in enumerate(self._generators(x.device)):
            rows = slice(i * per_row, (i + 1) * per_row)
            # a tensor argument shaped like `x` (a probability per element) is cut alike
            cut = [a[rows] if isinstance(a, torch.Tensor) and a.dim() and
                   a.shape[0] == x.shape[0] else a for a in args]
            getattr(x[rows], method)(*cut, generator=generator, **options)

    def _piece(self, x: torch.Tensor, per_row: int
               ) -> tuple[tuple[int, ...], int, int, int] | None:
        """Where this rank's `x` is a piece of one process's draw (a row's whole shape, the
        split dim, this rank's start and size in it), None where it is the whole."""
        index = self.calls - 1
        if self.pieces == 1 or index >= len(self.plan.shapes):
            return None
        whole = (per_row, *self.plan.shapes[index])
        local = (x.shape[0] // self.rows, *x.shape[1:])
        if local == whole:
            return None
        differ = [d for d, (a, b) in enumerate(zip(local, whole, strict=False)) if a != b]
        if (len(local) != len(whole) or len(differ) != 1
                or whole[differ[0]] != local[differ[0]] * self.pieces):
            raise RandomDrawError(f"a draw of shape {tuple(x.shape)} on this rank where one "
                                  f"process draws rows of {whole}: not one rank's piece of them")
        dim = differ[0]
        return whole, dim, self.piece * local[dim], local[dim]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = op_name(func)
        if name.startswith(_FUSED_ATTENTION) and _dropout_p(args, kwargs) > 0:
            raise RandomDrawError(f"{func} drops attention weights inside one fused kernel, "
                                  f"which cannot draw row by row; call "
                                  f"F.scaled_dot_product_attention (gridrun then runs torch's "
                                  f"math attention), or set the dropout to 0")
        if not is_random_op(func):
            return func(*args, **kwargs)
        index, self.calls = self.calls, self.calls + 1
        if index >= len(self.cuts):
            raise RandomDrawError(f"{func}: more random draws in this forward than in the "
                                  f"forwards it was planned from ({len(self.cuts)})")
        per_row = self.cuts[index]
        if per_row is None or kwargs.get("generator") is not None:
            return func(*args, **kwargs)  # a fixed shape, or a generator of the model's own
        first = args[0] if args else None
        if name in ("rand", "randn"):
            out = torch.empty(list(args[0]), dtype=kwargs.get("dtype"),
                              device=kwargs.get("device"))
            self._each_row(out, per_row, "uniform_" if name == "rand" else "normal_")
            return out
        if not isinstance(first, torch.Tensor):
            raise RandomDrawError(f"{func} draws over the batch's rows in a way that cannot "
                                  f"be drawn row by row")
        if name.endswith("_"):  # in place: bernoulli_, uniform_, normal_, ...
            self._each_row(first, per_row, name, args[1:], kwargs)
            return first
        if name in ("rand_like", "randn_like"):
            out = torch.empty_like(first)
            self._each_row(out, per_row, "uniform_" if name == "rand_like" else "normal_")
            return out
        if name == "bernoulli":  # a probability per element
            if self._piece(first, per_row) is not None:
                raise RandomDrawError(f"{func}: a probability per element over a tensor the "
                                      f"plan splits, which no rank can draw whole")
            out = torch.empty_like(first)
            for i, generator in enumerate(self._generators(first.device)):
                rows = slice(i * per_row, (i + 1) * per_row)
                out[rows] = torch.bernoulli(first[rows], generator=generator)
            return out
        if name == "native_dropout":
            p = float(args[1])
            keep = torch.empty_like(first)
            self._each_row(keep, per_row, "bernoulli_", (1.0 - p,))
            return first * keep * (1.0 / (1.0 - p)), keep.bool()
        raise RandomDrawError(f"{func} draws over the batch's rows in a way that cannot be "
                              f"drawn row by row")


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


class RowDrawingModel(ParallelModel):
    """A parallel model whose ranks of a model group run their group's rows, split its
    modules over the group, and draw as one process draws: the user's forward runs inside
    `RowDraws` with the group's rows (a micro-batch's by their place in the global batch), every
    rank of the group drawing a whole tensor's rows alike, and a tensor split over the group (a
    rank's heads or features) as its piece of each row's whole draw."""

    def __init__(self, grid: ProcessGrid) -> None:
        super().__init__(grid)
        # the model's random draws in one process (`probe.draw_plan`), None: it draws nothing
        self.draws: DrawPlan | None = None
        self._key = 0
        self._draws: RowDraws | None = None
        self.module: nn.Module

    def run_module(self, x: torch.Tensor) -> Any:
        """`self.module` on the group's rows `x`, drawing by rows in training."""
        if not (self.training and self.draws is not None):
            return self.module(x)
        micro = self.micro  # a step's micro-batches share its key
        if micro is None or micro.index == 0:
            self._key = forward_key()
        start = (self.input_rows(x.shape[0] * self.grid.pc).start if micro is None
                 else micro.inputs.start)
        with RowDraws(self.draws, self._key, start, x.shape[0], pieces=self.grid.pr,
                      piece=self.grid.model_index) as draws:
            self._draws = draws
            try:
                return self.module(x)
            finally:
                self._draws = None

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager[None],
                                          contextlib.AbstractContextManager[Any]]:
        """A recomputation draws what its forward drew (`RowDraws.again`)."""
        if self._draws is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return contextlib.nullcontext(), self._draws.again()
