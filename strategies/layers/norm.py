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
The backward needs the global means of dy and dy·(x − mean): one all-reduce of 2C sums
(`SyncBatchNormFunction`, which also keeps both directions to fused kernels: this runs at
every BatchNorm of a ResNet, on its largest tensors). Half-precision inputs (autocast) are
normalized in float32 and returned in their own type.

Running statistics follow `nn.BatchNorm`'s rule with the global mean and the unbiased global
variance M2 / (N − 1), so they are equal on every rank; evaluation uses them and moves nothing.

A shard of the channels (`channels`: the model group's split of a convolution's output) keeps
only its slice of the weight, bias and running statistics (placed for checkpoints, like a
sharded convolution's rows).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, Partition
from runner.core.comm import GridGroup
from runner.core.placement import place_rows
from runner.core.primitives import all_gather_op
from runner.cost.collectives import CommOp

# `SyncBatchNorm` (what `convert_sync_batchnorm` leaves in DDP code) computes what a BatchNorm
# over every rank's rows does: gridrun gives it that meaning over its own groups.
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_OWN_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}
_HALF = (torch.float16, torch.bfloat16)


def is_plain_batch_norm(bn: nn.Module) -> bool:
    """Whether `bn` computes what torch's own BatchNorm does: one of its classes, or a subclass
    that keeps its forward (timm's `BatchNormAct2d` does not: it adds an activation)."""
    return isinstance(bn, BATCH_NORMS) and type(bn).forward in _OWN_FORWARDS


def batch_norm_problem(bn: nn.Module, replaced: bool = True) -> str | None:
    """Why `bn` cannot be normalized across ranks (None: it can). `replaced`: by a
    `DistributedBatchNorm` (the split strategies), which computes what torch's BatchNorm does
    and nothing a subclass adds; under `strategy=data` the module itself runs (`whole_batch`)."""
    assert isinstance(bn, nn.modules.batchnorm._BatchNorm)
    if replaced and not is_plain_batch_norm(bn):
        base = next((c.__name__ for c in type(bn).__mro__ if c in BATCH_NORMS), "_BatchNorm")
        return (f"{type(bn).__name__} subclasses {base} with a forward of its own, which a "
                f"split layer would drop; strategy=data keeps it whole (its statistics over "
                f"every rank)")
    if not bn.track_running_stats:
        return (f"{type(bn).__name__}(track_running_stats=False) normalizes evaluation batches "
                f"by their own statistics")
    return None


def _combine(local: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """Every rank's (mean, M2, count) rows → the global mean, biased variance and count."""
    means, m2s, counts = local[:, :channels], local[:, channels:2 * channels], local[:, -1:]
    n = counts.sum()
    mean = (counts * means).sum(0) / n
    m2 = m2s.sum(0) + (counts * (means - mean).square()).sum(0)
    return mean, m2 / n, n.reshape(1)


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization over the rows (and positions) of every rank of `comm`.

    Forward: each rank's per-channel mean and biased variance in one fused pass
    (`torch.var_mean`), their all-gather (2C + 1 numbers per rank) and Chan's combination; the
    normalization itself is the fused batch-norm kernel with the global statistics. Backward
    (the standard derivation, as `nn.SyncBatchNorm` on GPUs): the sums of dy and dy·x̂ over this
    rank's rows (the fused backward kernel's reduction), all-reduced (2C numbers), give the
    global means that the input gradient needs, which is then two fused passes; the weight's
    and bias's gradients are this rank's sums, which the strategy's gradient exchange adds up
    like any other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, comm: CountedComm, eps: float,
                label: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        dims = [0, *range(2, x.dim())]
        channels = x.shape[1]
        count = x.numel() // channels if channels else 0
        if count:
            var, mean = torch.var_mean(x, dims, correction=0)
        else:  # no rows here (an uneven split): contributes nothing
            var, mean = x.new_zeros(channels), x.new_zeros(channels)
        total = x.new_full((1,), float(count))
        if comm.size > 1:
            local = torch.cat([mean, var * count, total]).unsqueeze(0)
            every = all_gather_op(local, comm, 0, Partition(comm.size, comm.size), label)
            mean, var, total = _combine(every, channels)
        invstd = torch.rsqrt(var + eps)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.comm, ctx.label = comm, label
        return y, mean, var, total

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        x, weight, mean, invstd, total = ctx.saved_tensors
        comm: CountedComm = ctx.comm
        shape = (1, -1, *([1] * (x.dim() - 2)))
        channels = x.shape[1]
        # This rank's Σ dy·x̂ and Σ dy per channel, in the fused kernel (x̂ = (x − mean)·invstd
        # with the global statistics).
        ones = x.new_ones(channels) if weight is None else weight
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            dy, x, ones, None, None, mean, invstd, True, 0.0, [False, True, True])
        global_sums = torch.cat([sum_dy, sum_dy_xhat])
        if comm.size > 1:
            comm.allreduce_(global_sums, label=ctx.label)
        n = total.reshape(())
        mean_dy, mean_dy_xhat = global_sums[:channels] / n, global_sums[channels:] / n
        scale = invstd if weight is None else invstd * weight
        # dx = scale·(dy − mean_dy − x̂·mean_dy_xhat): per channel, dy·s + x·a + c
        a = -scale * invstd * mean_dy_xhat
        c = -scale * mean_dy - a * mean
        dx = torch.addcmul(c.view(shape), x, a.view(shape)).addcmul_(dy, scale.view(shape))
        dweight = None if weight is None else sum_dy_xhat
        dbias = None if weight is None else sum_dy
        return dx, dweight, dbias, None, None, None


