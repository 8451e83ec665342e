"""Registries of the engine's plugins: models, datasets, replica optimizers; and the user's
code: the modules a run's `plugins` list names, and classes or functions named by `_target_`.

Strategies have their own registry in `strategies.registry` (strategies never import the engine).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Callable, Sequence
from typing import Any

from runner.core.registry import Registry

MODELS: Registry[Callable[..., Any]] = Registry("model")
DATASETS: Registry[Any] = Registry("dataset")
OPTIMIZERS: Registry[Any] = Registry("optimizer")

register_model = MODELS.register
register_dataset = DATASETS.register
register_optimizer = OPTIMIZERS.register

_BUILTIN_MODULES = ("runner.zoo.models", "runner.zoo.datasets", "runner.zoo.corpus",
                    "runner.data.token_file", "runner.data.text", "runner.data.image_folder",
                    "runner.optim.sync", "runner.optim.easgd", "runner.optim.parameter_server",
                    "strategies")


def load_plugins() -> None:
    """Import the modules whose decorators fill the registries."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


class UserCodeError(ValueError):
    """A module or object the config names that cannot be imported (one line, the reason)."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def import_modules(modules: Sequence[str]) -> None:
    """Import the user's plugin modules (their `@register_*` decorators fill the registries).
    Every rank calls this before building its run, so a registered model is known on all."""
    load_plugins()
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # the user's code: whatever it raises is one line
            raise UserCodeError(f"plugins: cannot import {module}: {_first_line(exc)}") from None


def import_object(path: str) -> Any:
    """The object a dotted path names (`my_pkg.nets.MyNet`): the longest importable module
    prefix, then attributes. `UserCodeError` says which part is missing."""
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts):
        raise UserCodeError(f"'{path}' is not a dotted path (my_pkg.module.Name)")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module_name.startswith(exc.name):
                # a module that exists but imports something missing
                raise UserCodeError(f"cannot import {module_name}: {_first_line(exc)}") from None
            continue
        except Exception as exc:  # the user's module raised while importing
            raise UserCodeError(f"cannot import {module_name}: {_first_line(exc)}") from None
        for index, attribute in enumerate(parts[split:], start=split):
            if not hasattr(obj, attribute):
                raise UserCodeError(f"{'.'.join(parts[:index])} has no attribute or "
                                    f"module '{attribute}'") from None
            obj = getattr(obj, attribute)
        if isinstance(obj, types.ModuleType):
            raise UserCodeError(f"'{path}' names a module, not a class or function in it "
                                f"(my_pkg.module.Name)")
        return obj
    if len(parts) == 1 and importlib.util.find_spec(parts[0]) is not None:
        raise UserCodeError(f"'{path}' names a module, not a class or function in it "
                            f"(my_pkg.module.Name)")
    raise UserCodeError(f"cannot import {parts[0]}: no module named '{parts[0]}'")


def resolve(registry: Registry[Any], name: str, target: str | None) -> Any:
    """A plugin's factory: the registered `name`, or the object `target` names."""
    if target is not None:
        return import_object(target)
    load_plugins()
    return registry.get(name)
