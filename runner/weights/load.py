"""A run's start from `model.weights`: checked by the head from the files' headers, then read by
every rank into the split model, each rank its own blocks.

After a strategy has split the model, every tensor a rank holds knows which block of which
tensor of the plain model it is (`runner.core.placement`), as for a checkpoint's resume: a rank
reads that block (rows, and columns) of the stored tensor and nothing else, casts it into its
parameter's dtype (float32 master weights under mixed precision, the run's dtype otherwise) and
copies it in. A tied parameter is one tensor of the model: read once. Tensors a strategy adds
(a sparse table's hot rows) are chosen from the loaded rows at the first step, as in a fresh run.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runner.core.placement import placement_of
from runner.weights.binding import WeightsBinding, bind_weights
from runner.weights.safetensors_file import WeightsFileError
from runner.weights.sources import WeightsSource, open_weights


def weights_problems(weights: str, model: nn.Module) -> list[str]:
    """Every reason `model` (the plain model, on any device, meta included) cannot start from
    `weights`, each one line naming `model.weights`; read from the files' headers alone."""
    shown = f"model.weights={weights}"
    try:
        source = open_weights(weights)
    except WeightsFileError as exc:
        return [f"{shown}: {exc}"]
    _, problems = bind_weights(source, model)
    return [f"{shown}: {problem}" for problem in problems]


def open_bound(weights: str | Path, model: nn.Module) -> tuple[WeightsSource, WeightsBinding]:
    """The weights and which stored tensor each of the plain `model`'s tensors reads, checked
    again on the rank (a file changed since the head's check is `WeightsFileError`)."""
    source = open_weights(weights)
    binding, problems = bind_weights(source, model)
    if problems:
        raise WeightsFileError(f"{weights}: {problems[0]}")
    return source, binding


def load_weights(source: WeightsSource, binding: WeightsBinding, model: nn.Module) -> int:
    """Copy into each placed parameter and buffer of the split `model` its block of the stored
    tensor; returns the bytes read. Tensors the binding does not name (non-persistent buffers,
    those a strategy adds) keep their values."""
    read = 0
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            place = placement_of(tensor)
            if place is None or id(tensor) in seen or place.name not in binding.names:
                continue
            seen.add(id(tensor))
            stored = binding.names[place.name]
            if source.read_into(stored, place, tensor.data):  # into the parameter itself
                read += tensor.numel() * tensor.element_size()
                continue
            block = source.read(stored, place)
            read += block.numel() * block.element_size()
            tensor.copy_(block.reshape(tensor.shape))
    return read
