"""`trainer.activation_checkpointing`: the modules whose activations are recomputed in backward
instead of kept.

The modules are named on the plain model (`checkpoint_targets`: `units`, the children of its
largest `nn.ModuleList`, its repeated blocks; or a glob over `named_modules()`, the outermost
matches kept) and wrapped after the strategy has made this rank's parallel model
(`checkpoint_modules`), so the modules a strategy swaps inside a block run inside its
recomputation. Wrapping replaces the module's `forward` on the instance by one that calls the
module's own through `torch.utils.checkpoint.checkpoint(use_reentrant=False)`: the user's code
runs unchanged. The recomputation restores the random state (torch's default) and runs inside
the modes the parallel model names (`ParallelModel.recompute_contexts`), so it draws the masks
its forward drew. A module the strategy rebuilt (a layer split into shards) is no longer in the
parallel model: it is reported, not wrapped.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from strategies.base import ParallelModel

CHECKPOINT_NONE, CHECKPOINT_UNITS = "none", "units"


def repeated_blocks(model: nn.Module) -> list[str]:
    """The names of the children of `model`'s largest `nn.ModuleList` (the first of the
    largest; none: empty)."""
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module)]
    if not lists:
        return []
    name, blocks = max(lists, key=lambda item: len(item[1]))
    prefix = f"{name}." if name else ""
    return [prefix + child for child, _ in blocks.named_children()]


def outermost(names: list[str]) -> list[str]:
    """`names` less those inside another of them (a checkpointed module recomputes its
    children already)."""
    return [name for name in names
            if not any(name.startswith(f"{other}.") for other in names)]


def checkpoint_targets(model: nn.Module, setting: str) -> tuple[list[str], str | None]:
    """The names of the modules `setting` recomputes in `model` (outermost first, in
    `named_modules()` order), or a problem naming why there are none."""
    shown = f"trainer.activation_checkpointing={setting}"
    if setting == CHECKPOINT_NONE:
        return [], None
    if setting == CHECKPOINT_UNITS:
        blocks = repeated_blocks(model)
        if not blocks:
            return [], (f"{shown}: {type(model).__name__} has no nn.ModuleList of repeated "
                        f"blocks; name the modules by a glob over named_modules() instead")
        return blocks, None
    names = [name for name, _ in model.named_modules()
             if name and fnmatch.fnmatchcase(name, setting)]
    if not names:
        some = [name for name, _ in model.named_modules() if name][:6]
        return [], (f"{shown}: matches no module of {type(model).__name__} (none, units, or a "
                    f"glob over named_modules(): {', '.join(some)}, ...)")
    return outermost(names), None


def _recomputed(module: nn.Module, pmodel: ParallelModel) -> Callable[..., Any]:
    """`module`'s own forward, recomputed in backward when it runs in training with gradients."""
    own = pmodel.recomputed_forward(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return own(*args, **kwargs)
        return checkpoint(own, *args, use_reentrant=False,
                          context_fn=pmodel.recompute_contexts, **kwargs)
    return forward


def checkpoint_modules(pmodel: ParallelModel, modules: dict[str, nn.Module]
                       ) -> tuple[list[str], list[str]]:
    """Wrap each of `modules` (by their names in the plain model) that `pmodel` still holds;
    returns the names wrapped and those the strategy rebuilt (not in `pmodel`)."""
    held = {id(module) for module in pmodel.modules()}
    wrapped, rebuilt = [], []
    for name, module in modules.items():
        if id(module) not in held:
            rebuilt.append(name)
            continue
        module.forward = _recomputed(module, pmodel)
        wrapped.append(name)
    return wrapped, rebuilt
