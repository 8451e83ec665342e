"""The operations of a vocabulary split over the model group (tensor parallelism of a GPT).

A rank of the model group holds rows [start, start + rows) of the token table (and of the head):
- `vocab_embedding_sum`: each rank looks up the ids in its range (others give zero), and the sum
  over the group (`all_sum_reduce`, adjoint: itself) is every id's row on every rank;
- `vocab_cross_entropy`: per-token cross-entropy of logits split by vocabulary, never gathered:
  one all-gather of [local log-sum-exp, local target logit] per token (the group's log-sum-exp
  of the local ones is exact and stable; MPI's MAX is not among the counted collectives, and one
  gather replaces the max and the sum); backward (softmax_local − onehot_local)·g with g the
  per-token gradient summed over the group (one all-reduce);
- `vocab_argmax`: the arg-max over the whole vocabulary (ties to the lowest index, as
  `torch.argmax`), from one all-gather of each rank's [max, index].

Convention (`runner.core.primitives`): a replicated tensor's gradient on each rank is partial,
the true gradient is the sum over the group. Every collective goes through the counted
communicator.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from runner.core import CountedComm, Partition
from runner.core.primitives import all_gather_op, all_sum_reduce, all_sum_reduce_op


def loss_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """What the cross-entropy computes in: float32 at least (a half type's logits are widened,
    as F.cross_entropy does under autocast)."""
    return torch.promote_types(logits_dtype, torch.float32)


def vocab_embedding_sum(ids: torch.Tensor, weight: torch.Tensor, start: int,
                        comm: CountedComm, label: str = "tok_emb",
                        padding_idx: int | None = None) -> torch.Tensor:
    """Rows of the whole table for `ids`, from this rank's rows [start, start + len(weight));
    `padding_idx`: the local row (if this rank holds the table's padding row) that gets no
    gradient."""
    rows = weight.shape[0]
    local = ids - start
    inside = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, max(rows - 1, 0)), weight, padding_idx=padding_idx)
    out = out.masked_fill(~inside.unsqueeze(-1), 0.0)
    return all_sum_reduce(out, comm, label)


def _gather_rows(packed: torch.Tensor, comm: CountedComm, label: str) -> torch.Tensor:
    """Every rank's `packed` (k, N), stacked by rank: (P, k, N)."""
    return all_gather_op(packed.unsqueeze(0), comm, 0, Partition(comm.size, comm.size), label)


class _VocabCrossEntropy(Function):
    """Per-token loss (N,) of logits (N, rows) holding vocabulary rows [start, start + rows)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int,
                comm: CountedComm, label: str) -> torch.Tensor:
        x = logits.detach().to(loss_dtype(logits.dtype))
        rows = x.shape[-1]
        local = targets - start
        inside = (local >= 0) & (local < rows)
        local = local.clamp(0, rows - 1)
        top = x.max(dim=-1, keepdim=True).values
        lse_local = top.squeeze(-1) + (x - top).exp().sum(dim=-1).log()
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        gathered = _gather_rows(torch.stack([lse_local, target_logit]), comm, label)
        lse = torch.logsumexp(gathered[:, 0], dim=0)
        ctx.save_for_backward(x, lse, local, inside)
        ctx.comm, ctx.label, ctx.dtype = comm, label, logits.dtype
        return lse - gathered[:, 1].sum(dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, lse, local, inside = ctx.saved_tensors
        # each token's loss is replicated: its gradient is the sum of the ranks' parts
        g = all_sum_reduce_op(grad.to(x.dtype), ctx.comm, ctx.label)
        probs = (x - lse.unsqueeze(-1)).exp()
        # minus the one-hot of the targets this rank holds: a scatter of -1 (-0 elsewhere, which
        # leaves a probability's bits as they are), not an index by the mask, whose count the
        # host would wait for
        hits = -inside.to(probs.dtype).unsqueeze(-1)
        probs.scatter_add_(-1, local.unsqueeze(-1), hits)
        return (probs * g.unsqueeze(-1)).to(ctx.dtype), None, None, None, None


def vocab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, start: int,
                        comm: CountedComm, label: str = "loss") -> torch.Tensor:
    """Per-token cross-entropy (N,), the same on every rank of `comm`, of logits (N, rows) that
    hold vocabulary rows [start, start + rows) against targets (N,) (global ids)."""
    out: torch.Tensor = _VocabCrossEntropy.apply(logits, targets, start, comm, label)
    return out


def vocab_argmax(logits: torch.Tensor, start: int, comm: CountedComm,
                 label: str = "argmax") -> torch.Tensor:
    """The global arg-max (N,) of logits (N, rows) split by vocabulary over `comm`; ties go to
    the lowest index, as `torch.argmax` on the whole logits. Values and indices travel as
    float64 (exact for any index and any floating logit)."""
    x = logits.detach()
    index = x.argmax(dim=-1)
    value = x.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    gathered = _gather_rows(torch.stack([value.double(), (index + start).double()]), comm,
                            label)
    values = gathered[:, 0]
    # the first rank holding the maximum holds its lowest index (ranks hold ascending rows)
    owner = (values == values.max(dim=0).values).to(torch.int8).argmax(dim=0)
    return gathered[:, 1].gather(0, owner.unsqueeze(0)).squeeze(0).long()
