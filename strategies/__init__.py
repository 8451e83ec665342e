"""Parallel strategies: transformations from a sequential model to a distributed one.

Each strategy lives in its own module and registers itself on import.
"""

from strategies import auto as _auto  # noqa: F401  (registers "auto")
from strategies import data as _data  # noqa: F401  (registers "data")
from strategies import domain as _domain  # noqa: F401  (registers "domain")
from strategies import fsdp as _fsdp  # noqa: F401  (registers "fsdp")
from strategies import grid as _grid  # noqa: F401  (registers "grid")
from strategies import model as _model  # noqa: F401  (registers "model")
from strategies.base import ParallelModel, PricingContext, Strategy
from strategies.registry import STRATEGIES, register_strategy

__all__ = ["STRATEGIES", "ParallelModel", "PricingContext", "Strategy", "register_strategy"]
