"""Compute time of a rank's local work: this machine's per-operation rates, and the forward +
backward seconds of a layer on the local shapes a layout gives a rank.

A training step's time is compute + communication + wait; `runner.cost.collectives` prices the
communication, this module the compute. The rates (`ComputeRates`) are measured by
`python -m runner.plan plan.calibrate=true` (`runner.plan.calibration.measure_compute`) and found
again by `runner.config.machine.load_compute_rates`; until then `DEFAULT_RATES` stand in.

The model, per operation a rank's layer issues (float32 throughout):

- a matrix product (m×k by k×n: 2mkn flops) takes `gemm_seconds`: its flops at the rate
  achieved at that many flops, interpolated log-log in a measured table. Small products run far
  below the peak (their fixed cost dominates), and the table says how far;
- a convolution likewise (`conv_seconds`), from one of two tables: deep reductions (the body of
  a CNN) and narrow ones (an image's first layer, 1 to 3 input channels, which the kernels run
  at a fraction of the rate); its two gradients are measured multiples of its forward;
- a layer priced by its tensors' bytes (activations, pooling, norms, dropout, the loss) takes
  seconds per byte of its input measured for its kind (`layers`); other elementwise work
  (gradient accumulation, an optimizer's update, packing for communication) streams at
  `memory` bytes per second (`elementwise_seconds`);
- an operator a module's own `forward` runs between its leaf modules (`OperatorCall`:
  attention's products or kernel, a softmax, a residual sum) is priced by its kind
  (`operator_seconds`): products by the matrix-product table, attention kernels by their two
  products and passes over the scores, views by their dispatch alone, anything else as passes
  over its tensors' bytes, with a backward where an argument needs a gradient;
- every operator call costs `dispatch` seconds of framework overhead (the dispatcher and
  autograd: recording the forward, running the backward node): most of a small layer's time.
  A Linear's and a convolution's calls (and oneDNN's set-up) are measured whole, as
  `linear_overhead` and `conv_overhead`; a step's single `backward()` call starts the engine
  (`backward_start`, in `loss_seconds`);
- a tensor of more than FRESH_ALLOCATION bytes is newly mapped memory at each allocation, and
  its first touch page-faults (`fresh_memory`).

A layer's seconds are its forward, its backward and the accumulation of its parameters'
gradients into the zeroed `.grad` (gridrun zeroes gradients instead of dropping them). The
counts of operator calls per layer kind (KIND_CALLS) were fitted to measurements on a 2-core
x86 (AMD EPYC, AVX-512) machine with one torch thread (torch 2.13, MKL and oneDNN kernels).

What the model leaves out: products measured on operands kept in the caches (a model whose
weights overflow the last-level cache runs its mid-sized products up to 1.5× slower); blocks
below FRESH_ALLOCATION that the allocator happens to return to the system and map again
(glibc trims its heap's top: a step may page-fault on a few MB, irregularly); oneDNN's
shape-dependent choices for small convolutions (their fixed cost varies from ~10 to ~70 µs).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# (flops per call, achieved flop/s), ascending in flops
Curve = tuple[tuple[float, float], ...]
# matrix products by their smallest dimension: (that dimension, its Curve), ascending
GemmTable = tuple[tuple[int, Curve], ...]
# per layer kind: (input bytes, forward and backward seconds per input byte), ascending in bytes
KindRates = tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...]

FLOAT_BYTES = 4  # the rates are float32's

# A convolution's reduction (in_channels / groups · kernel elements) at or below NARROW_REDUCTION
# runs at the narrow table's rates, at or above DEEP_REDUCTION at the deep one's; in between the
# two are blended (log-linearly in the reduction).
NARROW_REDUCTION, DEEP_REDUCTION = 27, 144

# glibc's largest mmap threshold on 64-bit (32 MiB): a larger block is always mapped afresh and
# unmapped at its release, so each allocation of a tensor this big page-faults on first touch.
# Smaller blocks are taken as reused, as in a training step's steady state (glibc raises its
# threshold to the largest block released). Other allocators (jemalloc, a GPU's caching one)
# differ.
FRESH_ALLOCATION = 32 << 20

# The layer kinds priced per byte of their input (`ComputeRates.layers`), and the module types
# of each (the first kind whose types match).
LAYER_KINDS: tuple[str, ...] = ("relu", "gelu", "tanh", "max_pool", "avg_pool",
                                "global_avg_pool", "batch_norm", "layer_norm", "dropout",
                                "cross_entropy")


def make_curve(points: Iterable[Sequence[float]]) -> Curve:
    """A rate table from (flops, flop/s) points: sorted by flops, and with times made
    non-decreasing (a call of more flops is never predicted faster than a smaller one; of two
    points with the same flops the slower stays). Raises ValueError on an empty table or a
    point that is not positive and finite."""
    pts = sorted((float(f), float(r)) for f, r in points)
    if not pts:
        raise ValueError("a rate table needs at least one (flops, flop/s) point")
    out: list[tuple[float, float]] = []
    longest = 0.0
    for flops, rate in pts:
        if not (math.isfinite(flops) and math.isfinite(rate) and flops > 0 and rate > 0):
            raise ValueError(f"a rate table's point must be positive and finite: "
                             f"({flops}, {rate})")
        longest = max(longest, flops / rate)
        if out and out[-1][0] == flops:
            out.pop()
        out.append((flops, flops / longest))
    return tuple(out)


def curve_seconds(points: Curve, flops: float, floor: bool = True) -> float:
    """Seconds of a call of `flops` flops: the time interpolated log-log between the table's
    points (equivalently the rate: log rate = log flops − log time). Clamped at the ends: below
    the smallest point the smallest point's time (its fixed cost is a floor; with `floor`
    False its rate), above the largest the largest point's rate."""
    if flops <= 0:
        return 0.0
    first_flops, first_rate = points[0]
    if flops <= first_flops:
        return first_flops / first_rate if floor else flops / first_rate
    last_flops, last_rate = points[-1]
    if flops >= last_flops:
        return flops / last_rate
    i = bisect.bisect_left([f for f, _ in points], flops)
    (fa, ra), (fb, rb) = points[i - 1], points[i]
    ta, tb = fa / ra, fb / rb
    w = math.log(flops / fa) / math.log(fb / fa)
    return math.exp(math.log(ta) + w * (math.log(tb) - math.log(ta)))


