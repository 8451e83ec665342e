"""The model a transformers directory describes (`model.weights=DIR`): its `config.json` read as
data (never code: no `auto_map`, no remote classes), its architecture one of the transformers
library's own classes, its fields the constructor's defaults with the user's keys on top.

What the weights fix is not taken from the dataset: the vocabulary (`vocab_size`) and a
classifier's labels (`num_labels`) are the weights' own, and a dataset with more token ids or
other classes is refused by name (`runner.training.assembly.dataset_arguments`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from torch import nn

from runner.zoo.models import NEXT_TOKEN_MODELS, built_from_config

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a model's config.json is kilobytes; anything larger is not one
# What the weights decide and the dataset must fit (not given by the dataset's shapes).
FIXED_INPUTS = ("vocab_size", "num_classes", "num_labels")


class PretrainedConfigError(ValueError):
    """A weights directory whose config.json cannot say which model it is (one line)."""


def read_config(directory: str | Path) -> dict[str, Any]:
    """`directory`'s config.json as a mapping of fields: a regular file of JSON, an object."""
    path = Path(directory) / CONFIG_FILE
    shown = f"model.weights={directory}"
    if not Path(directory).exists():
        raise PretrainedConfigError(f"{shown}: no such file or directory")
    if not Path(directory).is_dir():
        raise PretrainedConfigError(f"{shown}: a file of weights does not say which model it "
                                    f"is of: choose it (model=NAME or model._target_=...)")
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise PretrainedConfigError(f"{shown}: no {CONFIG_FILE}, which says which model the "
                                    f"weights are of (or choose the model: model=NAME or "
                                    f"model._target_=...)") from None
    except OSError as exc:
        raise PretrainedConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_CONFIG_BYTES:
        raise PretrainedConfigError(f"{path}: not a model's config.json (not a regular file "
                                    f"of at most {MAX_CONFIG_BYTES >> 20} MiB)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PretrainedConfigError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise PretrainedConfigError(f"{path}: holds a {type(data).__name__}, not a model's "
                                    f"fields")
    return data


def architecture(directory: str | Path) -> type:
    """The transformers class `directory`'s config.json names first in `architectures`."""
    data = read_config(directory)
    names = data.get("architectures")
    where = Path(directory) / CONFIG_FILE
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise PretrainedConfigError(f"{where} names no architecture (no \"architectures\" "
                                    f"list); choose the class: model._target_=transformers.X")
    try:
        import transformers
    except ImportError:
        raise PretrainedConfigError(f"{where} describes a transformers model and the "
                                    f"transformers library is not installed") from None
    found = getattr(transformers, names[0], None) if names[0].isidentifier() else None
    if not isinstance(found, type) or not built_from_config(found):
        raise PretrainedConfigError(f"{where}: architecture {names[0]!r} is not a model class "
                                    f"of the transformers library {transformers.__version__}")
    return found


@functools.cache
def pretrained_model(model_class: type, directory: str) -> Callable[..., nn.Module]:
    """`model_class` built from `directory`'s config.json (its fields the defaults, the user's
    options on top), as a factory of keyword options. A config.json of another model type
    than the class's is refused."""
    data = read_config(directory)
    config_class = model_class.config_class  # type: ignore[attr-defined]
    wanted = getattr(config_class, "model_type", "")
    if wanted and data.get("model_type", wanted) != wanted:
        raise PretrainedConfigError(
            f"{Path(directory) / CONFIG_FILE} describes a {data.get('model_type')!r} model, "
            f"not the {wanted!r} of {model_class.__name__}")
    fields = {k: v for k, v in data.items() if k.isidentifier() and not k.startswith("_")}

    def build(**options: Any) -> nn.Module:
        return cast(nn.Module, model_class(config_class.from_dict({**data, **options})))

    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(name, keyword, default=default)
              for name, default in sorted(fields.items())]
    build.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = model_class.__name__
    next_token = model_class.__name__.endswith(NEXT_TOKEN_MODELS)
    build.objective = "next_token" if next_token else "classify"  # type: ignore[attr-defined]
    build.fixed_inputs = FIXED_INPUTS  # type: ignore[attr-defined]
    build.weights_directory = directory  # type: ignore[attr-defined]
    return build
