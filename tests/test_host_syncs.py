"""Host synchronisations per training step, counted on the CPU, in one process.

On a GPU the host queues kernels ahead of the device; a read of a value the device computes
(`.item()`, `.tolist()`, `bool()` or `float()` of a tensor, `nonzero`, an index by a boolean
mask, `masked_select`, `unique`, ...) makes the host wait until the device has run everything
queued before it, and the device then idles while the host queues the next kernels. The README
states how many such waits a step has; these tests count them over whole training runs.

How they are counted: a dispatch mode (`HostReads`) sees every operator a run executes, those
inside autograd's backward included, and counts the ones that hand a value to the host or size
their output by the data (`_local_scalar_dense`, which `.item()`, `bool()`, `float()` and
`int()` run, `nonzero`, `masked_select`, the `unique` family, `repeat_interleave`, `bincount`,
`equal`, `allclose`, and `index`/`index_put_` by a boolean mask); `Tensor.tolist` and
`Tensor.numpy`, which run no operator, are patched. Two kinds
of reads are left out, both of memory that is on the host on a GPU too: the control values of a
collective, which `runner.training.step.host_values` reads (it refuses a device tensor), and
`torch.optim`'s step counts (kept on the host unless an optimizer is capturable or fused). Each
read is charged to the step the loop is in (the grid's pace says when a step begins, and when
the loop turns to a stop check, a checkpoint or an evaluation).

What a CPU cannot show: a blocking copy between host and device (`.cpu()` of a device tensor,
a host tensor copied to the device), a no-op here. tests/test_gpu.py runs the same runs on a
GPU under `torch.cuda.set_sync_debug_mode("error")` for those (`train_on_cuda`).
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import runner.training.loop as loop
import runner.training.step as step_module
from runner.cli.validation import validate
from runner.core import CommCounter, CountedComm, ProcessGrid
from runner.core.standin import ShapeOnlyTransport
from runner.records.rundir import RunDir
from runner.training.step import StepFailure
from strategies.layers.norm import DistributedBatchNorm
from strategies.layers.vocab_head import SplitLogitsScoring
from strategies.layers.vocab_ops import vocab_cross_entropy
from tests.conftest import ROOT

aten = torch.ops.aten
READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique,
         aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.repeat_interleave,
         aten.bincount, aten.equal, aten.allclose, aten.is_nonzero}
MASKED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _by_mask(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


class HostReads(TorchDispatchMode):
    """Every read of a tensor's values by the host while active, by where the loop was:
    ("step", n), or (what the loop turned to, n), or ("setup", 0) before the first step."""

    def __init__(self, host_resident: Callable[[torch.Tensor], bool] = lambda t: False
                 ) -> None:
        super().__init__()
        self.where: tuple[str, int] = ("setup", 0)
        self.reads: list[tuple[tuple[str, int], str]] = []
        self.host_resident = host_resident

    def count(self, what: str) -> None:
        self.reads.append((self.where, what))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in READS and not (args and isinstance(args[0], torch.Tensor)
                                    and self.host_resident(args[0])):
            self.count(str(func))
        elif packet in MASKED and len(args) > 1 and _by_mask(args[1]):
            self.count(f"{func} by a boolean mask")
        return func(*args, **(kwargs or {}))

    def per_step(self) -> dict[int, int]:
        steps = Counter(where[1] for where, _ in self.reads if where[0] == "step")
        return dict(steps)


@contextmanager
def counting(reads: HostReads) -> Iterator[HostReads]:
    """`reads` active, with `tolist` and `numpy` counted too (`numpy` but from `host_values`)."""
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
    host_values = step_module.host_values.__code__

    def counted_tolist(self: torch.Tensor) -> Any:
        reads.count("tolist")
        return tolist(self)

    def counted_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code is not host_values:
            reads.count("numpy")
        return numpy(self, *args, **kwargs)

    torch.Tensor.tolist, torch.Tensor.numpy = counted_tolist, counted_numpy  # type: ignore
    try:
        with reads:
            yield reads
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy  # type: ignore


BASE: dict[str, Any] = {
    "seed": 3, "grid": {"pr": 1, "pc": 1},
    "trainer": {"steps": 6, "batch_size": 8, "log_every": 3, "eval_every": None,
                "threads": None},
    "model": {"name": "mlp"}, "dataset": {"name": "digits"}, "strategy": {"name": "data"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "launcher": {"command": None, "args": []},
}
GPT = {"name": "gpt", "width": 32, "layers": 2, "heads": 4, "mlp_ratio": 2, "bias": True,
       "tie_weights": True, "sparse_embedding": False, "context": None}
TOKENS = {"name": "tokens", "vocab_size": 48, "seq_len": 10, "classes": 4, "samples": 200,
          "val_fraction": 0.2, "seed": 0}
RESNET = {"name": "resnet", "widths": [4, 8], "blocks": [1, 1]}
IMAGES = {"name": "synthetic", "shape": [3, 8, 8], "samples": 128}
READ_STEPS = {1, 3, 6}  # the first, the logged (log_every=3) and the last of 6
UNREAD_STEPS = {2, 4, 5}


def with_(config: dict[str, Any], **groups: dict[str, Any]) -> dict[str, Any]:
    return {**config, **{k: {**config.get(k, {}), **v} for k, v in groups.items()}}


RUNS: dict[str, dict[str, Any]] = {
    "mlp_fp32": BASE,
    "mlp_bf16": with_(BASE, trainer={"precision": "bf16"}),
    "mlp_fp16": with_(BASE, trainer={"precision": "fp16"}),
    # grid at one rank: the GPT under tensor parallelism, its head split by vocabulary
    "gpt_vocab_head": {**BASE, "model": GPT, "dataset": TOKENS, "strategy": {"name": "grid"},
                       "optimizer": {"name": "adamw", "lr": 0.01}},
    "resnet_batch_norm": {**BASE, "model": RESNET, "dataset": IMAGES},
    "resnet_batch_norm_grid": {**BASE, "model": RESNET, "dataset": IMAGES,
                               "strategy": {"name": "grid"}},
    "mlp_accumulated": with_(BASE, trainer={"accumulate_steps": 2}),
}


def _torch_step_counts(training: Any) -> set[int]:
    inner = getattr(training.optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return set()
    return {id(state["step"]) for state in inner.state.values()
            if isinstance(state.get("step"), torch.Tensor)}


def train_counting(config: dict[str, Any], path: Path, monkeypatch: pytest.MonkeyPatch,
                   grid: ProcessGrid | None = None) -> tuple[HostReads, Any]:
    """`config` trained by this rank of `grid` (a 1 x 1 grid when None) into the run directory
    `path`, every host read counted; returns the reads and the rank's `Training`."""
    grid = ProcessGrid(1, 1) if grid is None else grid
    built: list[Any] = []
    reads = HostReads(lambda t: bool(built) and id(t) in _torch_step_counts(built[0]))
    build = loop.build_training

    def build_and_keep(*args: Any, **kwargs: Any) -> Any:
        built.append(build(*args, **kwargs))
        return built[0]

    pace = grid.counter.pace
    begin_step, begin = pace.begin_step, pace.begin

    def step_begins(step: int, ends_round: bool = True) -> None:
        reads.where = ("step", step)
        begin_step(step, ends_round)

    def turns_to(phase: str, step: int | None = None) -> None:
        reads.where = (phase, reads.where[1] if step is None else step)
        begin(phase, step)

    monkeypatch.setattr(loop, "build_training", build_and_keep)
    monkeypatch.setattr(pace, "begin_step", step_begins)
    monkeypatch.setattr(pace, "begin", turns_to)
    cfg = OmegaConf.create(config)
    run_dir = RunDir(path)
    if grid.rank == 0:
        run_dir.create(cfg)
    grid.world.barrier()
    with counting(reads):
        loop.train(validate(cfg, world_size=grid.size), run_dir, grid)
    return reads, built[0]