def make_gemm_table(bands: Mapping[Any, Iterable[Sequence[float]]] | Iterable[Sequence[float]]
                    ) -> GemmTable:
    """A matrix-product table from {smallest dimension: (flops, flop/s) points} (keys may be
    strings, as JSON has them); plain points are one band, for every shape."""
    if not isinstance(bands, Mapping):
        return ((1, make_curve(bands)),)
    table = sorted((int(rows), make_curve(points)) for rows, points in bands.items())
    if not table or any(rows < 1 for rows, _ in table):
        raise ValueError("a matrix-product table needs bands of at least 1 row")
    return tuple(table)


def gemm_table_seconds(table: GemmTable, m: int, k: int, n: int) -> float:
    """Seconds of an (m×k)·(k×n) product: from the band of its smallest dimension (the reuse
    of the other operands: a product of few rows runs far below the peak); between two bands
    log-linearly in that dimension; beyond the ends the end bands."""
    smallest, flops = min(m, k, n), 2.0 * m * k * n
    if flops <= 0:
        return 0.0
    if smallest <= table[0][0]:
        return curve_seconds(table[0][1], flops)
    if smallest >= table[-1][0]:
        return curve_seconds(table[-1][1], flops, floor=False)
    i = bisect.bisect_left([rows for rows, _ in table], smallest)
    (ra, ca), (rb, cb) = table[i - 1], table[i]
    ta, tb = curve_seconds(ca, flops), curve_seconds(cb, flops, floor=False)
    w = math.log(smallest / ra) / math.log(rb / ra)
    return float(ta ** (1 - w) * tb ** w)


def make_kind_rates(rates: Mapping[str, Iterable[Sequence[float]]]) -> KindRates:
    """The per-kind table from {kind: [(input bytes, forward, backward seconds per input
    byte), ...]}: sorted by bytes; ValueError on an unknown kind, an empty list or a value that
    is not positive and finite (a kind left out is priced at its default)."""
    out = []
    for kind, points in rates.items():
        if kind not in LAYER_KINDS:
            raise ValueError(f"unknown layer kind '{kind}'; known: {', '.join(LAYER_KINDS)}")
        rows = sorted(tuple(float(v) for v in point) for point in points)
        if not rows or any(len(row) != 3 or not all(math.isfinite(v) and v > 0 for v in row)
                           for row in rows):
            raise ValueError(f"a layer kind's points must be (bytes, forward, backward), "
                             f"positive and finite: {kind} {rows}")
        out.append((kind, tuple((b, f, w) for b, f, w in rows)))
    return tuple(sorted(out))


def _per_byte(points: tuple[tuple[float, float, float], ...], nbytes: float
              ) -> tuple[float, float]:
    """(forward, backward) seconds per byte at `nbytes`: log-log between the points, the end
    points' beyond them."""
    if nbytes <= points[0][0]:
        return points[0][1], points[0][2]
    if nbytes >= points[-1][0]:
        return points[-1][1], points[-1][2]
    i = bisect.bisect_left([p[0] for p in points], nbytes)
    (ba, fa, wa), (bb, fb, wb) = points[i - 1], points[i]
    t = math.log(nbytes / ba) / math.log(bb / ba)
    return fa ** (1 - t) * fb ** t, wa ** (1 - t) * wb ** t


def _blend(narrow: float, deep: float, reduction: float) -> float:
    """The narrow value at a narrow reduction, the deep one at a deep reduction, log-linear
    (geometric) in between."""
    if reduction <= NARROW_REDUCTION:
        return narrow
    if reduction >= DEEP_REDUCTION:
        return deep
    w = math.log(reduction / NARROW_REDUCTION) / math.log(DEEP_REDUCTION / NARROW_REDUCTION)
    return float(narrow ** (1 - w) * deep ** w)


# The defaults: one thread of a modern x86 core with AVX-512, as measured on a 2-core AMD EPYC
# VM (torch 2.13, MKL and oneDNN kernels; medians of two quiet calibrations, rounded). Matrix
# products reach ~100 Gflop/s with 256 rows, ~95 with 64 and ~75 with 16 (and half that for a
# 16-row product with a 4096² weight); a 1e4-flop product costs ~2.5 µs. Deep convolutions
# ~110 Gflop/s, narrow (3-channel) ones ~65, small ones ~50 µs at least. An elementwise pass
# ~35 GB/s on tensors of a few MB; ~2.4 µs of dispatcher and autograd per operator call;
# fresh memory at ~2.3 GB/s (a virtual machine's page faults: bare metal is a few times
# faster).
DEFAULT_GEMM = make_gemm_table({
    16: [(8.2e3, 3.4e9), (2.5e4, 9.2e9), (8.3e4, 2.1e10), (2.6e5, 4.2e10), (8.2e5, 6.8e10),
         (2.1e6, 7.6e10), (8.4e6, 7.2e10), (2.6e7, 7.7e10), (8.2e7, 6.4e10), (2.5e8, 4.3e10)],
    64: [(5.2e5, 6.2e10), (1.7e6, 7.2e10), (5.2e6, 8e10), (1.9e7, 9.5e10), (5.2e7, 9.4e10),
         (1.7e8, 8.5e10), (5.4e8, 7.4e10), (1.6e9, 7.5e10)],
    256: [(3.4e7, 1e11), (1e8, 1e11), (3.5e8, 9.9e10), (1e9, 9.5e10), (3.4e9, 9.2e10)]})
