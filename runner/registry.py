"""Registries of the engine's plugins: models, datasets, replica optimizers.

Strategies have their own registry in `strategies.registry` (strategies never import the engine).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from runner.core.registry import Registry

MODELS: Registry[Callable[..., Any]] = Registry("model")
DATASETS: Registry[Any] = Registry("dataset")
OPTIMIZERS: Registry[Any] = Registry("optimizer")

register_model = MODELS.register
register_dataset = DATASETS.register
register_optimizer = OPTIMIZERS.register

_BUILTIN_MODULES = ("runner.models", "runner.datasets", "runner.corpus", "runner.optim",
                    "runner.easgd", "strategies")


def load_plugins() -> None:
    """Import the modules whose decorators fill the registries."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
