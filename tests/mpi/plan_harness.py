"""What the checks of parallel plans by module name share (`check_plans.py`,
`check_plan_vocab.py`, `check_plan_resume.py`): the one-process model and the copy a strategy
splits, and the two proofs every step and every run end with — the bytes rank 0 moved are the
predicted ones, and every final parameter piece is the block of one process's parameter that
its placement names."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import ProcessGrid
from runner.core.placement import place_whole, placement_of
from runner.cost.collectives import CommOp
from strategies.probe import logits_of, reads_tokens

TOLERANCE = 1e-9  # relative, in float64


def assert_pieces_tile(what: str, pmodel: nn.Module, seq_params: Mapping[str, torch.Tensor],
                       grid: ProcessGrid) -> None:
    """The pieces of every parameter over all ranks tile it (what a checkpoint needs to load on
    any grid)."""
    places = {placement_of(p) for p in pmodel.parameters()}
    every = {p for ranks in grid.world.allgather_object(places) for p in ranks}
    for name, param in seq_params.items():
        blocks = [p for p in every if p is not None and p.name == name]
        rows, cols = param.shape[0], (param.shape[1] if param.dim() > 1 else 1)
        assert sum(b.area for b in blocks) == rows * cols, (what, name, blocks)


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


def train_as_one_process(seq: nn.Module, pmodel: nn.Module, grid: ProcessGrid,
                         x: torch.Tensor, y: torch.Tensor, ops: list[CommOp], what: str,
                         make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                         steps: int = 3) -> None:
    """`steps` steps of `seq` on the whole batch and of `pmodel` on this rank's rows, each with
    its own optimizer from `make_optimizer`: every step's loss equal to one process's, rank 0's
    collectives the predicted `ops`; then every final piece the block of one process's
    parameter it names, and the pieces tiling every parameter (a checkpoint loads on any
    grid)."""
    batch, targets = x.shape[0], y.numel()
    scale = grid.size / targets
    seq_opt, par_opt = make_optimizer(list(seq.parameters())), make_optimizer(
        list(pmodel.parameters()))
    x_local, y_local = x[pmodel.input_rows(batch)], y[pmodel.output_rows(batch)]
    predicted = Counter(op.key for op in ops)
    grid.counter.keep_records = True
    for step in range(steps):
        seq_opt.zero_grad()
        out = logits_of(seq(x))
        seq_loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        seq_loss.backward()
        pmodel.zero_grad()
        grid.counter.records.clear()
        score = pmodel.score(pmodel(x_local), y_local)
        (score.loss_sum * scale).backward()
        pmodel.finish_gradient_sync()
        assert_moved_as_predicted(grid, predicted, what, step)
        loss = grid.world.mpi_comm.allreduce(score.loss_sum.item()) / targets
        assert abs(loss - seq_loss.item()) <= TOLERANCE * abs(seq_loss.item()), (
            what, step, loss, seq_loss.item())
        seq_opt.step()
        par_opt.step()
    grid.counter.keep_records = False
    assert_pieces_equal(seq, pmodel, what)
    assert_pieces_tile(what, pmodel, dict(seq.named_parameters()), grid)
    if grid.rank == 0:
        print(f"{what}: {sum(n * c for (_, _, _, n), c in predicted.items())} bytes a step, "
              f"as predicted", flush=True)
