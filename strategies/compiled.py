"""`trainer.compile`: the modules of this rank's parallel model that run as compiled graphs
(`torch.compile`), every collective left outside them.

Where: `blocks` compiles the units the strategy handles (fsdp's `strategy.units`) or else the
children of the model's largest `nn.ModuleList`, its repeated blocks (as torchtitan compiles
each transformer block); `model` starts from the whole parallel model. Either is applied after
the strategy has made this rank's model, and before recomputation wraps what it recomputes
(`strategies.recompute`), so the compiled forward is what a recomputation runs again.

How: each target's `forward` is replaced on the instance by one that runs the module's own
through `torch.compile(fullgraph=True)`; the module's hooks (fsdp's gathers) stay outside the
graph, around it. Every collective gridrun issues is marked never to be traced
(`runner.core.comm.outside_compiled_graphs`), so a module whose forward, or the backward of an
autograd function in it, reaches one cannot make one graph: its first training call finds that
out before anything runs, and the module is then *compiled around*: it runs eagerly and each of
its children is tried the same way, down to the modules that communicate themselves, which run
eagerly. The same holds for any other reason a module cannot be one graph (a user's
data-dependent branch): it is named, with dynamo's reason, in the run's summary (`compile`),
never a silent fall back. Every rank builds the same modules and meets the same graph breaks, so
every rank compiles the same modules.

Only training forwards (with gradients) compile: evaluation runs the eager modules, which a
forward run once per evaluation would not repay. Random draws inside a compiled graph are
torch's own (inductor's `fallback_random`), so a compiled run draws the dropout masks an eager
run draws. Compiled graphs land in a cache (`TORCHINDUCTOR_CACHE_DIR`: `trainer.compile_cache`,
else gridrun's cache directory) that a resumed run, a later run and every rank of a node reuse.
A graph compiled again past dynamo's limit ends the run with dynamo's error rather than
running eagerly unannounced (the limit is the model's module count: modules of one class share
dynamo's graphs, one per shape).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.core.comm import OUTSIDE_GRAPHS, outside_compiled_graphs
from strategies.base import ParallelModel
from strategies.recompute import outermost, repeated_blocks

COMPILE_NONE, COMPILE_BLOCKS, COMPILE_MODEL = "none", "blocks", "model"  # trainer.compile
CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called: their members are
MODEL = "(model)"  # how the summary names the whole parallel model


def compile_targets(pmodel: ParallelModel, plain: nn.Module, mode: str
                    ) -> tuple[dict[str, nn.Module], str | None]:
    """The modules `mode` compiles, by their names in the plain model (the whole parallel
    model: `MODEL`), or a problem naming why there are none."""
    if mode == COMPILE_NONE:
        return {}, None
    if mode == COMPILE_MODEL:
        return {MODEL: pmodel}, None
    names = pmodel.unit_names() or repeated_blocks(plain)
    if not names:
        return {}, no_blocks_problem(plain)
    by_name = dict(plain.named_modules())
    return {name: by_name[name] for name in outermost(names)}, None


def no_blocks_problem(plain: nn.Module) -> str:
    """Why `trainer.compile=blocks` has nothing to compile in `plain`."""
    return (f"trainer.compile=blocks: {type(plain).__name__} has no nn.ModuleList of repeated "
            f"blocks; compile the whole model instead (trainer.compile=model)")


@dataclass
class CompiledModules:
    """What `trainer.compile` made of this rank's model: the modules that run as compiled
    graphs, those compiled around (eager, with their children tried) and those that run
    eagerly, each with the reason; the seconds spent compiling."""

    mode: str
    backend: str
    cache_dir: str
    compiled: list[str] = field(default_factory=list)
    around: dict[str, str] = field(default_factory=dict)
    eager: dict[str, str] = field(default_factory=dict)
    rebuilt: list[str] = field(default_factory=list)  # targets the strategy replaced
    wrapped: set[int] = field(default_factory=set, repr=False)  # the modules wrapped, by id

    def report(self) -> dict[str, Any]:
        """The summary's `compile`: where it was applied and what it cost (`compile_s`: the
        seconds dynamo and the backend spent, forward and backward graphs alike)."""
        return {"mode": self.mode, "backend": self.backend, "compiled": self.compiled,
                "compiled_around": self.around, "eager": self.eager, "rebuilt": self.rebuilt,
                "compile_s": compile_seconds(), "graphs": graph_count(),
                "cache_dir": self.cache_dir, "cache": cache_counts()}


def _reason(exc: BaseException) -> str:
    """Why dynamo could not make one graph, short: the collective reached (`<op> at file:line`)
    or dynamo's first line, with the user code's line where it says."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    where = ""
    if "from user code:" in text:
        frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)',
                            text.split("from user code:")[-1])
        if frames:
            path, line, function = frames[-1]
            where = f" at {Path(path).name}:{line} in {function}"
    found = re.search(r"function (\w+\.\w+) at 0x", text)
    if found and OUTSIDE_GRAPHS in text:
        return f"collective {found.group(1)}{where}"
    return f"{first[:160]}{where}"


