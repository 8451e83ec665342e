"""α and β of this machine's MPI: measured, stored, and found again by plans and runs.

`measure()` starts small MPI jobs on this machine: a ping-pong between 2 ranks and an all-reduce
sweep on up to 4 (never more ranks than this process may use cores: `calibration_ranks`), over
message sizes from 8 B to 2 MiB. A least-squares fit of t = α + β·n to the ping-pong gives the
point-to-point values; a fit of the all-reduce times to 2(α⌈log₂ p⌉ + β(p−1)/p·n) gives the
values the planner uses (training steps are collectives). Both are stored as JSON at
`calibration_path()` (the user's cache, one file per host), where `runner.config.machine` finds them
for every later plan and run.

`measure_compute()` (in this process, one torch thread, about 6 seconds) measures the compute
rates of `runner.cost.compute` — matrix products and convolutions by size, the layers priced
per byte, the dispatch per operator call, fresh memory —, stored under "compute".

On a machine where torch sees a GPU, `measure_device()` measures the same rates on the GPU
(`measure_compute(device="cuda:0")`: larger products and convolutions, each timed between two
synchronisations; in float32, and the products again in bfloat16 for half-precision runs) and
the α–β of an all-reduce of device buffers as a run moves them (one rank per GPU under
`comm.backend=torch`, NCCL; on a single GPU two ranks sharing it, staged through host buffers
under MPI). They are stored under "devices", keyed by the GPU's name
(`torch.cuda.get_device_name`), where `runner.config.machine` finds them for runs and plans on
that GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runner.config.machine import calibration_path
from runner.records.rundir import write_json

SIZES = [8 << k for k in range(0, 20, 2)]  # 8 B .. 2 MiB
# a GPU's all-reduce sweep: up to 128 MiB (a bucket of a large model's gradients), where the
# per-byte rate of NCCL and of staged buffers settles
DEVICE_SIZES = [8 << k for k in range(0, 25, 2)]  # 8 B .. 128 MiB
PINGPONG_RANKS = 2
MAX_COLLECTIVE_RANKS = 4


class CalibrationRefused(ValueError):
    """This machine cannot be calibrated honestly (bad input: the command exits 2)."""


class CalibrationFailed(RuntimeError):
    """The measurement itself failed (no mpiexec, a rank failed)."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as a batch system sets it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def calibration_ranks(cores: int) -> int:
    """The all-reduce sweep's ranks: up to 4, but never more than `cores`.

    A rank without a core of its own waits for a descheduled peer inside every collective, so
    an oversubscribed sweep measures the scheduler (4 ranks on 2 cores stored α ≈ 4 ms, a
    latency no MPI has), and every later plan and run would be priced with it. We measure
    on fewer ranks instead of refusing: α and β are per message and per byte, the ranks only
    enter through the fit's ⌈log₂ p⌉ and (p−1)/p factors, so 2 ranks on a 2-core machine give the
    values, and refusing would leave the common small machine uncalibrated. With fewer than 2
    cores even the ping-pong would be oversubscribed: refused.
    """
    if cores < PINGPONG_RANKS:
        raise CalibrationRefused(
            f"plan.calibrate=true needs at least {PINGPONG_RANKS} usable cores (one per rank), "
            f"this process may use {cores}: an oversubscribed measurement would store the "
            "scheduler's latency as α; calibrate where the job will run, or give "
            "plan.alpha and plan.beta")
    return min(MAX_COLLECTIVE_RANKS, cores)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of y = a + b x by Theil and Sen: the median of the slopes between
    every two points, the median of y - b x. One sample taken while the process was
    descheduled (a busy machine) cannot tip it, where least squares gave a small message's
    stall a negative per-byte cost."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs))
              for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    b = statistics.median(slopes)
    return statistics.median(y - b * x for x, y in zip(xs, ys, strict=True)), b


def _call_worker(repeats: int) -> None:
    """The runner's own cost per collective call, by kind: each operation on a tiny tensor as
    the strategies issue it (the core's primitives through the counted communicator: Python,
    counting, buffers, counts and displacements), less mpi4py's own all-reduce of the same."""
    import torch
    from mpi4py import MPI

    from runner.core import CommCounter, CountedComm, Partition
    from runner.core import primitives as P
    from runner.core.cartesian import CartesianPartition, redistribute_op

    comm = MPI.COMM_WORLD
    counted = CountedComm(comm, CommCounter())
    size, rank = counted.size, counted.rank
    tensor = torch.zeros(2)
    rows = Partition(2 * size, size)
    piece = torch.zeros(rows.sizes[rank], 2)
    whole = torch.zeros(rows.total, 2)
    src = CartesianPartition((2 * size, 2 * size), (size,), ((0,), ()))
    dst = CartesianPartition((2 * size, 2 * size), (size,), ((), (0,)))
    block = torch.zeros(src.local_shape(src.coords(rank)))
    calls = {"raw": lambda: comm.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM),
             "allreduce": lambda: counted.allreduce_(tensor),
             "iallreduce": lambda: counted.iallreduce_(tensor).wait(),
             "allgather": lambda: P.all_gather_op(piece, counted, 0, rows),
             "reduce_scatter": lambda: P.reduce_scatter_op(whole, counted, 0, rows),
             "alltoallv": lambda: redistribute_op(block, counted, src, dst)}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():  # alternated: drift hits all alike
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(100):
                call()
            seconds[name].append((time.perf_counter() - start) / 100)
    if comm.Get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        raw = medians.pop("raw")
        print(json.dumps({"kind": "call", "raw": raw,
                          "calls": {k: max(0.0, v - raw) for k, v in medians.items()}}))


