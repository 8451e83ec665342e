"""Convolution and pooling on slices of an image's height (and width): the layers' windows,
what a slab cannot compute as the whole image does, and the layers that exchange halos
(`runner.core.halo`) before they compute. Used by `strategy=domain` on sequences
(`strategies.domain`), on module trees (`strategies.layers.tree`) and by the layouts of
`strategy=auto` (`strategies.layouts.chain`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm
from runner.core.halo import HaloPlan, Window, halo_exchange, halo_window, start_halo_exchange
from strategies.layers.split import CHANNEL_LOCAL

Windowed = nn.Conv2d | nn.MaxPool2d | nn.AvgPool2d
WINDOWED = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)  # left to inference: isinstance narrows
# Row-local: activations; and BatchNorm2d, whose statistics are reduced over the slabs and rows
# of every rank (`strategies.layers.norm`).
ROW_LOCAL = (*(t for t in CHANNEL_LOCAL if t not in (nn.MaxPool2d, nn.AvgPool2d)),
             nn.BatchNorm2d)


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _padding(layer: Windowed) -> tuple[int, int]:
    if isinstance(layer.padding, str):  # Conv2d(padding="same" or "valid")
        raise ValueError(f"{layer}: padding='{layer.padding}' is not supported, give it in rows")
    return _pair(layer.padding)


def windowed_problem(layer: Windowed) -> str | None:
    """Why a height slab cannot compute `layer` as the whole image does (None: it can)."""
    if isinstance(layer, nn.Conv2d) and isinstance(layer.padding, str):
        return (f"padding='{layer.padding}' is not supported under strategy=domain; give the "
                f"padding in rows")
    if isinstance(layer, nn.Conv2d) and layer.padding_mode != "zeros":
        return (f"padding_mode='{layer.padding_mode}' pads at the image's edges, which a "
                f"height slab does not hold")
    if isinstance(layer, (nn.MaxPool2d, nn.AvgPool2d)) and layer.ceil_mode:
        return "ceil_mode is not supported"
    if isinstance(layer, nn.AvgPool2d) and not layer.count_include_pad and _pair(
            layer.padding)[0]:
        return "padding needs count_include_pad=True"
    return None


def _window(layer: Windowed, axis: int) -> Window:
    """The layer's window along an image axis (0: height, 1: width)."""
    kernel, stride = _pair(layer.kernel_size), _pair(layer.stride or layer.kernel_size)
    padding, dilation = _padding(layer), _pair(getattr(layer, "dilation", 1))
    return Window(kernel[axis], stride[axis], padding[axis], dilation[axis])


def height_window(layer: Windowed) -> Window:
    return _window(layer, 0)


def width_window(layer: Windowed) -> Window:
    return _window(layer, 1)


def _without_height_padding(layer: Windowed) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's operation with the height padding left out (the window brings its own)."""
    kernel, stride = _pair(layer.kernel_size), _pair(layer.stride or layer.kernel_size)
    pad_w = _padding(layer)[1]
    if isinstance(layer, nn.Conv2d):
        # groups: a depthwise or grouped convolution keeps its channel groups on a slab
        return lambda x: F.conv2d(x, layer.weight, layer.bias, layer.stride, (0, pad_w),
                                  layer.dilation, layer.groups)
    if isinstance(layer, nn.MaxPool2d):
        return lambda x: F.max_pool2d(x, kernel, stride, (0, pad_w), layer.dilation)
    # divisor_override: a constant divisor, the same for a window wherever its rows come from.
    return lambda x: F.avg_pool2d(x, kernel, stride, (0, pad_w), count_include_pad=True,
                                  divisor_override=layer.divisor_override)