DEFAULT_GEMM_NARROW_OUTPUT = 2.5
DEFAULT_CONV = make_curve([(8.8e5, 1.3e10), (3.2e6, 4.5e10), (9.4e6, 7.3e10), (3.3e7, 9.6e10),
                           (9.4e7, 1.1e11), (3.2e8, 1.1e11), (1e9, 1.05e11)])
DEFAULT_CONV_NARROW = make_curve([(1.1e5, 2.7e9), (3.3e5, 7.5e9), (8.8e5, 1.8e10),
                                  (3.1e6, 4.3e10), (1.1e7, 5.5e10), (3.2e7, 6.6e10),
                                  (1e8, 6.6e10), (3.2e8, 5.2e10)])
DEFAULT_CONV_BACKWARD = (1.03, 1.17)
DEFAULT_CONV_NARROW_BACKWARD = (3.5, 0.95)
DEFAULT_CONV_OVERHEAD = 7e-5
DEFAULT_LINEAR_OVERHEAD = 3.2e-5
DEFAULT_MEMORY = 3.5e10
DEFAULT_DISPATCH = 2.4e-6
DEFAULT_BACKWARD_START = 1.7e-5
DEFAULT_FRESH_MEMORY = 2.3e9
DEFAULT_STEP_OVERHEAD = 2e-4  # the runner's own per-step work, measured on this 2-core machine
_KB, _MB = 1 << 10, 1 << 20
DEFAULT_KIND_RATES = make_kind_rates({  # input bytes, forward and backward seconds per byte
    kind: [(size, fwd * 1e-12, bwd * 1e-12) for size, (fwd, bwd) in
           zip((256 * _KB, 2 * _MB, 8 * _MB), points, strict=True)]
    for kind, points in {
        "relu": [(30, 85), (27, 83), (40, 150)],
        "gelu": [(150, 400), (130, 300), (150, 300)],
        "tanh": [(660, 135), (655, 130), (645, 150)],
        "max_pool": [(1000, 220), (1375, 275), (1380, 280)],
        "avg_pool": [(470, 590), (460, 460), (455, 520)],
        "global_avg_pool": [(23, 300), (18, 140), (15, 170)],
        "batch_norm": [(500, 220), (470, 250), (490, 350)],
        "layer_norm": [(75, 200), (80, 215), (85, 225)],
        "dropout": [(3100, 620), (3170, 635), (3160, 630)],
        "cross_entropy": [(125, 155), (140, 160), (165, 300)],
    }.items()})


