"""Config values checked against Python type annotations.

The engine's sections are typed by their dataclasses (`runner.config.schema`); a plugin's options
by its constructor's signature: the annotations a plugin author writes anyway are its schema, so a
user's `optimizer.lr=abc` is refused by name before any process starts, and the defaults stay
where the constructor declares them. No Hydra, no torch.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_NUMBER_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_PLURALS = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}


def describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if annotation in _NUMBER_WORDS:
        return _NUMBER_WORDS[annotation]
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        words = " or ".join(describe(a) for a in args)
        return f"null or {words}" if len(args) < len(typing.get_args(annotation)) else words
    if origin in (list, tuple, Sequence) or annotation in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return f"a list of {_PLURALS.get(args[0], describe(args[0]))}" if args else "a list"
    if origin in (dict, Mapping) or annotation is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _matches(value: Any, annotation: Any) -> bool:
    if annotation is Any or annotation is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if annotation is type(None) or annotation is None:
        return value is None
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:  # an integer is a number
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, Sequence, typing.Sequence) or annotation in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return False
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        if origin is tuple and len(args) > 1 and Ellipsis not in typing.get_args(annotation):
            return len(value) == len(args) and all(map(_matches, value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        return isinstance(value, Mapping)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation this checker does not model: the plugin checks it itself


def shown(value: Any) -> str:
    """A value as a user writes it on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(shown(v) for v in value) + "]"
    return str(value)


def _accepts(annotation: Any, kind: type) -> bool:
    if annotation is kind:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_accepts(a, kind) for a in typing.get_args(annotation))
    return False


INT_BITS = 64  # what torch and MPI take: a larger integer overflows where it is used


def type_problem(key: str, value: Any, annotation: Any) -> str | None:
    """`key=value: must be …` when `value` does not fit `annotation`, else None. Numbers must
    also be usable: finite (NaN and infinities are refused), integers within 64 bits."""
    if isinstance(value, float) and not math.isfinite(value) and _accepts(annotation, float):
        return f"{key}={shown(value)}: must be a finite number"
    if (isinstance(value, int) and not isinstance(value, bool) and _accepts(annotation, int)
            and not -(2 ** (INT_BITS - 1)) <= value < 2 ** (INT_BITS - 1)):
        return f"{key}={value}: must be an integer of at most {INT_BITS} bits"
    if isinstance(value, (list, tuple)) and _matches(value, annotation):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        element = args[0] if len(args) == 1 else None
        for item in value if element is not None else ():
            problem = type_problem(key, item, element)
            if problem:
                return f"{key}={shown(value)}: {problem.split(': ', 1)[1]} (each item)"
    if _matches(value, annotation):
        return None
    return f"{key}={shown(value)}: must be {describe(annotation)}"


def parameter_types(factory: Callable[..., Any]) -> dict[str, Any]:
    """Keyword parameters of `factory` (a function or a class) and their annotations
    (`inspect.Parameter.empty` where there is none)."""
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # annotations that do not resolve: checked by the plugin alone
        hints = {}
    params = inspect.signature(factory).parameters
    return {name: hints.get(name, p.annotation if not isinstance(p.annotation, str)
                            else inspect.Parameter.empty)
            for name, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def accepts_any_keyword(factory: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(factory).parameters.values())


def option_problems(key: str, factory: Callable[..., Any], options: Mapping[str, Any],
                    reserved: Sequence[str] = (), label: str | None = None) -> list[str]:
    """Every option `factory` does not take, every value that does not fit its annotation and
    every required one missing, as lines naming `key.option` (after `label`, e.g.
    `model._target_=my_pkg.Net`, where the problem is with the options as a whole)."""
    label = label or key
    params = {n: t for n, t in parameter_types(factory).items() if n not in reserved}
    problems = []
    unknown = [] if accepts_any_keyword(factory) else sorted(k for k in options
                                                             if k not in params)
    if unknown:
        problems.append(f"{label}: unknown option(s) {', '.join(f'{key}.{u}' for u in unknown)}; "
                        f"valid: {', '.join(sorted(params)) or 'none'}")
    for name, value in options.items():
        if name in params:
            problem = type_problem(f"{key}.{name}", value, params[name])
            if problem:
                problems.append(problem)
    required = [name for name, p in inspect.signature(factory).parameters.items()
                if p.default is inspect.Parameter.empty and name in params
                and name not in options and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        problems.append(f"{label}: missing required option(s) "
                        f"{', '.join(f'{key}.{name}' for name in required)}")
    return problems


def with_defaults(factory: Callable[..., Any], options: Mapping[str, Any],
                  reserved: Sequence[str] = ()) -> dict[str, Any]:
    """`options` completed by the defaults `factory`'s signature declares: the one place a
    plugin's defaults live (its constructor), for checks that need every value."""
    params = inspect.signature(factory).parameters
    filled = {name: p.default for name, p in params.items()
              if name not in reserved and p.default is not inspect.Parameter.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {**filled, **options}
