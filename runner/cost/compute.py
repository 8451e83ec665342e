"""Compute time of a rank's local work: this machine's per-operation rates, the seconds of
the operations a strategy builds by hand (a product, a convolution, elementwise passes) at
them, and the wait of ranks sharing cores. What a whole layer, or an operator a module's own
`forward` runs, costs at these rates is `runner.cost.layers`'s.

A training step's time is compute + communication + wait; `runner.cost.collectives` prices the
communication, this module and `runner.cost.layers` the compute. The rates (`ComputeRates`)
are measured by `python -m runner.plan plan.calibrate=true` (`runner.plan.calibration`'s
`measure_compute`) and found again by `runner.config.machine.load_compute_rates`; until then
`DEFAULT_RATES` stand in.

The model, per operation a rank's layer issues (float32 throughout):

- a matrix product (m×k by k×n: 2mkn flops) takes `gemm_seconds`: its flops at the rate
  achieved at that many flops, interpolated log-log in a measured table. Small products run far
  below the peak (their fixed cost dominates), and the table says how far;
- a convolution likewise (`conv_seconds`, of a `ConvShape`), from one of two tables: deep
  reductions (the body of a CNN) and narrow ones (an image's first layer, 1 to 3 input
  channels, which the kernels run at a fraction of the rate); its two gradients are measured
  multiples of its forward;
- a layer priced by its tensors' bytes (activations, pooling, norms, dropout, the loss) takes
  seconds per byte of its input measured for its kind (`layers`); other elementwise work
  (gradient accumulation, an optimizer's update, packing for communication) streams at
  `memory` bytes per second (`elementwise_seconds`);
- every operator call costs `dispatch` seconds of framework overhead (the dispatcher and
  autograd: recording the forward, running the backward node): most of a small layer's time.
  A Linear's and a convolution's calls (and oneDNN's set-up) are measured whole, as
  `linear_overhead` and `conv_overhead`; a step's single `backward()` call starts the engine
  (`backward_start`); the counts of operator calls per layer kind (KIND_CALLS) were fitted to
  measurements on a 2-core x86 (AMD EPYC, AVX-512) machine with one torch thread (torch 2.13,
  MKL and oneDNN kernels);
- a tensor of more than FRESH_ALLOCATION bytes is newly mapped memory at each allocation, and
  its first touch page-faults (`fresh_memory`).

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
# Per layer kind, its operator calls forward and backward (the calibration takes their dispatch
# out of the per-byte rates it measures).
KIND_CALLS = {"relu": 2, "gelu": 10, "tanh": 2, "max_pool": 3, "avg_pool": 3,
              "global_avg_pool": 4, "batch_norm": 11, "layer_norm": 8, "dropout": 5,
              "cross_entropy": 8}


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
class ConvShape:
    """A convolution's sizes on a rank: its batch, channels, groups, and the spatial sizes of its
    output (height, width for a Conv2d), of its kernel and of its input (for the input
    gradient's bytes; the output's when not given)."""

    batch: int
    in_channels: int
    out_channels: int
    out_spatial: tuple[int, ...]
    kernel: tuple[int, ...]
    groups: int = 1
    in_spatial: tuple[int, ...] | None = None

    @property
    def reduction(self) -> int:
        """The products summed per output element: in_channels / groups · kernel elements."""
        return self.in_channels // max(self.groups, 1) * math.prod(self.kernel)

    @property
    def flops(self) -> float:
        """The forward's: 2 · batch · out_channels · output elements per channel · reduction."""
        return 2.0 * self.batch * self.out_channels * math.prod(self.out_spatial) * self.reduction


@dataclass(frozen=True)
class ComputeRates:
    """What this machine's local operations cost one rank (float32, `threads` torch threads).

    The methods give an operation's kernel time only; the module functions (`matmul_seconds`,
    `conv_call_seconds`, `pass_seconds`, and `runner.cost.layers`' `layer_seconds`, ...) add
    the operator calls' `dispatch`."""

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
    in `runner.cost.layers.loss_seconds`."""

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

    def conv_seconds(self, conv: ConvShape, part: str = "forward") -> float:
        """Kernel seconds of one convolution (no dispatch): `part` "forward", "grad_input" or
        "grad_weight" (the two gradients of the backward)."""
        reduction, flops = conv.reduction, conv.flops
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


# -- operations a strategy builds by hand (each one operator call: kernel + dispatch) ----------

def matmul_seconds(m: int, k: int, n: int, rates: ComputeRates) -> float:
    """Seconds of one (m×k)·(k×n) product, forward only, its dispatch included: the backward's
    products (each another call) are the caller's to add."""
    return rates.gemm_seconds(m, k, n) + rates.dispatch


def conv_call_seconds(conv: ConvShape, rates: ComputeRates, part: str = "forward") -> float:
    """Seconds of one convolution call (`ComputeRates.conv_seconds`), its dispatch included."""
    return rates.conv_seconds(conv, part) + rates.dispatch


def pass_seconds(nbytes: float, rates: ComputeRates, calls: int = 1) -> float:
    """Seconds of elementwise passes over `nbytes` bytes in `calls` operator calls (dispatch
    included)."""
    return rates.elementwise_seconds(nbytes) + calls * rates.dispatch


def oversubscription(ranks_on_node: int, cores: int) -> float:
    """How much slower each rank computes when the node's ranks share its cores: ranks / cores,
    at least 1. Ranks run one torch thread each when there are more ranks than cores
    (`runner.training.rank`), so r ranks on c < r cores take turns and each gets c / r of a core;
    with a core each (or more: each then runs several threads, which rates measured with as many
    `threads` reflect) nothing slows down."""
    return max(1.0, ranks_on_node / max(cores, 1))