@dataclass(frozen=True)
class ComputeRates:
    """What this machine's local operations cost one rank (float32, `threads` torch threads).

    The methods give an operation's kernel time only; the module functions (`matmul_seconds`,
    `conv_call_seconds`, `pass_seconds`, `layer_seconds`, ...) add the operator calls'
    `dispatch`."""

    gemm: GemmTable
    """float32 matrix products (m×k by k×n: 2mkn flops) as a Linear layer's forward and
    backward issue them, by their smallest dimension (a Linear's: its rows, the batch): per
    band of that dimension (16, 64, 256 rows) a table of (flops per call, achieved flop/s),
    ascending in flops, from ~1e4 to ~3e9 flops. The time of one call without autograd, its
    fixed cost included. Few rows reuse each weight little: 16 rows run a 4096² layer at
    half the rate of 256."""

    conv: Curve
    """`F.conv2d` forward of a deep convolution (in_channels / groups · kernel elements ≥ 144:
    the body of a CNN): (flops per call, achieved flop/s), flops = 2·N·Cout·(output elements
    per channel)·Cin/groups·(kernel elements)."""

    memory: float
    """Bytes per second of an elementwise pass: `y = f(x)` over a tensor of n bytes (reading n
    and writing n) takes n / memory seconds (measured on tensors of a few MB)."""

    dispatch: float
    """Seconds of framework overhead per operator call in a training step (the dispatcher and
    autograd: the forward's recording and the backward node's run), measured on tiny tensors;
    what a small layer's time mostly is."""

    gemm_narrow_output: float = DEFAULT_GEMM_NARROW_OUTPUT
    """A Linear's forward product into 2 to 15 out features (a classifier head), in times of
    `gemm_seconds` (its kernels run such a product at a fraction of the rate of the same flops
    the other way round)."""

    linear_overhead: float = DEFAULT_LINEAR_OVERHEAD
    """Seconds of a Linear layer's forward and backward under autograd beyond its kernels
    (its products, its bias gradient's sum): its operator calls' dispatch, its gradients'
    zeroing and accumulation at a small layer's size (larger ones add passes over their
    parameters)."""

    conv_narrow: Curve = DEFAULT_CONV_NARROW
    """`F.conv2d` forward of a narrow convolution (reduction ≤ 27: 1 to 3 input channels, an
    image's first layer, which the kernels run well below the deep rate): the same table."""

    conv_backward: tuple[float, float] = DEFAULT_CONV_BACKWARD
    """A deep convolution's gradients, (input, weight), each in forward times of the same
    convolution (each is a convolution of the forward's flops)."""

    conv_narrow_backward: tuple[float, float] = DEFAULT_CONV_NARROW_BACKWARD
    """The same for a narrow convolution: its input gradient is much dearer than its forward."""

    conv_overhead: float = DEFAULT_CONV_OVERHEAD
    """Seconds of a convolution layer's forward and backward under autograd beyond its three
    convolutions: its operator calls' dispatch and oneDNN's set-up around them."""

    layers: KindRates = ()
    """Layers priced by their tensors' bytes: per kind (LAYER_KINDS), the forward and backward
    seconds per byte of the layer's input at a few input sizes (in cache, in the last level,
    from memory), measured under autograd less the operator calls' dispatch; interpolated
    log-log in bytes. A kind left out is priced at DEFAULT_KIND_RATES'."""

    backward_start: float = DEFAULT_BACKWARD_START
    """Seconds of a `backward()` call's own start (the autograd engine's set-up), once a step:
    in `loss_seconds`."""

    fresh_memory: float = DEFAULT_FRESH_MEMORY
    """Bytes per second of first touches of newly mapped memory (page faults, the kernel's
    zeroing): paid by every tensor of more than FRESH_ALLOCATION bytes, which the allocator
    maps anew at each allocation."""

    step_overhead: float = 0.0
    """Seconds the runner spends per training step besides the model, the loss and the update
    (the batch's rows, the step's bookkeeping, the metrics line): measured by running the
    runner itself on one process (`gridrun-plan plan.calibrate=true`)."""

    threads: int = 1
    """The torch threads the rates were measured with (a rank runs with
    cores // ranks-on-the-node threads, at least 1: `runner.training.rank`)."""

    source: str = "default"
    """Where the numbers come from: "default", "calibrated (<path>)"."""

    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False,
                                     repr=False)
    """Anything else a calibration stored (for reports; unused by the model)."""

    def gemm_seconds(self, m: int, k: int, n: int) -> float:
        """Kernel seconds of one float32 (m×k)·(k×n) product (no dispatch)."""
        return gemm_table_seconds(self.gemm, m, k, n)

    def conv_seconds(self, batch: int, in_channels: int, out_channels: int,
                     out_spatial: Sequence[int], kernel: Sequence[int], groups: int = 1,
                     part: str = "forward") -> float:
        """Kernel seconds of one convolution (no dispatch): `part` "forward", "grad_input" or
        "grad_weight" (the two gradients of the backward). `out_spatial`: the output's spatial
        sizes (height, width for a Conv2d), `kernel` the kernel's."""
        reduction = in_channels // max(groups, 1) * math.prod(kernel)
        flops = 2.0 * batch * out_channels * math.prod(out_spatial) * reduction
        if flops <= 0:
            return 0.0
        forward = _blend(curve_seconds(self.conv_narrow, flops),
                         curve_seconds(self.conv, flops), reduction)
        if part == "forward":
            return forward
        index = {"grad_input": 0, "grad_weight": 1}.get(part)
        if index is None:
            raise ValueError(f"unknown convolution part '{part}': forward, grad_input or "
                             "grad_weight")
        return forward * _blend(self.conv_narrow_backward[index], self.conv_backward[index],
                                reduction)

    def elementwise_seconds(self, nbytes: float) -> float:
        """Kernel seconds of passes over `nbytes` bytes of tensors (no dispatch): one pass over
        a tensor of n bytes reads n and writes n (`y = relu(x)`)."""
        return max(nbytes, 0.0) / self.memory

    def kind_seconds(self, kind: str, input_bytes: float, backward: bool = True) -> float:
        """Kernel seconds of a layer of `kind` (LAYER_KINDS) on an input of `input_bytes`:
        its forward, and its backward unless `backward` is False (no dispatch)."""
        found = dict((*DEFAULT_KIND_RATES, *self.layers))
        if kind not in found:
            raise ValueError(f"unknown layer kind '{kind}'; known: {', '.join(LAYER_KINDS)}")
        if input_bytes <= 0:
            return 0.0
        fwd, bwd = _per_byte(found[kind], input_bytes)
        return input_bytes * (fwd + (bwd if backward else 0.0))

    def allocation_seconds(self, *nbytes: float) -> float:
        """Seconds of allocating tensors of these sizes: those above FRESH_ALLOCATION are newly
        mapped memory whose first touch page-faults; smaller ones reuse the allocator's."""
        return sum(n for n in nbytes if n > FRESH_ALLOCATION) / self.fresh_memory

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a calibration stores (`from_dict` reads it back)."""
        return {"gemm": {str(rows): [list(p) for p in curve] for rows, curve in self.gemm},
                "gemm_narrow_output": self.gemm_narrow_output,
                "conv": [list(p) for p in self.conv],
                "conv_narrow": [list(p) for p in self.conv_narrow],
                "conv_backward": list(self.conv_backward),
                "conv_narrow_backward": list(self.conv_narrow_backward),
                "conv_overhead": self.conv_overhead, "linear_overhead": self.linear_overhead,
                "layers": {kind: [list(p) for p in points] for kind, points in self.layers},
                "memory": self.memory, "dispatch": self.dispatch,
                "backward_start": self.backward_start, "fresh_memory": self.fresh_memory,
                "step_overhead": self.step_overhead, "threads": self.threads,
                **dict(self.extra)}

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any], source: str = "calibrated") -> ComputeRates:
        """Rates from their JSON form (`to_dict`, `measure_compute`): gemm, conv, memory and
        dispatch required, the rest defaulted; KeyError, TypeError or ValueError where it is
        not that form."""
        def pair(value: Any) -> tuple[float, float]:
            a, b = (float(v) for v in value)
            if not all(math.isfinite(v) and v > 0 for v in (a, b)):
                raise ValueError(f"gradient factors must be positive and finite: {value}")
            return a, b

        def positive(value: Any) -> float:
            number = float(value)
            if not (math.isfinite(number) and number > 0):
                raise ValueError(f"a rate must be positive and finite: {value}")
            return number

        known = {"gemm", "gemm_narrow_output", "conv", "conv_narrow", "conv_backward",
                 "conv_narrow_backward", "conv_overhead", "linear_overhead", "layers",
                 "memory", "dispatch",
                 "backward_start", "fresh_memory", "step_overhead", "threads"}
        narrow = stored.get("conv_narrow")
        return cls(
            gemm=make_gemm_table(stored["gemm"]), conv=make_curve(stored["conv"]),
            gemm_narrow_output=positive(stored.get("gemm_narrow_output",
                                                   DEFAULT_GEMM_NARROW_OUTPUT)),
            memory=positive(stored["memory"]), dispatch=positive(stored["dispatch"]),
            conv_narrow=DEFAULT_CONV_NARROW if narrow is None else make_curve(narrow),
            conv_backward=pair(stored.get("conv_backward", DEFAULT_CONV_BACKWARD)),
            conv_narrow_backward=pair(stored.get("conv_narrow_backward",
                                                 DEFAULT_CONV_NARROW_BACKWARD)),
            conv_overhead=positive(stored.get("conv_overhead", DEFAULT_CONV_OVERHEAD)),
            linear_overhead=positive(stored.get("linear_overhead", DEFAULT_LINEAR_OVERHEAD)),
            layers=make_kind_rates(stored.get("layers", {})),
            backward_start=positive(stored.get("backward_start", DEFAULT_BACKWARD_START)),
            fresh_memory=positive(stored.get("fresh_memory", DEFAULT_FRESH_MEMORY)),
            step_overhead=max(0.0, float(stored.get("step_overhead", DEFAULT_STEP_OVERHEAD))),
            threads=int(stored.get("threads", 1)), source=source,
            extra={k: v for k, v in stored.items() if k not in known})


DEFAULT_RATES = ComputeRates(gemm=DEFAULT_GEMM, conv=DEFAULT_CONV, memory=DEFAULT_MEMORY,
                             dispatch=DEFAULT_DISPATCH, step_overhead=DEFAULT_STEP_OVERHEAD)


# -- operations a strategy builds by hand (each one operator call: kernel + dispatch) ------------

def matmul_seconds(m: int, k: int, n: int, rates: ComputeRates) -> float:
    """Seconds of one (m×k)·(k×n) product, forward only, its dispatch included: the backward's
    products (each another call) are the caller's to add."""
    return rates.gemm_seconds(m, k, n) + rates.dispatch


