"""Which stored tensor each of the model's tensors starts from, checked whole before any rank
starts: every parameter and every buffer a `state_dict` keeps present with its shape, a dtype
it can be cast from, and no stored tensor left over.

A model's tensors are named as in its `state_dict` (what checkpoints key them by,
`runner.core.placement`); a stored name, once renamed as the transformers library renames its
files' names (`runner.weights.library_names`), matches exactly, or across the base model's
prefix of a
transformers class (`model.` of a `LlamaForCausalLM` against a `LlamaModel`'s weights), or by
another name of a tied parameter (`lm_head.weight` for `model.embed_tokens.weight`). Stored
tensors the model's class says to ignore (`_keys_to_ignore_on_load_unexpected`: a causal mask
older files kept) and the model's own non-persistent buffers are not left-overs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from runner.weights.library_names import from_stored
from runner.weights.model_card import kept_tensors
from runner.weights.sources import WeightsSource

MOST_NAMED = 3  # a list of missing or unexpected names shows this many, then a count


@dataclass(frozen=True)
class WeightsBinding:
    """The stored tensor each model tensor (by its `state_dict` name) is read from."""

    names: dict[str, str]


def _kinds_match(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """Whether a stored dtype casts into the model's without changing what it means: float to
    float, integer to integer, bool to bool."""
    def kind(dtype: torch.dtype) -> str:
        if dtype == torch.bool:
            return "bool"
        return "float" if dtype.is_floating_point else "complex" if dtype.is_complex else "int"
    return kind(stored) == kind(wanted)


def _prefixed(names: list[str], prefix: str) -> list[str]:
    """`names` with a transformers base model's prefix taken off or put on."""
    if not prefix:
        return []
    dotted = prefix + "."
    return [name.removeprefix(dotted) if name.startswith(dotted) else dotted + name
            for name in names]


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MOST_NAMED])
    more = len(names) - MOST_NAMED
    return shown + (f" and {more} more" if more > 0 else "")


def bind_weights(source: WeightsSource, model: nn.Module) -> tuple[WeightsBinding, list[str]]:
    """Each of `model`'s tensors' stored tensor, and every problem (one line each): a missing
    or unexpected name, a shape, a dtype that cannot be cast."""
    kept = kept_tensors(model)
    wanted, aliases, transient = kept.tensors, kept.aliases, kept.transient
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    rename = from_stored(model)
    stored_as = {rename(name): name for name in source.tensors}  # by the modules' names
    names: dict[str, str] = {}
    problems: list[str] = []
    missing = []
    for name, tensor in wanted.items():
        candidates = aliases[name] + _prefixed(aliases[name], prefix)
        found = next((stored_as[c] for c in candidates if c in stored_as), None)
        if found is None:
            missing.append(name)
            continue
        names[name] = found
        stored = source.tensors[found]
        if stored.shape != tuple(tensor.shape):
            problems.append(f"{found} has shape {list(stored.shape)} in the weights and "
                            f"{list(tensor.shape)} in the model")
        elif not _kinds_match(stored.dtype, tensor.dtype):
            problems.append(f"{found} is {str(stored.dtype)[6:]} in the weights and "
                            f"{str(tensor.dtype)[6:]} in the model: it cannot be cast")
    if missing:
        problems.append(f"not in the weights: {_some(missing)} (the model's "
                        f"{type(model).__name__} has them)")
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                              None) or ()]
    used = set(names.values())
    known = transient | set(_prefixed(sorted(transient), prefix))
    for names_of in aliases.values():
        known.update(names_of)
    unexpected = [name for name in source.tensors if name not in used
                  and rename(name) not in known and not any(p.search(name) for p in ignored)]
    if unexpected:
        problems.append(f"unexpected in the weights: {_some(sorted(unexpected))} (no such "
                        f"tensor in the model's {type(model).__name__})")
    return WeightsBinding(names), problems
