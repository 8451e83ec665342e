"""The strategy registry: `@register_strategy("name")` on a `Strategy` subclass."""

from __future__ import annotations

from collections.abc import Callable

from runner.core.registry import Registry
from strategies.base import Strategy

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def decorate(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        return STRATEGIES.register(name)(cls)

    return decorate