def batch_norm_comm_ops(group: GridGroup, size: int, channels: int, itemsize: int,
                        label: str) -> list[CommOp]:
    """What one BatchNorm moves per training step over a group of `size`: the all-gather of
    each rank's 2C + 1 statistics, and in the backward the all-reduce of 2C sums."""
    if size == 1:
        return []
    return [CommOp("allgather", group, size, size * (2 * channels + 1) * itemsize, label),
            CommOp("allreduce", group, size, 2 * channels * itemsize, label)]


def global_batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, momentum: float, eps: float,
                      comm: CountedComm, label: str) -> torch.Tensor:
    """`F.batch_norm(x, ..., training=True)` with the statistics of every rank of `comm`
    (`SyncBatchNormFunction`; a half type normalized in float32 and returned in its own). The
    running statistics, where given, move by `momentum` to the global mean and unbiased
    variance M2 / (N − 1), as the native kernel moves them."""
    compute = x.float() if x.dtype in _HALF else x
    y, mean, var, count = SyncBatchNormFunction.apply(compute, weight, bias, comm, eps, label)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            # N / (N - 1) on the device, from the gathered count: every rank's rows are not
            # known on the host, and reading the count would wait for the device at every
            # BatchNorm. Rounded once, as the host's float64 quotient is when it multiplies a
            # float32 tensor, so the statistics are the same bits.
            bessel = torch.where(count > 1, count / (count - 1), torch.ones_like(count))
            unbiased = var * bessel
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    out: torch.Tensor = y.to(x.dtype)
    return out


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
        # num_batches_tracked on the host: the buffer, its version when counted, the count
        self._tracked: tuple[torch.Tensor, int, float] | None = None

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
        if self.comm.size == 1:  # nothing to combine: the native kernel, as nn.BatchNorm
            return self._native(compute).to(x.dtype)
        momentum, running_mean, running_var = self._step()
        return global_batch_norm(x, running_mean, running_var, self.weight, self.bias,
                                 momentum, self.eps, self.comm, self.label)

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        momentum, running_mean, running_var = self._step()
        return F.batch_norm(x, running_mean, running_var, self.weight, self.bias, True,
                            momentum, self.eps)

    def _step(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """One more batch tracked: this step's momentum (nn.BatchNorm's rule, a cumulative
        average where `momentum` is None) and the running statistics it moves."""
        tracked, running_mean, running_var = (self.num_batches_tracked, self.running_mean,
                                              self.running_var)
        assert isinstance(tracked, torch.Tensor) and isinstance(running_mean, torch.Tensor)
        assert isinstance(running_var, torch.Tensor)
        tracked.add_(1)
        momentum = 1.0 / self._batches_tracked(tracked) if self.momentum is None else self.momentum
        return momentum, running_mean, running_var

    def _batches_tracked(self, tracked: torch.Tensor) -> float:
        """`num_batches_tracked`, just counted, as a host number: counted here too, and read
        from the device only on the first forward and after anything else wrote the buffer (a
        checkpoint loaded into it moves its version; a move to a device replaces it), not at
        every forward."""
        version, kept = tracked._version, self._tracked
        if kept is not None and kept[0] is tracked and kept[1] == version - 1:
            self._tracked = (tracked, version, kept[2] + 1.0)
        else:
            self._tracked = (tracked, version, float(tracked.item()))
        return self._tracked[2]


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
    """Replace every plain BatchNorm inside `module` (`is_plain_batch_norm`) by a
    `DistributedBatchNorm` over `comm` (in place; the label is its name in the model); returns
    how many. A subclass with a forward of its own stays as it is: its `F.batch_norm` takes
    every rank's statistics inside `whole_batch.BatchStatistics`."""
    replaced = 0
    for name, child in list(module.named_modules()):
        for attribute, grandchild in list(child.named_children()):
            if is_plain_batch_norm(grandchild):
                label = f"bn:{name}.{attribute}" if name else f"bn:{attribute}"
                setattr(child, attribute, DistributedBatchNorm(grandchild, comm, label))
                replaced += 1
    return replaced


def batch_norm_problems(module: nn.Module) -> list[str]:
    """Every BatchNorm in `module` that cannot be normalized across ranks by
    `strategy=data`, by name."""
    problems = []
    for name, child in module.named_modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            problem = batch_norm_problem(child, replaced=False)
            if problem is not None:
                problems.append(f"{name or 'the model'}: {problem}")
    return problems


def batch_norm_ops(module: nn.Module, group: GridGroup, group_size: int,
                   itemsize: int) -> list[CommOp]:
    """What every BatchNorm in `module` moves per training step over a group of `group_size`
    (`batch_norm_comm_ops`)."""
    ops = []
    for name, child in module.named_modules():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            ops += batch_norm_comm_ops(group, group_size, child.num_features, itemsize,
                                       f"bn:{name}")
    return ops
