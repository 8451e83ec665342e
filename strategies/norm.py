"""Batch normalization with one process's statistics, whatever the split of the batch.

A BatchNorm normalizes each channel by the mean and variance of *every* row (and, for images,
every position) of the batch. When a strategy splits the batch (or each sample's height) over
ranks, each rank sees part of those: `DistributedBatchNorm` combines the parts over the ranks
of `comm` that hold the rest, so the statistics, the output, the gradients and the running
statistics are the single process's (DDP's default, each rank normalizing by its own rows, is
a different model, and does not reproduce one process's losses).

The combination is exact and numerically stable (Chan et al.'s pairwise update): each rank
computes its count n_k, mean m_k and sum of squared deviations M2_k per channel (two passes over
its own rows), the ranks all-gather these 2C + 1 numbers, and every rank forms
  N = Σ n_k,   mean = Σ n_k m_k / N,   M2 = Σ M2_k + Σ n_k (m_k − mean)²,   var = M2 / N.
The all-gather is `runner.core.primitives.all_gather`, whose adjoint (a reduce-scatter) is its
backward: autograd differentiates through the combination, so the backward is exact too, one
reduce-scatter of the same 2C + 1 numbers per rank. Half-precision inputs (autocast) are
normalized in float32 and returned in their own type.

Running statistics follow `nn.BatchNorm`'s rule with the global mean and the unbiased global
variance M2 / (N − 1), so they are equal on every rank; evaluation uses them and moves nothing.

A shard of the channels (`channels`: the model group's split of a convolution's output) keeps
only its slice of the weight, bias and running statistics (placed for checkpoints, like a
sharded convolution's rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, Partition
from runner.core.comm import GridGroup
from runner.core.cost import CommOp
from runner.core.placement import place_rows
from runner.core.primitives import all_gather

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_HALF = (torch.float16, torch.bfloat16)


def batch_norm_problem(bn: nn.Module) -> str | None:
    """Why `bn` cannot be normalized across ranks (None: it can)."""
    assert isinstance(bn, nn.modules.batchnorm._BatchNorm)
    if not bn.track_running_stats:
        return (f"{type(bn).__name__}(track_running_stats=False) normalizes evaluation batches "
                f"by their own statistics")
    return None


def global_statistics(x: torch.Tensor, comm: CountedComm,
                      label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per channel (dim 1): the mean and biased variance over every row and position of `x` on
    the ranks of `comm`, and the count (see the module docstring). Differentiable."""
    dims = [0, *range(2, x.dim())]
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count:
        mean = x.mean(dims)
        m2 = (x - mean.view(1, -1, *([1] * (x.dim() - 2)))).square().sum(dims)
    else:  # no rows here (an uneven split): contributes nothing
        mean = x.new_zeros(channels)
        m2 = x.new_zeros(channels)
    total = x.new_full((1,), float(count))
    if comm.size == 1:
        return mean, m2 / max(count, 1), total
    local = torch.cat([mean, m2, total]).unsqueeze(0)
    every = all_gather(local, comm, 0, Partition(comm.size, comm.size), label=label)
    means, m2s, counts = every[:, :channels], every[:, channels:2 * channels], every[:, -1:]
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return mean, m2 / n, n.reshape(1)