def _not_one_graph() -> tuple[type[BaseException], ...]:
    """The errors dynamo raises when a `fullgraph` forward cannot be one graph (a graph break)
    rather than because something is wrong with the run."""
    from torch._dynamo import exc

    return (exc.Unsupported, exc.UserError)


def _compiling(module: nn.Module, name: str, record: CompiledModules,
               compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
               plain_names: dict[int, str]) -> None:
    """Replace `module`'s forward by one that runs compiled in training, or, when its first
    training call finds it cannot be one graph, eagerly with its children tried in turn. A
    module met twice (one called from two places) is wrapped once."""
    if id(module) in record.wrapped:
        return
    record.wrapped.add(id(module))
    own = module.forward
    compiled = compile_fn(own)
    state = {"decided": ""}

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()) or state["decided"] == "eager":
            return own(*args, **kwargs)
        if state["decided"] == "compiled":
            return compiled(*args, **kwargs)
        try:
            out = compiled(*args, **kwargs)
        except _not_one_graph() as exc:  # found while tracing: nothing of it has run
            state["decided"] = "eager"
            children = _children(module, name, plain_names)
            if children:
                record.around[name] = _reason(exc)
                for child_name, child in children.items():
                    _compiling(child, child_name, record, compile_fn, plain_names)
            else:
                record.eager[name] = _reason(exc)
            return own(*args, **kwargs)
        state["decided"] = "compiled"
        record.compiled.append(name)
        return out

    module.forward = forward


def _children(module: nn.Module, name: str, plain_names: dict[int, str]) -> dict[str, nn.Module]:
    """The modules `module` calls directly, a container's members in its place, by their names
    in the plain model (one the strategy made: by its place under `name`)."""
    prefix = "" if name == MODEL else f"{name}."
    found: dict[str, nn.Module] = {}
    for child_name, child in module.named_children():
        named = plain_names.get(id(child), f"{prefix}{child_name}")
        if isinstance(child, CONTAINERS):
            found.update(_children(child, named, plain_names))
        else:
            found[named] = child
    return found


def compile_cache_dir(configured: str | None) -> Path:
    """Where compiled graphs are cached: `trainer.compile_cache`, else `$GRIDRUN_CACHE/compile`,
    else gridrun's cache directory's `compile/` (not inductor's own default, per user under
    /tmp, which torch itself writes into the environment: a user's choice is not told apart)."""
    from runner.config.machine import cache_subdir

    return cache_subdir("compile", configured)


def compile_modules(pmodel: ParallelModel, plain: nn.Module, targets: dict[str, nn.Module],
                    mode: str, backend: str = "inductor", cache: str | None = None
                    ) -> CompiledModules:
    """Compile `targets` (`compile_targets`) in `pmodel`, made from `plain`, as the module doc
    says; those the strategy rebuilt (no longer in `pmodel`) are named, not compiled."""
    directory = compile_cache_dir(cache)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    import torch._dynamo
    import torch._inductor.config

    outside_compiled_graphs()
    torch._inductor.config.fallback_random = True  # eager's draws: the same dropout masks
    # Dynamo keeps its graphs per code object: modules of one class (every nn.Linear compiled
    # around a collective) share one, a graph per shape, as many as there are modules. Past the
    # limit a frame would run eagerly unannounced: the limit is the module count, and a frame
    # that still hits it (a module compiled again step after step) ends the run.
    modules = sum(1 for _ in pmodel.modules())
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, modules + 8)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 2 * modules)
    config.fail_on_recompile_limit_hit = True
    record = CompiledModules(mode, backend, str(directory))

    def compile_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, fullgraph=True, backend=backend)

    held = {id(module) for module in pmodel.modules()}
    plain_names = {id(module): name for name, module in plain.named_modules() if name}
    for name, module in targets.items():
        if id(module) not in held:
            record.rebuilt.append(name)
            continue
        _compiling(module, name, record, compile_fn, plain_names)
    return record


def compile_seconds() -> float:
    """Seconds dynamo and the backend have spent compiling in this process: the forward
    graphs (traced and compiled on a module's first call) and the backward ones (compiled on
    their first backward)."""
    from torch._dynamo.utils import compilation_time_metrics

    return round(sum(sum(compilation_time_metrics.get(key, ()))
                     for key in ("_compile.compile_inner", "backward._backward_impl")), 3)


def graph_count() -> int:
    """The distinct graphs dynamo captured in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def cache_counts() -> dict[str, int]:
    """The compiled graphs found in the cache and those compiled afresh (inductor's FX graph
    cache: a forward and a backward per graph)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"hits": int(inductor["fxgraph_cache_hit"]),
            "misses": int(inductor["fxgraph_cache_miss"])}