def conv_call_seconds(batch: int, in_channels: int, out_channels: int,
                      out_spatial: Sequence[int], kernel: Sequence[int], rates: ComputeRates,
                      groups: int = 1, part: str = "forward") -> float:
    """Seconds of one convolution call (`ComputeRates.conv_seconds`), its dispatch included."""
    return rates.conv_seconds(batch, in_channels, out_channels, out_spatial, kernel, groups,
                              part) + rates.dispatch


def pass_seconds(nbytes: float, rates: ComputeRates, calls: int = 1) -> float:
    """Seconds of elementwise passes over `nbytes` bytes in `calls` operator calls (dispatch
    included)."""
    return rates.elementwise_seconds(nbytes) + calls * rates.dispatch


# -- operators a module's own forward runs between its leaf modules ----------------------------

# Operators that make a view (no kernel): dispatch only, forward and back.
VIEW_OPERATORS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
    "expand_as", "unsqueeze", "squeeze", "alias", "detach", "as_strided", "view_as",
    "unflatten", "flatten", "lift_fresh", "_to_copy_view", "numpy_T", "mT"})
# Views of a part of their input: the backward writes the whole input's gradient (zeros, then
# the part), one pass over the input.
PART_OPERATORS = frozenset({"slice", "select", "narrow", "split", "split_with_sizes", "chunk",
                            "unbind", "diagonal"})
# Matrix products: (m×k)·(k×n), in a batch for bmm/baddbmm.
PRODUCT_OPERATORS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
# An attention kernel's passes over its score matrix (the softmax and its scaling), forward;
# its backward recomputes the scores and makes three products to the forward's two.
ATTENTION_SCORE_PASSES = 2.0
ATTENTION_BACKWARD = 2.5
# An elementwise operator's backward: a gradient for each floating input, each reading the
# output's gradient and a saved tensor (twice the forward's traffic, as a product's).
ELEMENTWISE_BACKWARD = 2.0


@dataclass(frozen=True)
class OperatorCall:
    """One operator a module's own `forward` runs outside its leaf modules (attention's
    products or kernel, a softmax, the rotary embedding's products and sums, a residual sum),
    as one sample's forward shows it (`strategies.probe.operator_calls`)."""

    name: str  # the aten operator, without overload ("bmm", "mul")
    shapes: tuple[tuple[int, ...], ...]  # its tensor arguments' shapes, dim 0 one sample's
    nbytes: int  # the bytes of its tensor arguments and results
    backward: bool  # a floating argument needs a gradient: it has a backward


def operator_seconds(call: OperatorCall, rows: int, rates: ComputeRates,
                     share: float = 1.0) -> float:
    """Forward + backward seconds of `call` on `rows` samples: every argument's dim 0 (the
    samples, or the samples folded with positions or heads) `rows` times one sample's, and
    `share` of its work where a rank runs a part of it (its heads of an attention). Products
    by the matrix-product rates, attention kernels by their products and score passes, views by
    their dispatch, every other operator as passes over its tensors' bytes."""
    dispatch = rates.dispatch * (2 if call.backward else 1)
    name, shapes = call.name, call.shapes
    if name in VIEW_OPERATORS:
        return dispatch
    if name in PART_OPERATORS:
        whole = _numel(shapes[0]) * rows * FLOAT_BYTES if shapes else 0
        return dispatch + (share * rates.elementwise_seconds(whole) if call.backward else 0.0)
    if name in PRODUCT_OPERATORS and len(shapes) >= 2 and len(shapes[-1]) == len(shapes[-2]):
        a, b = shapes[-2], shapes[-1]
        batch = (a[0] * rows, 1) if len(a) == 3 else (1, rows)
        products, m, k, n = batch[0] * share, a[-2] * batch[1], a[-1], b[-1]
        forward = rates.gemm_seconds(m, k, n)
        backward = rates.gemm_seconds(m, n, k) + rates.gemm_seconds(k, m, n)
        return products * (forward + (backward if call.backward else 0.0)) + dispatch
    if "scaled_dot_product" in name and len(shapes) >= 3 and len(shapes[0]) >= 3:
        q, k_shape = shapes[0], shapes[1]
        heads = _numel(q[:-2]) * rows * share
        positions, keys, width = q[-2], k_shape[-2], q[-1]
        products = heads * (rates.gemm_seconds(positions, width, keys)
                            + rates.gemm_seconds(positions, keys, width))
        scores = rates.elementwise_seconds(
            ATTENTION_SCORE_PASSES * heads * positions * keys * FLOAT_BYTES)
        forward = products + scores
        return forward * (1 + (ATTENTION_BACKWARD if call.backward else 0.0)) + dispatch
    forward = share * rates.elementwise_seconds(0.5 * call.nbytes * rows)
    return forward * (1 + (ELEMENTWISE_BACKWARD if call.backward else 0.0)) + dispatch