def _oversubscribed_worker(repeats: int) -> None:
    """What a blocking collective costs when two ranks share each core (run on twice the
    usable cores): a step of ~0.2 ms of work and a tiny all-reduce, against the work alone on
    the same ranks; the difference less the call's own cost is the wait for a descheduled
    peer, which every synchronisation of an oversubscribed run pays."""
    import torch
    from mpi4py import MPI

    from runner.core import CommCounter, CountedComm

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    counted = CountedComm(comm, CommCounter())
    tensor, a = torch.zeros(2), torch.randn(64, 64)

    def work() -> None:
        for _ in range(20):
            a @ a

    extra = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(50):
            work()
        alone = time.perf_counter() - start
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(50):
            work()
            counted.allreduce_(tensor)
        extra.append((time.perf_counter() - start - alone) / 50)
    if comm.Get_rank() == 0:
        print(json.dumps({"kind": "oversubscribed", "sync": max(0.0, statistics.median(extra))}))


def _device_worker(backend: str, repeats: int) -> None:
    """An all-reduce sweep over DEVICE_SIZES of GPU buffers through the counted communicator,
    as a run's gradients travel: each rank on GPU `local rank % GPUs`; under "torch" NCCL where
    every rank has a GPU of its own (else gloo through host buffers), under "mpi" staged
    through host buffers (MPI that is not CUDA-aware)."""
    import torch
    from mpi4py import MPI

    from runner.core import DevicePaths, ProcessGrid
    from runner.core.torchdist import init_torch_distributed, shutdown_torch_distributed
    from runner.training.devices import place_rank

    comm = MPI.COMM_WORLD
    placement = place_rank("cuda", comm)
    if backend == "torch":
        init_torch_distributed(comm)
    facts = comm.allgather((placement.local_size, placement.gpus))
    direct = backend == "torch" and all(ranks <= gpus for ranks, gpus in facts)
    grid = ProcessGrid(1, comm.Get_size(), comm, backend="torch" if backend == "torch" else "mpi",
                       devices=DevicePaths("cuda", direct=direct))
    times = []
    for nbytes in DEVICE_SIZES:
        buf = torch.zeros(nbytes // 4, device=placement.device)
        samples = []
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            comm.Barrier()
            start = time.perf_counter()
            grid.world.allreduce_(buf)
            torch.cuda.synchronize()
            if i >= 2:
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    if comm.Get_rank() == 0:
        print(json.dumps({"kind": f"device_{backend}", "ranks": comm.Get_size(),
                          "sizes": DEVICE_SIZES, "seconds": times,
                          "path": grid.devices.describe(grid.backend, grid.size)}))
    if backend == "torch":
        shutdown_torch_distributed()


def _worker(kinds: str, repeats: int) -> None:
    """Each of the comma-separated measurements in turn, in this one MPI job (its start,
    interpreter and torch, is paid once), rank 0 printing one JSON line for each."""
    for kind in kinds.split(","):
        _measure_kind(kind, repeats)


def _measure_kind(kind: str, repeats: int) -> None:
    import torch
    from mpi4py import MPI

    if kind == "call":
        _call_worker(repeats)
        return
    if kind == "oversubscribed":
        _oversubscribed_worker(repeats)
        return
    if kind in ("device_torch", "device_mpi"):
        _device_worker(kind.removeprefix("device_"), repeats)
        return
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    times = []
    for nbytes in SIZES:
        buf = torch.zeros(nbytes // 4)
        samples = []
        for i in range(repeats + 2):
            comm.Barrier()
            start = time.perf_counter()
            if kind == "pingpong":
                if rank == 0:
                    comm.Send(buf, dest=1)
                    comm.Recv(buf, source=1)
                elif rank == 1:
                    comm.Recv(buf, source=0)
                    comm.Send(buf, dest=0)
            else:
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            elapsed = time.perf_counter() - start
            if i >= 2:
                samples.append(elapsed / 2 if kind == "pingpong" else elapsed)
        times.append(statistics.median(samples))
    if rank == 0:
        print(json.dumps({"kind": kind, "ranks": size, "sizes": SIZES, "seconds": times}))


def measure_local(rows: int = 200_000, width: int = 64, touched: int = 50_000,
                  repeats: int = 5) -> dict:
    """Seconds per byte of the local work the sparse exchange's choice weighs (one thread, as a
    rank runs): a dense update's passes over a table, and a row the sparse path coalesces and
    adds into the table at random places."""
    import torch

    from runner.core.row_sparse import coalesce_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        table, grad = torch.randn(rows, width, generator=gen), torch.zeros(rows, width)
        indices = torch.randint(0, rows, (touched,), generator=gen)
        values = torch.randn(touched, width, generator=gen)

        def dense_update() -> None:
            grad.zero_()
            table.add_(grad, alpha=-0.1)

        def sparse_update() -> None:
            unique, summed = coalesce_rows(indices, values)
            table.index_add_(0, unique, summed, alpha=-0.1)

        def median_time(fn: object) -> float:
            samples = []
            for i in range(repeats + 1):
                start = time.perf_counter()
                fn()  # type: ignore[operator]
                if i:
                    samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        row_bytes = width * 4
        return {"table_pass": median_time(dense_update) / (rows * row_bytes),
                "sparse_row": median_time(sparse_update) / (touched * row_bytes)}
    finally:
        torch.set_num_threads(threads)


# -- compute rates (runner.cost.compute) ---------------------------------------------------------

GEMM_ROWS = (16, 64, 256)  # a product's smallest dimension (a Linear's rows: a rank's batch)
GEMM_MOST_FLOPS = 3e9  # the largest product measured (the rate is flat from ~1e8 on)
GEMM_MOST_FEATURES = 4096
CONV_FLOPS = [10 ** (6 + e / 2) for e in range(7)]  # 1e6 .. 1e9 (flat from ~1e8 on)
NARROW_CONV_FLOPS = [10 ** (5 + e / 2) for e in range(8)]  # 1e5 .. 3e8
CONV_BACKWARD_SHAPES = {"deep": (32, 32, 16, 16), "narrow": (3, 32, 16, 32)}  # Cin, Cout, N, side
KIND_BYTES = (256 << 10, 2 << 20, 8 << 20)  # in cache, in the last level, from memory
MEMORY_BYTES = 4 << 20  # elementwise passes over tensors of a few MB
FRESH_BYTES = 64 << 20  # above glibc's largest mmap threshold (32 MiB): always freshly mapped
# On a GPU: products from 16 to 4096 rows (a GPU reaches its rate only with many), up to ~5e11
# flops or 16384 features; convolutions up to 1e11 flops; elementwise work on tensors of MBs
# to hundreds of MBs (small ones are the launch's cost, priced as dispatch).
DEVICE_GEMM_ROWS = (16, 64, 256, 1024, 4096)
DEVICE_GEMM_MOST_FLOPS = 5e11
DEVICE_GEMM_MOST_FEATURES = 16384
DEVICE_CONV_FLOPS = [10 ** (6 + e / 2) for e in range(11)]  # 1e6 .. 1e11
DEVICE_NARROW_CONV_FLOPS = [10 ** (5 + e / 2) for e in range(11)]  # 1e5 .. 1e10
DEVICE_KIND_BYTES = (2 << 20, 32 << 20, 256 << 20)
DEVICE_MEMORY_BYTES = 256 << 20
DEVICE_FRESH_MEMORY = 1e18  # the caching allocator maps no memory in a step: as good as free


class _Timer:
    """Seconds per call of a function, as a rank would spend them, on tensors it makes on its
    `device` in its `dtype` (`randn`).

    One thread: the thread's CPU time (the core's speed, not the moments another process took
    it: sharing is priced apart, `runner.cost.compute.oversubscription`); more threads work
    beside this one: wall-clock time. Page faults are taken out at `per_fault` seconds each
    (once measured): below 32 MiB whether a block comes back freshly mapped is the allocator's
    whim (glibc trims its heap's top), and the model prices fresh memory apart
    (`ComputeRates.fresh_memory`). On a GPU: wall-clock time between two synchronisations of
    the device (its kernels run asynchronously), around loops of calls."""

    def __init__(self, threads: int, device: str = "cpu", dtype: Any = None) -> None:
        self.device, self.dtype = device, dtype  # dtype None: float32
        self.cuda = device.startswith("cuda")
        self.clock = time.thread_time if threads == 1 and not self.cuda else time.perf_counter
        self.per_fault = 0.0

    def randn(self, *shape: int, requires_grad: bool = False) -> Any:
        """A tensor of normal values on the timer's device, in its dtype."""
        import torch

        return torch.randn(*shape, device=self.device, dtype=self.dtype or torch.float32,
                           requires_grad=requires_grad)

    def empty(self, *shape: int) -> Any:
        import torch

        return torch.empty(*shape, device=self.device, dtype=self.dtype or torch.float32)

    def place(self, module: Any) -> Any:
        """`module` moved to the timer's device and dtype."""
        import torch

        return module.to(self.device, self.dtype or torch.float32)

    def sync(self) -> None:
        """Wait for the device's queued kernels (nothing on the CPU)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    @staticmethod
    def faults() -> int:
        try:
            import resource
        except ImportError:  # not a Unix: no counts, nothing taken out
            return 0
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def __call__(self, fn: Callable[[], object], repeats: int = 5,
                 sample: float = 2e-3) -> float:
        """The median seconds of a call of `fn` after a warm-up call (kernel set-up, first
        allocations): small calls timed in loops of at least `sample` seconds, calls of more
        than 20 ms three times."""
        fn()
        self.sync()
        start = self.clock()
        fn()
        self.sync()
        once = max(self.clock() - start, 1e-7)
        if once > 0.02:
            repeats = 2
        inner = max(1, int(sample / once))
        samples = [once]
        for _ in range(repeats):
            faults, start = self.faults(), self.clock()
            for _ in range(inner):
                fn()
            self.sync()
            elapsed = self.clock() - start - (self.faults() - faults) * self.per_fault
            samples.append(max(elapsed, 0.0) / inner)
        return statistics.median(samples[1:] if len(samples) > 3 else samples)


def _gemm_point(rows: int, features: int, timer: _Timer) -> tuple[float, float]:
    """(flops, flop/s) of a Linear layer's products on `rows` rows of `features` features, as
    many out: the median of the forward (x·Wᵀ + b), the input's gradient (g·W) and the
    weight's (gᵀ·x), each into a kept output (fresh memory is priced apart). The operands stay
    in the caches where they fit, as a small model's do in a step (a model whose weights
    overflow the last level's cache runs its small products up to 1.5× slower)."""
    import torch

    m, k = rows, features
    x, w, b, g = timer.randn(m, k), timer.randn(k, k), timer.randn(k), timer.randn(m, k)
    y, gx, gw = timer.empty(m, k), timer.empty(m, k), timer.empty(k, k)
    flops = 2.0 * m * k * k
    return flops, flops / statistics.median([
        timer(lambda: torch.addmm(b, x, w.t(), out=y)), timer(lambda: torch.mm(g, w, out=gx)),
        timer(lambda: torch.mm(g.t(), x, out=gw))])


def _gemm_band(rows: int, timer: _Timer, most_flops: float = GEMM_MOST_FLOPS,
               most_features: int = GEMM_MOST_FEATURES) -> list[list[float]]:
    """The (flops, flop/s) points of products whose smallest dimension is `rows`: features
    from `rows` up, half a decade of flops apart, up to `most_flops` or `most_features`
    (multiples of 64 from 256 features on: odd sizes take slower kernels)."""
    points: list[list[float]] = []
    flops = 2.0 * rows ** 3
    while True:
        features = round((flops / (2 * rows)) ** 0.5)
        if features >= 256:
            features = 64 * round(features / 64)
        if features > most_features or 2.0 * rows * features ** 2 > most_flops * 1.2:
            return points
        points.append(list(_gemm_point(rows, max(features, rows), timer)))
        flops *= 10 ** 0.5


def _narrow_output(timer: _Timer) -> float:
    """A Linear's forward product into few out features (a classifier head: 128 rows, 784
    features, 10 classes) in times of its input-gradient product (the same flops and smallest
    dimension)."""
    import torch

    x, w, b, g = timer.randn(128, 784), timer.randn(10, 784), timer.randn(10), timer.randn(128, 10)
    y, gx = timer.empty(128, 10), timer.empty(128, 784)
    return max(1.0, timer(lambda: torch.addmm(b, x, w.t(), out=y))
               / timer(lambda: torch.mm(g, w, out=gx)))


def _conv_point(flops: float, in_channels: int, out_channels: int, side: int,
                timer: _Timer) -> tuple[float, float]:
    """(flops, flop/s) of a 3×3 'same' convolution of about `flops` flops at images of `side`
    (halved, down to 4, while one image has more flops)."""
    import torch.nn.functional as F

    def per_image(side: int) -> float:
        return 2.0 * out_channels * in_channels * 9 * side * side

    while per_image(side) > flops and side > 4:
        side //= 2
    batch = max(1, round(flops / per_image(side)))
    x = timer.randn(batch, in_channels, side, side)
    w = timer.randn(out_channels, in_channels, 3, 3)
    actual = batch * per_image(side)
    return actual, actual / timer(lambda: F.conv2d(x, w, padding=1))


def _conv_backward(in_channels: int, out_channels: int, batch: int, side: int,
                   timer: _Timer) -> tuple[float, float]:
    """(input gradient, weight gradient) seconds, each in forward times, of a 3×3 'same'
    convolution."""
    import torch
    import torch.nn.functional as F

    x = timer.randn(batch, in_channels, side, side)
    w = timer.randn(out_channels, in_channels, 3, 3)
    g = timer.randn(batch, out_channels, side, side)
    backward = torch.ops.aten.convolution_backward

    def grad(mask: list[bool]) -> object:
        return backward(g, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask)

    forward = timer(lambda: F.conv2d(x, w, padding=1))
    return (timer(lambda: grad([True, False, False])) / forward,
            timer(lambda: grad([False, True, False])) / forward)


def _conv_overhead(timer: _Timer, backward_start: float) -> float:
    """Seconds of a convolution layer's forward and backward under autograd beyond its
    kernels' (the three convolutions, measured apart): the dispatch of its operator calls and
    oneDNN's set-up around them; the median over a small deep layer and a first layer."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    overheads = []
    for batch, cin, side, cout, input_grad in ((8, 16, 8, 16, True), (32, 3, 8, 32, False)):
        layer = timer.place(nn.Conv2d(cin, cout, 3, padding=1))
        params = list(layer.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        x = timer.randn(batch, cin, side, side, requires_grad=input_grad)
        g = timer.randn(batch, cout, side, side)
        w, b = layer.weight.detach(), layer.bias.detach()

        def step(layer: nn.Module = layer, x: torch.Tensor = x, g: torch.Tensor = g,
                 params: Sequence[torch.Tensor] = params) -> None:
            for p in params:
                p.grad.zero_()  # type: ignore[union-attr]
            x.grad = None
            layer(x).backward(g)

        def kernels(x: torch.Tensor = x, g: torch.Tensor = g, w: torch.Tensor = w,
                    b: torch.Tensor = b, cout: int = cout, mask: bool = input_grad) -> None:
            F.conv2d(x.detach(), w, b, padding=1)
            torch.ops.aten.convolution_backward(g, x.detach(), w, [cout], [1, 1], [1, 1], [1, 1],
                                                False, [0, 0], 1, [mask, True, True])

        overheads.append(timer(step, repeats=7) - backward_start - timer(kernels, repeats=7))
    return max(statistics.median(overheads), 1e-7)


def _linear_overhead(timer: _Timer, backward_start: float) -> float:
    """Seconds of a Linear layer's forward and backward under autograd beyond its kernels
    (its products and the bias gradient's sum, measured apart): the dispatch of its operator
    calls, its gradients' zeroing and accumulation; the median over three small layers."""
    import torch
    from torch import nn

    overheads = []
    for rows, features_in, features_out, input_grad in ((64, 64, 128, False),
                                                        (64, 128, 128, True), (16, 64, 10, True)):
        layer = timer.place(nn.Linear(features_in, features_out))
        params = list(layer.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        x = timer.randn(rows, features_in, requires_grad=input_grad)
        g = timer.randn(rows, features_out)
        w, b, data = layer.weight.detach(), layer.bias.detach(), x.detach()

        def step(layer: nn.Module = layer, x: torch.Tensor = x, g: torch.Tensor = g,
                 params: Sequence[torch.Tensor] = params) -> None:
            for p in params:
                p.grad.zero_()  # type: ignore[union-attr]
            x.grad = None
            layer(x).backward(g)

        def kernels(x: torch.Tensor = data, g: torch.Tensor = g, w: torch.Tensor = w,
                    b: torch.Tensor = b, input_grad: bool = input_grad) -> None:
            torch.addmm(b, x, w.t())
            torch.mm(g.t(), x)
            g.sum(0)
            if input_grad:
                torch.mm(g, w)

        overheads.append(timer(step, repeats=7) - backward_start - timer(kernels, repeats=7))
    return max(statistics.median(overheads), 1e-7)


def _kind_rates(timer: _Timer, dispatch: float, backward_start: float,
                sizes: Sequence[int] = KIND_BYTES) -> dict[str, list[list[float]]]:
    """Per kind of `runner.cost.compute.LAYER_KINDS`: [input bytes, forward, backward seconds
    per input byte] at inputs of `sizes` bytes, forward and backward under autograd as a training
    step runs them, less what is priced apart: the dispatch of their operator calls, the
    backward() call's start."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from runner.cost.compute import KIND_CALLS

    Layer = Callable[[torch.Tensor], torch.Tensor]

    def case(kind: str, nbytes: int) -> tuple[Layer, tuple[int, ...]]:
        elements = nbytes // 4
        image = (max(1, elements // (32 * 32 * 32)), 32, 32, 32)
        if kind == "layer_norm":
            return nn.LayerNorm(512), (max(1, elements // 512), 512)
        if kind == "cross_entropy":
            targets = torch.randint(0, 1024, (max(1, elements // 1024),), device=timer.device)
            return (lambda x: F.cross_entropy(x, targets, reduction="sum")), \
                (max(1, elements // 1024), 1024)
        layers: dict[str, Layer] = {
            "relu": nn.ReLU(), "gelu": nn.GELU(), "tanh": nn.Tanh(),
            "max_pool": nn.MaxPool2d(2), "avg_pool": nn.AvgPool2d(2),
            "global_avg_pool": nn.AdaptiveAvgPool2d(1), "batch_norm": nn.BatchNorm2d(32),
            "dropout": nn.Dropout(0.5)}
        return layers[kind], image

    rates: dict[str, list[list[float]]] = {}
    for kind in KIND_CALLS:
        rates[kind] = []
        for size in sizes:
            layer, shape = case(kind, size)
            if isinstance(layer, nn.Module):
                layer = timer.place(layer)
            params = list(layer.parameters()) if isinstance(layer, nn.Module) else []
            for p in params:
                p.grad = torch.zeros_like(p)
            x = timer.randn(*shape, requires_grad=True)
            grad = torch.randn_like(layer(x))

            def forward(layer: Layer = layer, x: torch.Tensor = x) -> None:
                layer(x)

            def step(layer: Layer = layer, x: torch.Tensor = x, grad: torch.Tensor = grad,
                     params: Sequence[torch.Tensor] = params) -> None:
                for p in params:
                    p.grad.zero_()  # type: ignore[union-attr]
                x.grad = None  # a layer's input is no leaf: its gradient is handed on
                layer(x).backward(grad)

            calls = KIND_CALLS[kind] * dispatch / 2  # a half forward, a half backward
            fwd = timer(forward, repeats=3)
            bwd = timer(step, repeats=3) - fwd - backward_start
            nbytes = x.numel() * x.element_size()
            rates[kind].append([float(nbytes), max(fwd - calls, 0.2 * fwd) / nbytes,
                                max(bwd - calls, 0.2 * fwd) / nbytes])
    return rates


def _fresh_memory(timer: _Timer) -> tuple[float, float]:
    """(bytes per second, seconds per page fault) of first touches of freshly mapped memory:
    an out-of-place pass whose output is always newly mapped, less the same pass into a kept
    output."""
    import torch

    big = torch.randn(FRESH_BYTES // 4)
    kept = torch.empty_like(big)
    fresh = timer(lambda: torch.mul(big, 2.0), repeats=2)
    reused = timer(lambda: torch.mul(big, 2.0, out=kept), repeats=2)
    faults = timer.faults()
    torch.mul(big, 2.0)
    faults = max(1, timer.faults() - faults)
    return FRESH_BYTES / max(fresh - reused, 1e-9), max(fresh - reused, 0.0) / faults


def _dispatch(timer: _Timer) -> tuple[float, float]:
    """(seconds per operator call, seconds of a backward() call's own start): a chain of tiny
    ReLUs forward and backward (two calls a ReLU), and one ReLU's step less its forward and its
    backward node's call."""
    import torch

    tiny = timer.randn(4, 4, requires_grad=True)
    ones = torch.ones_like(tiny)

    def chain(length: int) -> Callable[[], None]:
        def run() -> None:
            h = tiny
            for _ in range(length):
                h = torch.relu(h)
            h.backward(ones)
        return run

    one = timer(chain(1), repeats=7)
    dispatch = max((timer(chain(33), repeats=7) - one) / (32 * 2), 1e-8)
    return dispatch, max(one - timer(lambda: torch.relu(tiny), repeats=7) - dispatch, 1e-8)


def _memory(timer: _Timer, nbytes: int = MEMORY_BYTES) -> float:
    """Bytes per second of an elementwise pass over tensors of `nbytes` (the median of a
    ReLU, a product with a number, a sum of two: 1½ passes)."""
    import torch

    x = timer.randn(nbytes // 4)
    y = timer.randn(nbytes // 4)
    return statistics.median([nbytes / timer(lambda: torch.relu(x)),
                              nbytes / timer(lambda: x * 2.0),
                              nbytes * 1.5 / timer(lambda: x + y)])


def _products(timer: _Timer) -> dict:
    """The matrix-product and convolution tables and the convolutions' gradient factors, on
    the timer's device in its dtype (a GPU's reach further: its rates flatten far later)."""
    cuda = timer.cuda
    rows, most, features = ((DEVICE_GEMM_ROWS, DEVICE_GEMM_MOST_FLOPS, DEVICE_GEMM_MOST_FEATURES)
                            if cuda else (GEMM_ROWS, GEMM_MOST_FLOPS, GEMM_MOST_FEATURES))
    conv, narrow = (DEVICE_CONV_FLOPS, DEVICE_NARROW_CONV_FLOPS) if cuda else (
        CONV_FLOPS, NARROW_CONV_FLOPS)
    return {
        "gemm": {str(r): _gemm_band(r, timer, most, features) for r in rows},
        "gemm_narrow_output": _narrow_output(timer),
        "conv": [_conv_point(f, *_conv_shape(f), timer) for f in conv],
        "conv_narrow": [_conv_point(f, 3, 32, 8 if f < 1e6 else 16 if f < 1e7 else 32, timer)
                        for f in narrow],
        "conv_backward": list(_conv_backward(*CONV_BACKWARD_SHAPES["deep"], timer)),
        "conv_narrow_backward": list(_conv_backward(*CONV_BACKWARD_SHAPES["narrow"], timer))}


def _conv_shape(flops: float) -> tuple[int, int, int]:
    """(in channels, out channels, image side) of a deep convolution of about `flops` flops:
    wider as it grows, as a CNN's layers are."""
    if flops < 1e7:
        return 16, 16, 8
    if flops < 1e8:
        return 32, 32, 16
    return (64, 64, 16) if flops <= 1e9 else (128, 128, 32)


def measure_compute(threads: int = 1, device: str = "cpu") -> dict:
    """This machine's compute rates (`runner.cost.compute.ComputeRates.from_dict`'s form) with
    `threads` torch threads (a rank's; restored afterwards): the cost of fresh memory, the
    dispatch per operator call and the backward() call's start, the bytes per second of an
    elementwise pass, the matrix-product tables (by smallest dimension) and the convolution
    ones, the gradient factors of convolutions, and the seconds per byte of the layers priced
    by their tensors. Medians of repeats; about 6 seconds.

    `device` "cuda:N": the same on that GPU, in float32 (its products as PyTorch runs them by
    default: TF32 off), with larger sizes; fresh memory costs nothing there (the caching
    allocator keeps its blocks mapped), and the dispatch is the host's work per kernel
    launched."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    timer = _Timer(threads, device)
    cuda = timer.cuda
    try:
        if cuda:
            fresh_memory = DEVICE_FRESH_MEMORY
        else:
            fresh_memory, timer.per_fault = _fresh_memory(timer)
        tries = [_dispatch(timer) for _ in range(3)]  # small: the median of three tries
        dispatch = statistics.median(d for d, _ in tries)
        backward_start = statistics.median(b for _, b in tries)
        return {
            **_products(timer),
            "conv_overhead": _conv_overhead(timer, backward_start),
            "linear_overhead": _linear_overhead(timer, backward_start),
            "layers": _kind_rates(timer, dispatch, backward_start,
                                  DEVICE_KIND_BYTES if cuda else KIND_BYTES),
            "memory": _memory(timer, DEVICE_MEMORY_BYTES if cuda else MEMORY_BYTES),
            "dispatch": dispatch, "backward_start": backward_start,
            "fresh_memory": fresh_memory, "threads": threads}
    finally:
        torch.set_num_threads(previous)


def device_collective_plan(gpus: int, cores: int) -> tuple[int, str]:
    """(ranks, backend) of a GPU machine's all-reduce sweep: one rank per GPU under "torch"
    (NCCL, what a run with a GPU per rank uses), as many as there are GPUs and cores, up to 8;
    on a single GPU two ranks sharing it under "mpi" (staged through host buffers, what ranks
    sharing a GPU use)."""
    if gpus >= 2 and cores >= 2:
        return min(gpus, cores, 8), "torch"
    return PINGPONG_RANKS, "mpi"


def fit_collective(sweep: dict) -> dict:
    """α and β of an all-reduce sweep (its ranks, sizes and seconds): a fit of
    t = 2α⌈log₂ p⌉ + 2β(p−1)/p·n, the factors undone."""
    from runner.cost.collectives import log2_ceil

    p = sweep["ranks"]
    a, b = fit([float(n) for n in sweep["sizes"]], sweep["seconds"])
    return {"alpha": max(a / (2 * log2_ceil(p)), 0.0), "beta": b / (2 * (p - 1) / p),
            "ranks": p, "sizes": sweep["sizes"], "seconds": sweep["seconds"]}


def measure_device(repeats: int = 20, index: int = 0) -> dict:
    """GPU `index`'s compute rates (float32; "compute_bf16": the products and convolutions in
    bfloat16, for bf16 and fp16 runs, the rest as float32's) and the α–β of an all-reduce of
    device buffers across this machine's GPUs (`device_collective_plan`), with the GPU's name.
    One name per machine: its GPUs are taken to be alike."""
    import torch

    name = torch.cuda.get_device_name(index)
    device = f"cuda:{index}"
    compute = measure_compute(device=device)
    half = _products(_Timer(1, device, torch.bfloat16))
    ranks, backend = device_collective_plan(torch.cuda.device_count(), usable_cores())
    sweep = _run([f"device_{backend}"], ranks, repeats)[f"device_{backend}"]
    return {"name": name, "compute": compute, "compute_bf16": {**compute, **half},
            "collective": {**fit_collective(sweep), "backend": backend,
                           "path": sweep.get("path")},
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _mpiexec() -> str:
    """The mpiexec beside this Python (the `mpich` wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        raise CalibrationFailed("no mpiexec found: install the bundled MPI (pip install mpich) "
                                "or put the site's mpiexec on PATH")
    return found


def _run(kinds: list[str], ranks: int, repeats: int) -> dict[str, dict]:
    """The measurements `kinds` in one MPI job of `ranks`, by kind."""
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "runner.plan.calibration",
               ",".join(kinds), str(repeats)]
    out = subprocess.run(command, capture_output=True, text=True)
    found: dict[str, dict] = {}
    for line in out.stdout.strip().splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            found[result["kind"]] = result
    missing = [kind for kind in kinds if kind not in found]
    if out.returncode != 0 or missing:
        said = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrationFailed(f"the {ranks}-rank {' and '.join(missing or kinds)} "
                                f"measurement failed (exit code {out.returncode}): {said}")
    return found


def measure(repeats: int = 20, collective_ranks: int | None = None,
            device: bool | None = None) -> dict:
    """Measure (α and β, local work, compute rates), fit, store; returns what was stored.
    `collective_ranks`: the all-reduce sweep's ranks (default
    `calibration_ranks(usable_cores())`); more than the usable cores is refused. `device`: also
    measure the GPU (`measure_device`, stored under "devices" by its name); None: where torch
    sees one."""
    from runner.cost.collectives import log2_ceil

    cores = usable_cores()
    most = calibration_ranks(cores)  # refuses below 2 cores: the ping-pong needs them too
    if collective_ranks is None:
        collective_ranks = most
    elif not PINGPONG_RANKS <= collective_ranks <= cores:
        raise CalibrationRefused(f"an all-reduce sweep on {collective_ranks} ranks: needs "
                                 f"{PINGPONG_RANKS} to {cores} ranks here (a core each)")
    # the measurements on two ranks in one job; the all-reduce sweep there too when it has two
    pair = ["pingpong", "call"] + (["allreduce"] if collective_ranks == PINGPONG_RANKS else [])
    measured = _run(pair, PINGPONG_RANKS, repeats)
    if collective_ranks != PINGPONG_RANKS:
        measured |= _run(["allreduce"], collective_ranks, repeats)
    ping, sweep, calls = measured["pingpong"], measured["allreduce"], measured["call"]["calls"]
    alpha_p2p, beta_p2p = fit([float(n) for n in ping["sizes"]], ping["seconds"])
    p = collective_ranks
    # t = 2α⌈log p⌉ + 2β(p−1)/p n: fit intercept and slope, then undo the factors
    a, b = fit([float(n) for n in sweep["sizes"]], sweep["seconds"])
    if beta_p2p <= 0 or b <= 0:
        raise CalibrationRefused(
            "the measured times did not grow with the message size (a per-byte cost <= 0): "
            "most samples were taken while this machine was busy; calibrate again when it is "
            "idle, or with more plan.calibrate_repeats")
    # twice the cores: the scheduler's share of a synchronisation, priced only for runs that
    # put more ranks than cores on a node
    sync = _run(["oversubscribed"], 2 * cores, max(3, repeats // 4))["oversubscribed"]["sync"]
    result = {
        "point_to_point": {"alpha": max(alpha_p2p, 0.0), "beta": beta_p2p,
                           "ranks": PINGPONG_RANKS, "sizes": ping["sizes"],
                           "seconds": ping["seconds"]},
        "collective": {"alpha": max(a / (2 * log2_ceil(p)), 0.0), "beta": b / (2 * (p - 1) / p),
                       "ranks": p, "sizes": sweep["sizes"], "seconds": sweep["seconds"],
                       "calls": calls,
                       "oversubscribed_sync": max(0.0, sync - calls.get("allreduce", 0.0))},
        "local": measure_local(),
        "compute": measure_compute(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": socket.gethostname(),
        "usable_cores": cores,
    }
    if device is None:
        import torch

        device = torch.cuda.is_available()
    if device:
        measured = measure_device(repeats)
        result["devices"] = {measured.pop("name"): measured}
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return result


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
