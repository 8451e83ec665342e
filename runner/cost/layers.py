"""What a layer costs a rank: the forward + backward seconds of a layer on the local shapes a
layout gives a rank, and of the operators a module's own `forward` runs between its leaf
modules, at this machine's rates (`runner.cost.compute.ComputeRates`, whose docstring has the
model of each operation).

A layer's seconds are its forward, its backward and the accumulation of its parameters'
gradients into the zeroed `.grad` (gridrun zeroes gradients instead of dropping them). Linear
layers and convolutions are priced by their products (`linear_seconds`, `conv_layer_seconds`),
the loss with the step's `backward()` call (`loss_seconds`), other kinds per byte of their input
or by their dispatch, and any other module by its leaves, found by a forward on the meta device
(`layer_seconds`, `output_shape`).

An operator a module's own `forward` runs between its leaf modules (`OperatorCall`: attention's
products or kernel, a softmax, a residual sum) is priced by its kind (`operator_seconds`):
products by the matrix-product table, attention kernels by their two products and passes over
the scores, views by their dispatch alone, anything else as passes over its tensors' bytes, with
a backward where an argument needs a gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.cost.compute import FLOAT_BYTES, KIND_CALLS, ComputeRates, ConvShape

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



# -- whole layers --------------------------------------------------------------------------------

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


def conv_layer_seconds(conv: ConvShape, rates: ComputeRates, *, bias: bool = True,
                       input_grad: bool = True) -> float:
    """Forward + backward seconds of a convolution layer: the forward convolution, its weight
    gradient, its input gradient (not when `input_grad` is False), the bias gradient's sum, the
    accumulation of the gradients into `.grad`, and `conv_overhead` (the operator calls'
    dispatch, oneDNN's set-up)."""
    seconds = rates.conv_seconds(conv) + rates.conv_seconds(conv, part="grad_weight")
    out_bytes = conv.batch * conv.out_channels * math.prod(conv.out_spatial) * FLOAT_BYTES
    in_bytes = (conv.batch * conv.in_channels * math.prod(conv.in_spatial or conv.out_spatial)
                * FLOAT_BYTES)
    if input_grad:
        seconds += rates.conv_seconds(conv, part="grad_input")
    params = (conv.out_channels * conv.reduction + (conv.out_channels if bias else 0)) * FLOAT_BYTES
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
        conv = ConvShape(shape[0], layer.in_channels, layer.out_channels, out[2:],
                         tuple(layer.kernel_size), layer.groups, in_spatial=shape[2:])
        return conv_layer_seconds(conv, rates, bias=layer.bias is not None,
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
