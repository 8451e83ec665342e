"""Name → plugin registries; config selects plugins by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownPluginError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry(Generic[T]):
    """Plugins of one kind (strategy, model, ...), registered by decorator."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._plugins: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorate(plugin: T) -> T:
            if name in self._plugins and self._plugins[name] is not plugin:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._plugins[name] = plugin
            return plugin

        return decorate

    def get(self, name: str) -> T:
        try:
            return self._plugins[name]
        except KeyError:
            raise UnknownPluginError(
                f"unknown {self.kind} '{name}'; registered: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._plugins)

    def __contains__(self, name: object) -> bool:
        return name in self._plugins
