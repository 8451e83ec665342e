"""Logits split by vocabulary (or by classes) over the model group, scored without gathering
them: a GPT's head under tensor parallelism (`strategies.transformer.tensor_parallel`) and a planned
model's output projection of style `vocab` (`strategies.plans.module_plan`).

Every rank of a model group holds rows [start, start + rows) of the head, and outputs that piece
of the logits for every row of its group. The per-token cross-entropy and the arg-max come from
the pieces (`vocab_ops.vocab_cross_entropy`, `vocab_argmax`), the same on every rank
of the group; each rank scores its own sub-shard of the rows (`Partition(rows, Pr)`), so every
target is scored on exactly one rank (the row contract of `strategies.base`). What moves per
token is two numbers gathered and one gradient summed, where a gathered head moves every logit
twice (forward and back) and holds them all on every rank.

A head's logits can be scored split only where they are the model's output as the head returns
them: anything applied after it (a softmax, a cap) would see a piece of each row
(`returns_logits_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from runner.core import CountedComm, Partition
from runner.cost.collectives import CommOp
from strategies.base import ParallelModel, Score
from strategies.layers.vocab_ops import vocab_argmax, vocab_cross_entropy
from strategies.probe import logits_of, probe

# The loss computes in float32 at least (`vocab_ops.loss_dtype`).
MIN_LOSS_ITEMSIZE = torch.float32.itemsize


def split_logits_score(output: torch.Tensor, targets: torch.Tensor, start: int,
                       comm: CountedComm, index: int, correct: bool = False) -> Score:
    """The score of this rank's own rows (piece `index` of `Partition(rows, comm.size)`) from
    `output` (rows, [positions,] pieces): this rank's piece, from vocabulary row `start`, of the
    logits of every row of its group; `targets` (rows, [positions]) are every row's, flattened
    as `strategies.base.cross_entropy_score` does."""
    logits = output.reshape(-1, output.shape[-1])
    flat = targets.reshape(-1)
    per_token = vocab_cross_entropy(logits, flat, start, comm).view(targets.shape)
    mine = Partition(targets.shape[0], comm.size).slice(index)
    right = None
    if correct:
        predicted = vocab_argmax(logits, start, comm).view(targets.shape)
        right = (predicted[mine] == targets[mine]).sum()
    return Score(per_token[mine].sum(), per_token[mine].numel(), right)


def split_loss_ops(tokens: int, pr: int, logits_itemsize: int,
                   label: str = "loss") -> list[CommOp]:
    """What `split_logits_score` moves in one training step (no arg-max) over `tokens` targets
    of the group, its logits of `logits_itemsize` bytes: the all-gather of every rank's
    [log-sum-exp, target logit] per token, and the all-reduce of the per-token gradient."""
    if pr == 1:
        return []
    itemsize = max(logits_itemsize, MIN_LOSS_ITEMSIZE)
    return [CommOp("allgather", "model", pr, pr * 2 * tokens * itemsize, label),
            CommOp("allreduce", "model", pr, tokens * itemsize, label)]


def returns_logits_of(model: nn.Module, head: nn.Module,
                      sample_shape: tuple[int, ...]) -> bool:
    """Whether the scores `model` returns are the very tensor `head` returns (its last call),
    nothing applied after it: from one forward (`strategies.probe`)."""
    seen: dict[str, Any] = {}

    def keep(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            seen[name] = output
        return hook

    handles = [head.register_forward_hook(keep("head")),
               model.register_forward_hook(keep("model"))]
    try:
        with torch.random.fork_rng(devices=[]):
            probe(model, sample_shape)
    finally:
        for handle in handles:
            handle.remove()
    out = seen.get("head")
    return isinstance(out, torch.Tensor) and "model" in seen and logits_of(seen["model"]) is out


class SplitLogitsScoring(ParallelModel):
    """A parallel model whose output is logits split by vocabulary (or classes) over the model
    group, rows [`vocab_start`, …) on this rank: every rank of a model group outputs all of its
    group's rows and scores them with `split_logits_score`, which picks its own."""

    vocab_start: int  # this rank's first row of the head

    def own_rows(self, group_rows: int) -> slice:
        return slice(0, group_rows)  # the targets of every row: `score` picks its own

    def score(self, output: torch.Tensor, targets: torch.Tensor,
              correct: bool = False) -> Score:
        return split_logits_score(output, targets, self.vocab_start, self.grid.model,
                                  self.grid.model_index, correct)
