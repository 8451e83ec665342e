"""Tensor parallelism of a GPT (strategies/transformer/tensor_parallel.py) against the
sequential model, in one launch: `mpiexec -n 4 python THIS`.

- each new communication operator passes the dot-product (adjoint) test; the distributed
  arg-max breaks ties as torch.argmax does;
- a small GPT in float64 on grids 4x1 (strategy=model) and 2x2 (strategy=grid), layouts pairing
  and gather, head tied and untied: the loss equals the sequential one to 1e-10, every gradient
  piece the sequential gradient's block its placement names, SGD steps keep agreeing to 1e-8,
  the bytes rank 0 moves in a step are the predicted ones, the arg-max counts the sequential
  model's; the pieces' placements tile every parameter (a checkpoint loads on any grid);
- without replica synchronisation (EASGD) each model group's gradients are its own rows'.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from harness import check, make_grids, run_checks
from mpi4py import MPI
from plan_harness import assert_pieces_tile

from runner.core import Partition, ProcessGrid
from runner.core.placement import Placement, place_whole, placement_of
from strategies import STRATEGIES, ParallelModel, Strategy
from strategies.layers.vocab_ops import vocab_argmax, vocab_embedding_sum
from strategies.transformer.gpt import GPT
from strategies.transformer.tensor_parallel import GatheredLinear, RowParallelLinear

WORLD = MPI.COMM_WORLD
GRIDS = {"model": (4, 1), "grid": (2, 2)}
UNEVEN = (3, 1)  # 4 heads, 50 tokens, 128 features, width 32: uneven pieces everywhere
GRID_OF = make_grids([*GRIDS.values(), UNEVEN])
VOCAB, T, BATCH = 50, 8, 6


def gpt(tied: bool) -> GPT:
    torch.manual_seed(5)
    model = GPT(VOCAB, T, width=32, layers=2, heads=4, tie_weights=tied).double()
    place_whole(model)
    return model


def fresh_copy(model: GPT) -> GPT:
    """A copy to split, its parameters tagged (a deep copy drops the tags)."""
    twin = copy.deepcopy(model)
    place_whole(twin)
    return twin


def block_of(whole: torch.Tensor, tensor: torch.Tensor, place: Placement) -> torch.Tensor:
    """The block `place` of `tensor`, shaped like the sequential parameter `whole` (tagged
    whole)."""
    origin = placement_of(whole)
    assert origin is not None
    return origin.view(tensor, place)


def dist_dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """The inner product of two distributed tensors: the sum over ranks of the local ones."""
    return float(WORLD.allreduce((a * b).sum().item()))


def assert_adjoint(forward: torch.Tensor, probe: torch.Tensor, x: torch.Tensor,
                   what: str) -> None:
    (forward * probe).sum().backward()
    assert x.grad is not None
    left, right = dist_dot(forward.detach(), probe), dist_dot(x.detach(), x.grad)
    assert abs(left - right) <= 1e-10 * max(1.0, abs(left)), f"{what}: {left} vs {right}"


@check
def new_operators_are_adjoint() -> None:
    grid = GRID_OF[4, 1]
    comm, rank = grid.model, grid.model_index
    gen = torch.Generator().manual_seed(11 + rank)  # every rank its own tensors
    rows = Partition(VOCAB, 4).slice(rank)
    weight = torch.randn(rows.stop - rows.start, 6, dtype=torch.float64, generator=gen,
                         requires_grad=True)
    ids = torch.arange(2 * T).remainder(VOCAB).view(2, T) * 3 % VOCAB  # the same on all ranks
    out = vocab_embedding_sum(ids, weight, rows.start, comm)
    assert_adjoint(out, torch.randn(out.shape, dtype=torch.float64, generator=gen), weight,
                   "vocab embedding sum")
    for name in ("row-parallel", "gathered"):
        linear = torch.nn.Linear(12, 10, bias=False).double()
        torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(3))
        heads, width = Partition(4, 4), Partition(10, 4)
        module = (RowParallelLinear(linear, slice(3 * rank, 3 * rank + 3), comm, name)
                  if name == "row-parallel"
                  else GatheredLinear(linear, heads, 3, width, rank, comm, name))
        x = torch.randn(2, T, 3, dtype=torch.float64, generator=gen, requires_grad=True)
        y = module(x)
        assert_adjoint(y, torch.randn(y.shape, dtype=torch.float64, generator=gen), x, name)
    # ties across ranks and within one: the lowest global index, as torch.argmax
    whole = torch.zeros(3, VOCAB, dtype=torch.float64)
    whole[1, [20, 40]] = 1.0
    whole[2, [14, 15, 49]] = 2.0
    got = vocab_argmax(whole[:, rows], rows.start, comm)
    assert torch.equal(got, whole.argmax(dim=1)), got


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    err = (got - want).abs().max().item() if want.numel() else 0.0
    assert got.shape == want.shape and err <= tol, f"{what}: {got.shape} {want.shape} err {err}"


def assert_moved_as_predicted(what: str, strategy: Strategy, grid: ProcessGrid,
                              tied: bool) -> None:
    """Rank 0's collectives in the step just taken: the ones the strategy predicts."""
    measured = Counter((r.op, r.group, r.group_size, r.nbytes) for r in grid.counter.records)
    ops = strategy.predict_ops(gpt(tied), (T,), grid.shape, BATCH)
    predicted = Counter(op.key for op in ops)
    assert measured == predicted, (f"{what}: measured-only {measured - predicted}, "
                                   f"predicted-only {predicted - measured}")
    nbytes = sum(r.nbytes for r in grid.counter.records)
    print(f"{what}: {nbytes} bytes a step, predicted {sum(op.nbytes for op in ops)}",
          flush=True)


