"""What a parallel plan must hold before any rank starts, beyond each module's own checks
(`strategies.plans.styles`): that the features a plan splits are summed again before anything
reads them whole, and that the user's `forward` runs on one rank's pieces at all.

- **Pairs.** In the order a forward calls them, a module whose output stays split (`colwise`,
  `fused_qkv`) opens a stretch of split features that a `rowwise` module closes by summing its
  partial products. Inside the stretch only modules without parameters (activations, dropout)
  may run: a LayerNorm or an unplanned Linear there would compute on a rank's features as if
  they were all of them — a silently wrong model — so it is refused by name, as is a
  `colwise_gather_output` or `rowwise_split_input` module there, which reads whole features.
  A `rowwise` module outside a stretch would be fed whole features, and a stretch the forward
  never closes leaves the features split where the model reads them whole: both refused.
- **Shapes.** The user's `forward` is run once, on the meta device, with each planned module
  replaced by a stand-in of one rank's shapes (and the attention attributes the plan adjusts,
  adjusted): a forward that reshapes by the whole width (`reshape(B, N, C)` with C read from its
  input) fails here, before any rank starts, naming the module it failed in.

Functions a forward calls on split features (not modules) cannot be seen by either check; the
equivalence tests and the documentation say so.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from strategies.plans.sequence_parallel import OneRankShards, SequenceLayout, install_sequence
from strategies.plans.styles import PlanStyle, Projection
from strategies.probe import probe, reads_tokens, sample_dtype

SPLITTING = ("colwise", "fused_qkv")  # styles whose output stays split (unless gathered)
SUMMING = "rowwise"


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def pairing_problems(styles: dict[str, PlanStyle], model: nn.Module,
                     sample_shape: tuple[int, ...], gathered: str | None) -> list[str]:
    """Every stretch of split features that is read whole, or never summed (module
    docstring), in the order one forward meets them."""
    paths = {id(module): path for path, module in model.named_modules()}
    with torch.random.fork_rng(devices=[]):
        calls = probe(model, sample_shape).calls
    problems: list[str] = []
    opened: list[str] = []  # the split modules of the stretch now open
    refused = False  # the stretch was read whole: named once, until a rowwise module ends it
    for call in calls:
        path = paths.get(id(call.module), type(call.module).__name__)
        style = styles.get(path)
        name = style.name if style is not None else None
        if name in SPLITTING and path != gathered:
            opened.append(path)
        elif name == SUMMING:
            if not opened and not refused:
                problems.append(f"{path} ({type(call.module).__name__}) is rowwise but no "
                                f"colwise module before it splits its input features")
            opened, refused = [], False
        elif opened and (name == "sequence" or (style is not None and style.whole_features)
                         or (style is None and _has_parameters(call.module))):
            problems.append(f"{path} ({type(call.module).__name__}) runs on the features "
                            f"{', '.join(opened)} split over the model group before a rowwise "
                            f"module sums them: plan it too, or end the split before it")
            opened, refused = [], True
    if opened:
        problems.append(f"{', '.join(opened)}: the split output features are never summed by a "
                        f"rowwise module (the model would read them whole)")
    return list(dict.fromkeys(problems))


def _stand_in(module: nn.Module, style: PlanStyle, pr: int, gathered: bool) -> nn.Module:
    """A projection of one rank's shapes, on the module's device (a gathered output is whole
    again; an embedding keeps its table, whose lookups a stand-in of fewer rows could not
    make)."""
    weight = getattr(module, "weight", None)
    if Projection.of(module) is None or gathered or not isinstance(weight, torch.Tensor):
        return module
    return style.stand_in(module, pr, weight.device, weight.dtype)


def shape_problems(styles: dict[str, PlanStyle], model: nn.Module,
                   sample_shape: tuple[int, ...], pr: int, gathered: str | None,
                   adjusted: list[tuple[str, str, int]],
                   sequence: SequenceLayout | None = None) -> list[str]:
    """Why the model's own forward cannot run on one rank's pieces (empty: it can);
    `adjusted`: (owner path, attribute, new value) the plan sets; `sequence`: the region's
    exchanges, run as rank 0's shapes. Run on a copy, on the device the model is on (the meta
    device for a large one), as the whole model ran there."""
    if pr == 1 or not styles:
        return []
    twin = copy.deepcopy(model)
    if sample_dtype(model) == torch.long:  # what the model reads is not the copy's to guess
        reads_tokens(twin)
    for path, style in styles.items():
        twin.set_submodule(path, _stand_in(twin.get_submodule(path), style, pr,
                                           path == gathered or style.whole_features))
    for owner, attribute, value in adjusted:
        setattr(twin.get_submodule(owner), attribute, value)
    if sequence is not None:
        install_sequence(twin, sequence, OneRankShards(sequence.length, pr), rowwise_by_hook=True)
    entered: list[str] = []
    names = {id(module): path for path, module in twin.named_modules()}

    def enter(module: nn.Module, args: Any) -> None:
        entered.append(names.get(id(module), ""))

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        entered.pop()

    handles = [h for m in twin.modules()
               for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.random.fork_rng(devices=[]):
            probe(twin, sample_shape)
    except Exception as exc:  # the user's forward on one rank's shapes: say where it failed
        where = next((p for p in reversed(entered) if p), "")
        shown = f"{where} ({type(twin.get_submodule(where)).__name__})" if where else \
            f"the model ({type(twin).__name__})"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return [f"{shown} cannot run on one rank's features under the plan: {first} (its "
                f"forward reads a width or head count the plan does not adjust)"]
    finally:
        for handle in handles:
            handle.remove()
    return []