class SpatialWindowed(nn.Module):
    """A convolution or pooling layer on this rank's height slab (halo exchange included)."""

    def __init__(self, layer: Windowed, comm: CountedComm, height: int, overlap: bool) -> None:
        super().__init__()
        self.layer, self.comm, self.overlap = layer, comm, overlap
        self.window = height_window(layer)
        self.plan = HaloPlan(height, self.window, comm.size, comm.rank)
        self.apply_op = _without_height_padding(layer)
        self.pad_value = float("-inf") if isinstance(layer, nn.MaxPool2d) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan, window = self.plan, self.window
        pending = start_halo_exchange(x, self.comm, 2, plan)
        out_start = plan.out_part.offsets[plan.rank]
        out_stop = out_start + plan.out_part.sizes[plan.rank]
        a, b = plan.interior() if self.overlap else (out_start, out_start)
        if a == out_start and b == out_stop:
            # Every row is interior: still compute from the window, so that this exchange's
            # adjoint runs in backward and the halo gradients others send back are received.
            a = b = out_start
        interior = None
        if b > a:  # needs only this rank's rows: computed while the halos travel
            lo, hi = window.inputs(a, b)
            interior = self.apply_op(x.narrow(2, lo - plan.own_rows[0], hi - lo))
        padded = halo_window(x, pending, self.comm)
        if plan.pad_before or plan.pad_after:
            padded = F.pad(padded, (0, 0, plan.pad_before, plan.pad_after), value=self.pad_value)
        base = plan.window_rows[0] - plan.pad_before  # global row of padded[:, :, 0]

        def rows(start: int, stop: int) -> torch.Tensor:
            lo, hi = window.inputs(start, stop)
            return self.apply_op(padded.narrow(2, lo - base, hi - lo))

        if interior is None:
            return rows(out_start, out_stop)
        parts = [rows(out_start, a)] if a > out_start else []
        parts.append(interior)
        if out_stop > b:
            parts.append(rows(b, out_stop))
        return torch.cat(parts, dim=2) if len(parts) > 1 else interior


def _without_padding(layer: Windowed) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's operation with no padding at all (the windows bring their own)."""
    kernel, stride = _pair(layer.kernel_size), _pair(layer.stride or layer.kernel_size)
    if isinstance(layer, nn.Conv2d):
        return lambda x: F.conv2d(x, layer.weight, layer.bias, layer.stride, 0, layer.dilation,
                                  layer.groups)
    if isinstance(layer, nn.MaxPool2d):
        return lambda x: F.max_pool2d(x, kernel, stride, 0, layer.dilation)
    return lambda x: F.avg_pool2d(x, kernel, stride, 0, count_include_pad=True,
                                  divisor_override=layer.divisor_override)


class SpatialWindowed2D(nn.Module):
    """A convolution or pooling layer on this rank's tile of the image: height split over
    `rows` (the model group), width over `cols` (the batch group). The halo rows come first
    (over `rows`), then the halo columns of the row-extended tile (over `cols`), so the
    corners arrive with them; both exchanges' adjoints run in backward. No overlap: the
    exchanges complete before the tile's outputs are computed."""

    def __init__(self, layer: Windowed, rows: CountedComm, cols: CountedComm, height: int,
                 width: int) -> None:
        super().__init__()
        self.layer, self.rows, self.cols = layer, rows, cols
        self.windows = (height_window(layer), width_window(layer))
        self.plans = (HaloPlan(height, self.windows[0], rows.size, rows.rank),
                      HaloPlan(width, self.windows[1], cols.size, cols.rank))
        self.apply_op = _without_padding(layer)
        self.pad_value = float("-inf") if isinstance(layer, nn.MaxPool2d) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hp, wp = self.plans
        x = halo_exchange(x, self.rows, 2, hp)
        x = F.pad(x, (0, 0, hp.pad_before, hp.pad_after), value=self.pad_value)
        x = halo_exchange(x, self.cols, 3, wp)
        x = F.pad(x, (wp.pad_before, wp.pad_after, 0, 0), value=self.pad_value)
        for dim, plan, window in ((2, hp, self.windows[0]), (3, wp, self.windows[1])):
            start = plan.out_part.offsets[plan.rank]
            lo, hi = window.inputs(start, start + plan.out_part.sizes[plan.rank])
            base = plan.window_rows[0] - plan.pad_before  # global index of x's first
            x = x.narrow(dim, lo - base, hi - lo)
        return self.apply_op(x)