def assert_pieces_are_blocks(what: str, pmodel: ParallelModel,
                             seq_params: Mapping[str, torch.Tensor], tol: float,
                             values: bool = True) -> None:
    """Every piece's gradient (and its value) is the sequential parameter's block its
    placement names."""
    for param in pmodel.parameters():
        place = placement_of(param)
        assert place is not None and param.grad is not None, what
        whole = seq_params[place.name]
        assert whole.grad is not None
        close(param.grad, block_of(whole, whole.grad, place), f"{what} grad of {place}", tol)
        if values:
            close(param.detach(), block_of(whole, whole.detach(), place),
                  f"{what} {place.name}", tol)


def assert_argmax_counts(what: str, pmodel: ParallelModel, seq: GPT, grid: ProcessGrid,
                         x: torch.Tensor, y: torch.Tensor) -> None:
    """On evaluation the arg-max counts the sequential model's, each rank its own rows."""
    with torch.no_grad():
        counted_right = pmodel.score(pmodel(x[pmodel.input_rows(BATCH)]),
                                     y[pmodel.output_rows(BATCH)], correct=True).correct
        assert counted_right is not None
        want = int((seq(x).argmax(dim=-1) == y).sum().item())
    right = grid.world.mpi_comm.allreduce(int(counted_right.item()))
    assert right == want, (what, right, want)


def compare(strategy_name: str, layout: str, tied: bool, shape: tuple[int, int]) -> None:
    grid: ProcessGrid | None = GRID_OF[shape]
    if grid is None:
        return
    what = f"{strategy_name} {grid.pr}x{grid.pc} {layout} {'tied' if tied else 'untied'}"
    strategy = STRATEGIES.get(strategy_name)(bucket_cap_mb=0.004, first_bucket_mb=0.001,
                                             tp_layout=layout)
    assert strategy.check(grid.shape, BATCH) == [], what
    seq = gpt(tied)
    assert strategy.check_model(seq, (T,), grid.shape) == [], what
    pmodel = strategy.parallelize(fresh_copy(seq), (T,), grid)
    seq_params = dict(seq.named_parameters())
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
    scale = grid.size / (BATCH * T)
    seq_opt = torch.optim.SGD(seq.parameters(), lr=0.5, momentum=0.9)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.5, momentum=0.9)
    x_local, y_local = x[pmodel.input_rows(BATCH)], y[pmodel.output_rows(BATCH)]
    grid.counter.keep_records = True
    for step in range(3):
        seq_opt.zero_grad()
        seq_loss = F.cross_entropy(seq(x).reshape(-1, VOCAB), y.reshape(-1))
        seq_loss.backward()
        pmodel.zero_grad()
        grid.counter.records.clear()
        score = pmodel.score(pmodel(x_local), y_local)
        (score.loss_sum * scale).backward()
        pmodel.finish_gradient_sync()
        if step == 0 and grid.rank == 0:
            assert_moved_as_predicted(what, strategy, grid, tied)
        loss = grid.world.mpi_comm.allreduce(score.loss_sum.item()) / (BATCH * T)
        counted = grid.world.mpi_comm.allreduce(score.count)
        assert counted == BATCH * T, (what, counted)
        tol = 1e-10 if step == 0 else 1e-8
        assert abs(loss - seq_loss.item()) <= tol, (what, step, loss, seq_loss.item())
        assert_pieces_are_blocks(f"{what} step {step}", pmodel, seq_params, tol)
        seq_opt.step()
        opt.step()
    grid.counter.keep_records = False
    assert_pieces_tile(what, pmodel, seq_params, grid)
    assert_argmax_counts(what, pmodel, seq, grid, x, y)


@check
def tensor_parallel_gpt_equals_sequential() -> None:
    for strategy_name, shape in GRIDS.items():
        for layout in ("pairing", "gather"):
            for tied in (True, False):
                compare(strategy_name, layout, tied, shape)
    compare("model", "pairing", False, UNEVEN)
    compare("model", "gather", True, UNEVEN)


@check
def replicas_without_synchronisation_keep_their_own_gradients() -> None:
    """EASGD: each model group is a replica on its own rows, its loss the mean over its Pr
    ranks: split gradients stay, replicated ones are summed over the group."""
    grid: ProcessGrid = GRID_OF[2, 2]
    seq = gpt(True)
    strategy = STRATEGIES.get("grid")(tp_layout="pairing")
    pmodel = strategy.parallelize(fresh_copy(seq), (T,), grid, sync_replica_gradients=False)
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, T), generator=gen)
    rows = pmodel.input_rows(BATCH)
    F.cross_entropy(seq(x[rows]).reshape(-1, VOCAB), y[rows].reshape(-1)).backward()
    score = pmodel.score(pmodel(x[rows]), y[pmodel.output_rows(BATCH)])
    (score.loss_sum * grid.pr / ((rows.stop - rows.start) * T)).backward()
    pmodel.finish_gradient_sync()
    assert_pieces_are_blocks("easgd", pmodel, dict(seq.named_parameters()), 1e-10, values=False)


if __name__ == "__main__":
    run_checks()