def oversubscription(ranks_on_node: int, cores: int) -> float:
    """How much slower each rank computes when the node's ranks share its cores: ranks / cores,
    at least 1. Ranks run one torch thread each when there are more ranks than cores
    (`runner.training.rank`), so r ranks on c < r cores take turns and each gets c / r of a core;
    with a core each (or more: each then runs several threads, which rates measured with as many
    `threads` reflect) nothing slows down."""
    return max(1.0, ranks_on_node / max(cores, 1))


# -- whole layers --------------------------------------------------------------------------------

# Per layer kind, its operator calls forward and backward (the calibration takes their dispatch
# out of the per-byte rates it measures).
KIND_CALLS = {"relu": 2, "gelu": 10, "tanh": 2, "max_pool": 3, "avg_pool": 3,
              "global_avg_pool": 4, "batch_norm": 11, "layer_norm": 8, "dropout": 5,
              "cross_entropy": 8}
_PARAM_PASSES = 2.0  # a gradient's zeroing (½ pass: writes only) and accumulation (1½)
_UNKNOWN_PASSES = 6.0  # a layer of unknown kind: passes over its input and output
_UNKNOWN_CALLS = 6

_KIND_TYPES: tuple[tuple[str, tuple[type[nn.Module], ...]], ...] = (
    ("relu", (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish,
              nn.PReLU, nn.Threshold, nn.Softsign, nn.Hardshrink, nn.Softshrink)),
    ("gelu", (nn.GELU,)),
    ("tanh", (nn.Tanh, nn.Sigmoid, nn.SiLU, nn.ELU, nn.CELU, nn.SELU, nn.Softplus, nn.Mish,
              nn.LogSigmoid, nn.Tanhshrink, nn.Softmax, nn.LogSoftmax, nn.Softmin)),
    ("max_pool", (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d,
                  nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d, nn.FractionalMaxPool2d,
                  nn.FractionalMaxPool3d)),
    ("avg_pool", (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.LPPool1d, nn.LPPool2d,
                  nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)),
    ("batch_norm", (nn.modules.batchnorm._NormBase, nn.GroupNorm)),
    ("layer_norm", (nn.LayerNorm, nn.RMSNorm, nn.LocalResponseNorm)),
    ("dropout", (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                 nn.FeatureAlphaDropout)),
)
_GLOBAL_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_VIEWS = (nn.Flatten, nn.Unflatten, nn.Identity)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def layer_kind(layer: nn.Module) -> str | None:
    """The kind (LAYER_KINDS) a layer is priced as per byte of its input; None for a layer
    priced otherwise (products, views) or not known."""
    if isinstance(layer, _GLOBAL_POOLS):
        size = layer.output_size
        if all(v == 1 for v in (size if isinstance(size, (tuple, list)) else (size,))):
            return "global_avg_pool"
    for kind, types in _KIND_TYPES:
        if isinstance(layer, types):
            return kind
    return None


def _tuple(size: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in (size if isinstance(size, (tuple, list)) else (size,)))


def linear_seconds(rows: int, in_features: int, out_features: int, rates: ComputeRates, *,
                   bias: bool = True, input_grad: bool = True) -> float:
    """Forward + backward seconds of a Linear (in_features → out_features) on `rows` rows: the
    forward product, the weight's gradient product, the input's gradient product (not when
    `input_grad` is False: a first layer), the bias gradient's row sum, the accumulation of the
    gradients into `.grad`, and `linear_overhead` (the operator calls' dispatch)."""
    m, k, n = rows, in_features, out_features
    narrow = rates.gemm_narrow_output if 1 < n < 16 else 1.0  # a classifier head's forward
    seconds = narrow * rates.gemm_seconds(m, k, n) + rates.gemm_seconds(n, m, k)
    if input_grad:
        seconds += rates.gemm_seconds(m, n, k)
    params = (k * n + (n if bias else 0)) * FLOAT_BYTES
    seconds += rates.elementwise_seconds(_PARAM_PASSES * params)
    if bias:  # the row sum (reads only)
        seconds += rates.elementwise_seconds(0.5 * m * n * FLOAT_BYTES)
    seconds += rates.allocation_seconds(m * n * FLOAT_BYTES, k * n * FLOAT_BYTES,
                                        m * k * FLOAT_BYTES if input_grad else 0)
    return seconds + rates.linear_overhead


