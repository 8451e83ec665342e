"""What a model's weights are, by name, and what a checkpoint records of the model so that it
can be handed back without the code or the files the run started from: the names of the
tensors its `state_dict` keeps (`STATE_NAMES`: parameters once however often they are tied,
persistent buffers; not the buffers a model makes again when built), and for a transformers
model its configuration as plain data (`config.json`'s fields, `architectures` naming its
class). A model of another kind has no configuration and is exported as one safetensors
file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MODEL_CONFIG = "model_config"  # the manifest's keys
STATE_NAMES = "state_names"


@dataclass(frozen=True)
class KeptTensors:
    """A model's weights: each tensor its `state_dict` keeps, by its first name; every name of
    each (a tied parameter has several); the buffers it does not keep."""

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, list[str]]
    transient: set[str]


def kept_tensors(model: nn.Module) -> KeptTensors:
    """`model`'s weights (`KeptTensors`), named as `named_parameters` and `named_buffers` name
    them: as the checkpoint's placements do (`runner.core.placement.place_whole`)."""
    kept = set(model.state_dict(keep_vars=True))
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    aliases: dict[str, list[str]] = {name: [name] for name in tensors}
    first = {id(tensor): name for name, tensor in tensors.items()}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if name not in aliases:
            aliases[first[id(tensor)]].append(name)
    transient = set()
    for name, buffer in model.named_buffers():
        if name in kept:
            tensors[name], aliases[name] = buffer, [name]
        else:
            transient.add(name)
    return KeptTensors(tensors, aliases, transient)


def transformers_config(model: nn.Module) -> dict[str, Any] | None:
    """`model`'s transformers configuration as JSON data, its class in `architectures`; None
    for a model that has none."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json) or not isinstance(getattr(type(model), "config_class", None), type):
        return None
    data = json.loads(to_json(use_diff=True))  # what save_pretrained writes
    if not isinstance(data, dict):
        return None
    data["architectures"] = [type(model).__name__]
    return data