class DistributedBatchNorm(nn.Module):
    """`bn` with its batch statistics over the ranks of `comm` (all its channels, or the shard
    `channels` of them); see the module docstring."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, comm: CountedComm, label: str,
                 channels: slice | None = None) -> None:
        super().__init__()
        problem = batch_norm_problem(bn)
        if problem is not None:
            raise ValueError(problem)
        self.comm, self.label = comm, label
        self.eps, self.momentum = bn.eps, bn.momentum
        self.weight: nn.Parameter | None
        self.bias: nn.Parameter | None
        self.num_features = bn.num_features
        if channels is None:  # the module's own tensors (their checkpoint placements with them)
            self.weight, self.bias = bn.weight, bn.bias
            self.register_buffer("running_mean", bn.running_mean)
            self.register_buffer("running_var", bn.running_var)
        else:
            self.weight = _slice_parameter(bn.weight, channels)
            self.bias = _slice_parameter(bn.bias, channels)
            self.register_buffer("running_mean", _slice_buffer(bn.running_mean, channels))
            self.register_buffer("running_var", _slice_buffer(bn.running_var, channels))
            self.num_features = channels.stop - channels.start
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)

    def extra_repr(self) -> str:
        return f"{self.num_features}, over {self.comm.name} ({self.comm.size} ranks)"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = x.float() if x.dtype in _HALF else x
        if not self.training:
            running_mean, running_var = self.running_mean, self.running_var
            assert isinstance(running_mean, torch.Tensor)
            assert isinstance(running_var, torch.Tensor)
            return F.batch_norm(compute, running_mean, running_var, self.weight, self.bias,
                                False, 0.0, self.eps).to(x.dtype)
        mean, var, count = global_statistics(compute, self.comm, self.label)
        self._update_running(mean.detach(), var.detach(), count.detach())
        shape = (1, -1, *([1] * (x.dim() - 2)))
        y = (compute - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor,
                        count: torch.Tensor) -> None:
        tracked, running_mean, running_var = (self.num_batches_tracked, self.running_mean,
                                              self.running_var)
        assert isinstance(tracked, torch.Tensor) and isinstance(running_mean, torch.Tensor)
        assert isinstance(running_var, torch.Tensor)
        tracked.add_(1)
        momentum = 1.0 / float(tracked.item()) if self.momentum is None else self.momentum
        n = float(count.item())
        unbiased = var * (n / (n - 1)) if n > 1 else var
        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def _slice_parameter(param: nn.Parameter | None, channels: slice) -> nn.Parameter | None:
    if param is None:
        return None
    shard = nn.Parameter(param.detach()[channels].clone())
    place_rows(shard, param, channels)
    return shard


def _slice_buffer(buffer: torch.Tensor | None, channels: slice) -> torch.Tensor | None:
    if buffer is None:
        return None
    shard = buffer.detach()[channels].clone()
    place_rows(shard, buffer, channels)
    return shard


def distribute_batch_norms(module: nn.Module, comm: CountedComm) -> int:
    """Replace every BatchNorm inside `module` by a `DistributedBatchNorm` over `comm` (in
    place; the label is its name in the model); returns how many."""
    replaced = 0
    for name, child in list(module.named_modules()):
        for attribute, grandchild in list(child.named_children()):
            if isinstance(grandchild, BATCH_NORMS):
                label = f"bn:{name}.{attribute}" if name else f"bn:{attribute}"
                setattr(child, attribute, DistributedBatchNorm(grandchild, comm, label))
                replaced += 1
    return replaced


def batch_norm_problems(module: nn.Module) -> list[str]:
    """Every BatchNorm in `module` that cannot be normalized across ranks, by name."""
    problems = []
    for name, child in module.named_modules():
        if isinstance(child, BATCH_NORMS):
            problem = batch_norm_problem(child)
            if problem is not None:
                problems.append(f"{name or 'the model'}: {problem}")
    return problems


def batch_norm_ops(module: nn.Module, group: GridGroup, group_size: int,
                   itemsize: int) -> list[CommOp]:
    """What every BatchNorm in `module` moves per training step over a group of `group_size`:
    the all-gather of each rank's 2C + 1 statistics and, in the backward, its reduce-scatter
    (each recorded as the whole gathered tensor)."""
    if group_size == 1:
        return []
    ops = []
    for name, child in module.named_modules():
        if isinstance(child, BATCH_NORMS):
            n = group_size * (2 * child.num_features + 1) * itemsize
            label = f"bn:{name}"
            ops += [CommOp("allgather", group, group_size, n, label),
                    CommOp("reduce_scatter", group, group_size, n, label)]
    return ops