def readme_syncs() -> tuple[int, int, int]:
    """What the README states: host synchronisations on a step that does not read its loss,
    on one that does, and on every fp16 step."""
    text = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(r"Host synchronisations per training step:\*\* (\d+) on a step that does "
                      r"not read its loss, (\d+) on a step that does .*? under fp16, (\d+) on "
                      r"every step", text)
    assert found, "the README's line on host synchronisations per step"
    unread, read, fp16 = (int(n) for n in found.groups())
    return unread, read, fp16


def assert_as_the_readme_states(reads: HostReads, config: dict[str, Any], what: str) -> None:
    """The reads of each of the 6 steps of `config` (log_every=3) are the README's number."""
    got = {s: reads.per_step().get(s, 0) for s in range(1, 7)}
    assert got == readme_waits(config), (what, got,
                                         [r for r in reads.reads if r[0][0] == "step"])


@pytest.mark.parametrize("name", list(RUNS))
def test_a_step_waits_for_the_device_only_as_the_readme_states(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads, training = train_counting(RUNS[name], tmp_path / "run", monkeypatch)
    if name == "gpt_vocab_head":  # the split head's cross-entropy, at one rank
        assert isinstance(training.model, SplitLogitsScoring)
    assert_as_the_readme_states(reads, RUNS[name], name)


def test_a_read_added_to_the_step_is_counted(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The count sees an `.item()`, and a boolean-mask index, in the step (here after its
    backward): what makes the test above fail when someone adds one."""
    forward_backward = step_module.forward_backward_step

    def with_reads(*args: Any, **kwargs: Any) -> Any:
        loss = forward_backward(*args, **kwargs)
        loss.item()
        flat = loss.reshape(1)
        flat[flat > 0].sum()
        return loss

    monkeypatch.setattr(step_module, "forward_backward_step", with_reads)
    reads, _ = train_counting(BASE, tmp_path / "run", monkeypatch)
    per_step = reads.per_step()
    unread, read, _ = readme_syncs()
    assert all(per_step.get(s, 0) == unread + 2 for s in UNREAD_STEPS), per_step
    assert all(per_step.get(s, 0) == read + 2 for s in READ_STEPS), per_step


# -- the layers' own reads: BatchNorm over ranks, the vocabulary cross-entropy ----------------


class Mirror(ShapeOnlyTransport):
    """`size` ranks that all hold what this one holds: a gather repeats this rank's piece, a
    sum multiplies by `size`. Enough to run a layer's collectives in one process."""

    def allreduce_(self, tensor: torch.Tensor) -> None:
        tensor.mul_(self.size)

    def allreduce(self, tensor: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(tensor * self.size)

    def allgatherv_(self, piece: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
        out.view(-1).copy_(piece.reshape(-1).repeat(self.size))


def mirrored(size: int = 2) -> CountedComm:
    return CountedComm(None, CommCounter(), transport=Mirror(size))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_over_ranks_reads_nothing_from_the_device(
        momentum: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks holding the same rows normalize as one BatchNorm over both copies, with its
    running statistics (a cumulative average too: `momentum=None`, its count kept on the host
    and read again after a checkpoint is loaded into it), reading nothing on the way."""
    torch.manual_seed(0)
    reference = nn.BatchNorm2d(3, momentum=momentum).double()
    norm = DistributedBatchNorm(nn.BatchNorm2d(3, momentum=momentum).double(), mirrored(),
                                "bn")
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    with counting(HostReads()) as reads:
        for _ in range(3):
            y = norm(x)
            y.square().sum().backward()
    first = 1 if momentum is None else 0  # the count of batches, read once
    assert len(reads.reads) == first, reads.reads
    for _ in range(3):
        want = reference(torch.cat([x, x]).detach())
    torch.testing.assert_close(y, want[:4], rtol=0, atol=1e-12)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(norm, name), getattr(reference, name), rtol=1e-12,
                                   atol=0)
    state = {**reference.state_dict(), "num_batches_tracked": torch.tensor(10)}
    reference.load_state_dict(state)
    norm.load_state_dict(state)
    with counting(HostReads()) as reads:
        norm(x)
    assert len(reads.reads) == first, reads.reads  # the loaded count, read again
    reference(torch.cat([x, x]).detach())
    torch.testing.assert_close(norm.running_var, reference.running_var, rtol=1e-12, atol=0)


def test_the_vocabulary_cross_entropy_reads_nothing_and_keeps_its_gradient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits of rows [4, 9) of the vocabulary on this rank, targets inside and outside it:
    forward and backward read nothing, and the gradient is, bit for bit, softmax − one-hot
    (the one-hot subtracted where this rank holds the target)."""
    torch.manual_seed(0)
    start, rows = 4, 5
    logits = torch.randn(7, rows, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 4, 5, 8, 9, 12, 6])
    comm = mirrored()
    with counting(HostReads()) as reads:
        vocab_cross_entropy(logits, targets, start, comm).sum().backward()
    assert reads.reads == []
    x = logits.detach()
    top = x.max(dim=-1, keepdim=True).values
    own = top.squeeze(-1) + (x - top).exp().sum(dim=-1).log()
    lse = torch.logsumexp(torch.stack([own, own]), dim=0)  # both mirrored ranks' mass
    probs = (x - lse.unsqueeze(-1)).exp()
    local = targets - start
    inside = (local >= 0) & (local < rows)
    probs[torch.arange(7)[inside], local[inside]] -= 1.0
    assert logits.grad is not None
    assert torch.equal(logits.grad, probs * 2)  # every token's loss summed over 2 ranks


# -- a stop between the steps that read the loss --------------------------------------------


def train_stopped_at(stop_step: int, config: dict[str, Any], path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`config` trained in this process, sent SIGTERM as step `stop_step` begins."""
    grid = ProcessGrid(1, 1)
    pace = grid.counter.pace
    begin_step = pace.begin_step

    def step_begins(step: int, ends_round: bool = True) -> None:
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
        begin_step(step, ends_round)

    monkeypatch.setattr(pace, "begin_step", step_begins)
    cfg = OmegaConf.create(config)
    run_dir = RunDir(path)
    run_dir.create(cfg)
    return loop.train(validate(cfg, world_size=1), run_dir, grid)


def test_a_stop_between_logged_steps_checkpoints_the_step_it_stopped_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    summary = train_stopped_at(5, BASE, tmp_path / "run", monkeypatch)
    assert summary["status"] == "interrupted" and summary["step"] == 5, summary
    assert (tmp_path / "run" / "checkpoints" / "step-00000005").is_dir()


def test_a_stop_after_an_unread_non_finite_loss_writes_no_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss turns NaN on step 4 and a stop comes on step 5, neither step read: the stop
    reads step 5's loss before its checkpoint, and the run fails instead of saving NaNs."""
    config = {**BASE, "debug": {"fail_at_step": 4, "fail_on_rank": 0, "fail_mode": "nan"}}
    with pytest.raises(StepFailure, match="the loss is not finite at step 5"):
        train_stopped_at(5, config, tmp_path / "run", monkeypatch)
    assert not (tmp_path / "run" / "checkpoints" / "step-00000005").exists()


# -- on a GPU (tests/test_gpu.py runs it) -----------------------------------------------------


def train_on_cuda(config: dict[str, Any], path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """`config` trained in this process on the GPU, on a 1 x 1 grid; returns each step's waits
    for the device that the step means to make (`torch.cuda.Event.synchronize`: a `HostCopy`
    read). The steps that do not read their loss run under CUDA's sync debug mode set to
    "error", so any other synchronising call in them (a read of a device value, a blocking copy
    either way) raises and names itself."""
    grid = ProcessGrid(1, 1)
    waits: Counter[int] = Counter()
    where = [0]
    synchronize = torch.cuda.Event.synchronize

    def counted(self: torch.cuda.Event) -> None:
        waits[where[0]] += 1
        synchronize(self)

    pace = grid.counter.pace
    begin_step, begin = pace.begin_step, pace.begin

    def step_begins(step: int, ends_round: bool = True) -> None:
        where[0] = step
        torch.cuda.set_sync_debug_mode("default" if step in READ_STEPS else "error")
        begin_step(step, ends_round)

    def turns_to(phase: str, step: int | None = None) -> None:
        where[0] = 0
        torch.cuda.set_sync_debug_mode("default")
        begin(phase, step)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    monkeypatch.setattr(pace, "begin_step", step_begins)
    monkeypatch.setattr(pace, "begin", turns_to)
    config = with_(config, trainer={"device": "cuda"})
    cfg = OmegaConf.create(config)
    run_dir = RunDir(path)
    run_dir.create(cfg)
    try:
        loop.train(validate(cfg, world_size=1), run_dir, grid, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {s: waits[s] for s in range(1, 7)}


def readme_waits(config: dict[str, Any]) -> dict[int, int]:
    """The README's host synchronisations for each of the 6 steps of `config` (log_every=3)."""
    unread, read, fp16 = readme_syncs()
    if config["trainer"].get("precision") == "fp16":
        return dict.fromkeys(range(1, 7), fp16)
    return {s: read if s in READ_STEPS else unread for s in range(1, 7)}
