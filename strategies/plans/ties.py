"""Weights a model uses twice (tied: a language model's head and its token table) under a
parallel plan (`strategies.plans.module_plan`): split only where every module holding the weight
splits it by the same rows — an embedding by vocabulary (`vocab`) and a projection by its output
features (`colwise`, `colwise_gather_output`, or `vocab` as the model's head) — and then held as
one piece on each rank, which both modules use, so its gradient is the sum of both uses as the
whole tied weight's is. A plan that splits the head by rows takes the tied table along."""

from __future__ import annotations

import torch
from torch import nn

from strategies.plans.styles import STYLES, PlanStyle, Projection


def tied_holders(model: nn.Module) -> dict[int, list[str]]:
    """Parameter id → the paths of every module holding it."""
    holders: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(path)
    return holders


# Styles that split a Linear's weight by its rows (its output features) in one piece each:
# a vocabulary table's rows, where the weight is an embedding's too (tied).
ROW_SPLITS = ("colwise", "colwise_gather_output", "vocab")


def splits_rows_as_a_table(style: PlanStyle | None, module: nn.Module) -> bool:
    """Whether `style` splits `module`'s weight by the rows an embedding's `vocab` split takes
    (a whole-row piece per rank, in order)."""
    if style is None or style.name not in ROW_SPLITS:
        return False
    if isinstance(module, nn.Embedding):
        return style.name == "vocab"
    projection = Projection.of(module)
    return projection is not None and not projection.transposed


def tied_tables(styles: dict[str, PlanStyle], model: nn.Module) -> dict[str, PlanStyle]:
    """`styles` (a plan's, by module path) with each embedding whose table is tied to a
    projection they split by rows (a language model's head) split by vocabulary too: one piece
    of the one table on each rank, serving both uses (the transformers library's declared
    plans split the head only), in the model's module order."""
    holders = tied_holders(model)
    styles = dict(styles)
    for path, style in list(styles.items()):
        module = model.get_submodule(path)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or not splits_rows_as_a_table(style, module):
            continue
        for other in holders.get(id(weight), []):
            table = model.get_submodule(other)
            if other != path and other not in styles and isinstance(table, nn.Embedding):
                styles[other] = STYLES["vocab"]
    order = [name for name, _ in model.named_modules()]
    return dict(sorted(styles.items(), key=lambda item: order.index(item[0])))


def table_of(built: nn.Module) -> nn.Parameter:
    """The piece of the weight a module split by vocabulary rows holds."""
    weights = getattr(built, "weights", None)
    piece = weights[0] if isinstance(weights, nn.ParameterList) else built.weight
    assert isinstance(piece, nn.Parameter)
    return piece


def share_table(built: nn.Module, piece: nn.Parameter) -> None:
    """`built` holding `piece` (the same rows of the same tied weight) in place of its own."""
    weights = getattr(built, "weights", None)
    if isinstance(weights, nn.ParameterList):
        weights[0] = piece
    else:
        built.weight = piece
