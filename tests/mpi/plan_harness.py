"""What the checks of parallel plans by module name share (`check_plans.py`,
`check_plan_vocab.py`, `check_plan_resume.py`): the one-process model and the copy a strategy
splits, and the two proofs every step and every run end with — the bytes rank 0 moved are the
predicted ones, and every final parameter piece is the block of one process's parameter that
its placement names."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from runner.core import ProcessGrid
from runner.core.placement import place_whole, placement_of
from strategies.probe import reads_tokens

TOLERANCE = 1e-9  # relative, in float64


def built(factory: Callable[[], nn.Module], tokens: bool = True) -> nn.Module:
    """The one-process model in float64, from seed 3, its parameters tagged whole."""
    torch.manual_seed(3)
    model = factory().double()
    if tokens:
        reads_tokens(model)
    place_whole(model)
    return model


def tagged_copy(model: nn.Module, tokens: bool = True) -> nn.Module:
    """A copy to split, its parameters tagged (a deep copy drops the tags)."""
    twin = copy.deepcopy(model)
    if tokens:
        reads_tokens(twin)
    place_whole(twin)
    return twin


def assert_moved_as_predicted(grid: ProcessGrid, predicted: Counter[tuple[object, ...]],
                              what: str, step: int) -> None:
    """The collectives rank 0 issued since the records were cleared are the predicted ones."""
    measured = Counter((r.op, r.group, r.group_size, r.nbytes) for r in grid.counter.records)
    assert measured == predicted, (f"{what} step {step}: measured-only {measured - predicted}, "
                                   f"predicted-only {predicted - measured}")


def assert_pieces_equal(seq: nn.Module, pmodel: nn.Module, what: str) -> None:
    """Every parameter piece of `pmodel` equals the block of `seq`'s parameter it names."""
    whole = dict(seq.named_parameters())
    for param in pmodel.parameters():
        place = placement_of(param)
        assert place is not None, what
        origin = placement_of(whole[place.name])
        assert origin is not None
        want = origin.view(whole[place.name].detach(), place)
        err = (param.detach() - want).abs().max().item()
        assert param.shape == want.shape and err <= TOLERANCE * max(want.abs().max().item(),
                                                                    1.0), (
            f"{what}: final {place} differs by {err}")