def conv_layer_seconds(batch: int, in_channels: int, out_channels: int,
                       out_spatial: Sequence[int], kernel: Sequence[int], rates: ComputeRates,
                       *, in_spatial: Sequence[int] | None = None, groups: int = 1,
                       bias: bool = True, input_grad: bool = True) -> float:
    """Forward + backward seconds of a convolution layer: the forward convolution, its weight
    gradient, its input gradient (not when `input_grad` is False), the bias gradient's sum, the
    accumulation of the gradients into `.grad`, and `conv_overhead` (the operator calls'
    dispatch, oneDNN's set-up).
    `in_spatial`: the input's spatial sizes (for the input gradient's bytes; the output's if
    not given)."""
    shape = (batch, in_channels, out_channels, out_spatial, kernel, groups)
    seconds = rates.conv_seconds(*shape) + rates.conv_seconds(*shape, part="grad_weight")
    out_bytes = batch * out_channels * math.prod(out_spatial) * FLOAT_BYTES
    in_bytes = batch * in_channels * math.prod(in_spatial or out_spatial) * FLOAT_BYTES
    if input_grad:
        seconds += rates.conv_seconds(*shape, part="grad_input")
    weights = out_channels * (in_channels // max(groups, 1)) * math.prod(kernel)
    params = (weights + (out_channels if bias else 0)) * FLOAT_BYTES
    seconds += rates.elementwise_seconds(_PARAM_PASSES * params)
    if bias:
        seconds += rates.elementwise_seconds(0.5 * out_bytes)
    seconds += rates.allocation_seconds(out_bytes, in_bytes if input_grad else 0)
    return seconds + rates.conv_overhead


def loss_seconds(batch_rows: int, classes: int, rates: ComputeRates) -> float:
    """Forward + backward seconds of the cross-entropy of `batch_rows` rows of `classes` logits
    (log-softmax and the pick of the targets, and back), with the loss's scaling and the
    `backward()` call, which starts the autograd engine once a step."""
    logits = batch_rows * classes * FLOAT_BYTES
    return (rates.kind_seconds("cross_entropy", logits) + rates.allocation_seconds(logits)
            + KIND_CALLS["cross_entropy"] * rates.dispatch + rates.backward_start)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _conv_output(layer: nn.modules.conv._ConvNd, shape: tuple[int, ...]) -> tuple[int, ...]:
    spatial = shape[2:]
    dims = len(layer.kernel_size)
    if isinstance(layer.padding, str):  # "same" keeps the size, "valid" pads nothing
        pads: tuple[int, ...] = tuple(
            layer.dilation[d] * (layer.kernel_size[d] - 1) if layer.padding == "same" else 0
            for d in range(dims))
    else:
        pads = tuple(2 * p for p in layer.padding)
    out = tuple((spatial[d] + pads[d] - layer.dilation[d] * (layer.kernel_size[d] - 1) - 1)
                // layer.stride[d] + 1 for d in range(dims))
    return (shape[0], layer.out_channels, *out)


_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_ADAPTIVE_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                   nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)


def _pool_output(layer: nn.Module, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """A pooling layer's output shape by its formula (None: not a pooling layer this knows,
    or an input of another rank than it pools)."""
    if isinstance(layer, _ADAPTIVE_POOLS):
        dims = int(type(layer).__name__[-2])
        if len(shape) < dims + 1:
            return None
        size = layer.output_size
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,) * dims
        return (*shape[:-dims], *(s if o is None else int(o)
                                  for s, o in zip(shape[-dims:], sizes, strict=True)))
    if not isinstance(layer, _POOLS):
        return None
    dims = int(type(layer).__name__[-2])
    if len(shape) < dims + 1:
        return None

    def per_dim(value: Any) -> tuple[int, ...]:
        values = _tuple(value)
        return values * dims if len(values) == 1 else values

    kernel = per_dim(layer.kernel_size)
    stride = per_dim(layer.stride or layer.kernel_size)
    padding = per_dim(layer.padding)
    dilation = per_dim(getattr(layer, "dilation", 1))
    out = []
    for d in range(dims):
        span = shape[-dims + d] + 2 * padding[d] - dilation[d] * (kernel[d] - 1) - 1
        size = (-(-span // stride[d]) if layer.ceil_mode else span // stride[d]) + 1
        if layer.ceil_mode and (size - 1) * stride[d] >= shape[-dims + d] + padding[d]:
            size -= 1  # the last window must start inside the input or its left padding
        out.append(size)
    return (*shape[:-dims], *out)


def _meta_call(layer: nn.Module, shape: tuple[int, ...],
               hook: Any = None) -> tuple[int, ...] | None:
    """The output shape of `layer` on an input of `shape`, from a forward on the meta device
    (no memory, no compute; the layer's own tensors are not touched); None where the layer
    cannot run there. `hook`, if given, is a forward pre-hook put on every leaf module."""
    tensors = {name: torch.empty(t.shape, dtype=t.dtype, device="meta")
               for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
    leaves = [m for m in layer.modules() if not any(True for _ in m.children())]
    first = leaves[0] if leaves else layer
    dtype = torch.long if isinstance(first, (nn.Embedding, nn.EmbeddingBag)) else torch.float32
    handles = [] if hook is None else [m.register_forward_pre_hook(hook) for m in leaves]
    x = torch.empty(shape, dtype=dtype, device="meta")
    try:
        with torch.no_grad():  # a layer without tensors of its own runs as it is (no import)
            out = torch.func.functional_call(layer, tensors, (x,)) if tensors else layer(x)
    except Exception:  # a layer that cannot run on the meta device: priced without its output
        return None
    finally:
        for handle in handles:
            handle.remove()
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def output_shape(layer: nn.Module, local_input_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of `layer`'s output on an input of `local_input_shape` (batch first); the
    input's shape where it cannot be found."""
    shape = tuple(int(d) for d in local_input_shape)
    if isinstance(layer, nn.Linear):
        return (*shape[:-1], layer.out_features)
    if isinstance(layer, _CONVS) and len(shape) == len(layer.kernel_size) + 2:
        return _conv_output(layer, shape)
    if layer_kind(layer) in ("relu", "gelu", "tanh", "batch_norm", "layer_norm", "dropout") \
            or isinstance(layer, nn.Identity):
        return shape
    pooled = _pool_output(layer, shape)
    if pooled is not None:
        return pooled
    if isinstance(layer, nn.Flatten):
        start, end = (d % len(shape) for d in (layer.start_dim, layer.end_dim))
        return (*shape[:start], _numel(shape[start:end + 1]), *shape[end + 1:])
    found = _meta_call(layer, shape)
    return shape if found is None else found


def _has_params(layer: nn.Module) -> bool:
    return any(p.requires_grad for p in layer.parameters())


def _param_bytes(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters() if p.requires_grad) * FLOAT_BYTES


def layer_seconds(layer: nn.Module, local_input_shape: tuple[int, ...], rates: ComputeRates, *,
                  input_grad: bool = True) -> float:
    """Forward + backward seconds of `layer` on an input of `local_input_shape` (batch first:
    the rows and sizes a rank computes with), with the accumulation of its parameters'
    gradients and its operator calls' dispatch. `input_grad` False: the input needs no
    gradient (a first layer): the backward skips it (a Linear's or convolution's input-gradient
    product), and a layer without parameters then has no backward at all.

    Sizes the input does not give (out_features, out_channels, a kernel) are the layer's own:
    pass the rank's local layer (a stand-in on the meta device will do). Priced by kind: Linear
    and convolutions by their products (`linear_seconds`, `conv_layer_seconds`); activations,
    pooling, norms and dropout per byte of their input (`ComputeRates.layers`); embeddings by
    the rows they gather and their table's gradient; views (Flatten) by their dispatch; an
    nn.Sequential as its layers in turn, another module tree as the leaves a meta-device forward
    reaches (with a pass over its output: a residual sum); anything else conservatively, as
    passes over its input and output and, if it has parameters, the products of a dense layer
    of as many weights on its rows."""
    shape = tuple(int(d) for d in local_input_shape)
    if isinstance(layer, nn.Sequential):
        total, grad = 0.0, input_grad
        for child in layer:
            total += layer_seconds(child, shape, rates, input_grad=grad)
            grad = grad or _has_params(child)
            shape = output_shape(child, shape)
        return total
    if any(True for _ in layer.children()) and layer_kind(layer) is None:
        return _tree_seconds(layer, shape, rates, input_grad)
    return _leaf_seconds(layer, shape, rates, input_grad)


def _tree_seconds(layer: nn.Module, shape: tuple[int, ...], rates: ComputeRates,
                  input_grad: bool) -> float:
    leaves: list[tuple[nn.Module, tuple[int, ...]]] = []

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor):
            leaves.append((module, tuple(args[0].shape)))

    out = _meta_call(layer, shape, record)
    if out is None:
        return _unknown_seconds(layer, shape, shape, rates)
    total, grad = 0.0, input_grad
    for leaf, leaf_shape in leaves:
        total += _leaf_seconds(leaf, leaf_shape, rates, grad)
        grad = grad or _has_params(leaf)
    # a residual sum, forward and backward (the gradient passes to both summands)
    return total + rates.elementwise_seconds(2.5 * _numel(out) * FLOAT_BYTES) \
        + 2 * rates.dispatch


def _leaf_seconds(layer: nn.Module, shape: tuple[int, ...], rates: ComputeRates,
                  input_grad: bool) -> float:
    if isinstance(layer, nn.Linear):
        return linear_seconds(_numel(shape[:-1]), layer.in_features, layer.out_features, rates,
                              bias=layer.bias is not None, input_grad=input_grad)
    if isinstance(layer, _CONVS) and len(shape) == len(layer.kernel_size) + 2:
        out = _conv_output(layer, shape)
        return conv_layer_seconds(shape[0], layer.in_channels, layer.out_channels, out[2:],
                                  layer.kernel_size, rates, in_spatial=shape[2:],
                                  groups=layer.groups, bias=layer.bias is not None,
                                  input_grad=input_grad)
    if isinstance(layer, _VIEWS):
        return 0.0 if isinstance(layer, nn.Identity) else rates.dispatch
    nbytes = _numel(shape) * FLOAT_BYTES
    kind = layer_kind(layer)
    if kind is not None:
        if kind == "dropout" and (not layer.training or getattr(layer, "p", 1.0) == 0):
            return rates.dispatch
        params = _param_bytes(layer)
        backward = input_grad or params > 0
        calls = KIND_CALLS[kind] if backward else max(1, KIND_CALLS[kind] // 2)
        out_bytes = _numel(output_shape(layer, shape)) * FLOAT_BYTES
        return (rates.kind_seconds(kind, nbytes, backward)
                + rates.elementwise_seconds(_PARAM_PASSES * params)
                + rates.allocation_seconds(out_bytes, nbytes if backward else 0)
                + calls * rates.dispatch)
    if isinstance(layer, (nn.Embedding, nn.EmbeddingBag)):
        out_bytes = _numel(output_shape(layer, shape)) * FLOAT_BYTES
        # the gather of the rows; backward their scatter into the table's gradient
        seconds = rates.elementwise_seconds(2.0 * out_bytes)
        if not layer.sparse:  # a dense gradient: the table's worth built, zeroed, accumulated
            seconds += rates.elementwise_seconds((_PARAM_PASSES + 1) * _param_bytes(layer))
            seconds += rates.allocation_seconds(_param_bytes(layer))
        return seconds + rates.allocation_seconds(out_bytes) + 6 * rates.dispatch
    return _unknown_seconds(layer, shape, output_shape(layer, shape), rates)


def _unknown_seconds(layer: nn.Module, shape: tuple[int, ...], out: tuple[int, ...],
                     rates: ComputeRates) -> float:
    tensors = (_numel(shape) + _numel(out)) * FLOAT_BYTES
    seconds = rates.elementwise_seconds(_UNKNOWN_PASSES * tensors) \
        + _UNKNOWN_CALLS * rates.dispatch
    weights = sum(p.numel() for p in layer.parameters())
    if weights:  # as a dense layer of as many weights on these rows: three products
        rows = shape[0] if shape else 1
        seconds += 3 * rates.gemm_seconds(rows, weights, 1)
        seconds += rates.elementwise_seconds(_PARAM_PASSES * weights * FLOAT_BYTES)
    return seconds
