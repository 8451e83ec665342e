"""The names the transformers library gives a model's tensors in its files, against the names
its modules have (version 5 renames some: a ViT's `vit.layers.0.attention.q_proj` is saved as
`vit.encoder.layer.0.attention.attention.query`, for the files older versions wrote and other
tools read). Loading renames a stored name as `from_pretrained` does; export names a tensor as
`save_pretrained` would. Only renamings are applied: a model whose files need a tensor
converted (split, merged) has names that do not match, and is refused by name when bound.

The renamings are the library's own (`transformers.conversion_mapping`), read where the
installed version has them; where it has none, a stored name is the module's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Rename = Callable[[str], str]


def _same(name: str) -> str:
    return name


def _renamings(model: nn.Module, saving: bool) -> list[Any]:
    """The library's renamings of `model`'s names (from the files', or to them when
    `saving`), fresh objects each call (they keep state while they rename)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightRenaming
    except ImportError:  # a version before the renamings: names are the modules'
        return []
    try:
        conversions = list(get_model_conversion_mapping(model, add_legacy=not saving))
    except Exception:  # not one of the library's models, or an API that moved: no renaming
        return []
    if saving:  # as save_pretrained reverts a model made from a config, not from files
        conversions = [c.reverse_transform() for c in conversions[::-1]
                       if not isinstance(c, PrefixChange)]
    return [c for c in conversions if isinstance(c, WeightRenaming)]


def _applied(renamings: list[Any]) -> Rename:
    if not renamings:
        return _same

    def rename(name: str) -> str:
        for renaming in renamings:
            name = renaming.rename_source_key(name)[0]
        return name
    return rename


def from_stored(model: nn.Module) -> Rename:
    """A stored tensor's name as `model`'s modules name it."""
    return _applied(_renamings(model, saving=False))


def to_stored(model: nn.Module) -> Rename:
    """A tensor of `model` by the name `save_pretrained` gives it in a file."""
    return _applied(_renamings(model, saving=True))


def model_from_config(config: dict[str, Any]) -> nn.Module | None:
    """The transformers model a checkpoint's recorded configuration describes, on the meta
    device (shapes and names only, no memory); None when it cannot be made."""
    try:
        import transformers
    except ImportError:
        return None
    names = config.get("architectures") or [None]
    model_class = getattr(transformers, str(names[0]), None)
    config_class: Any = getattr(model_class, "config_class", None)
    if not isinstance(model_class, type) or not isinstance(config_class, type):
        return None
    from_dict: Callable[[dict[str, Any]], Any] = config_class.from_dict  # type: ignore[attr-defined]
    try:
        with torch.device("meta"):
            made = model_class(from_dict(json.loads(json.dumps(config))))
    except Exception:  # a configuration this version cannot build: names stay the modules'
        return None
    return made if isinstance(made, nn.Module) else None
