"""Sequence parallelism (`strategy=domain` on a GPT) against the sequential model, in one launch:
`mpiexec -n 4 python THIS`.

- the ring shift (`runner.core.primitives.ring_shift`): its definition, and the dot-product test
  <F x, y> == <x, F* y> for the hand-written adjoint and autograd's backward, on 4 ranks (the
  4x1 grid's model group) and 2 (the 2x2 grid's), shifts by 1, −1 and 2, uneven lengths (some
  empty), float32 to 1e-5 and float64 to 1e-12;
- a small GPT (width 32, 2 layers, 4 heads, vocabulary 50, sequences of 10 tokens: uneven
  pieces over 4 ranks) in float64 on grids 4x1 and 2x2 with kv_exchange allgather and ring: the
  loss equals the sequential model's to 1e-10, every gradient (after the exchange) the
  sequential one's, AdamW steps keep agreeing to 1e-8, the bytes the grid's counter measured
  equal `predict_ops`', and the correct-prediction counts of `score` the sequential ones.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from harness import check, make_grids, run_checks
from mpi4py import MPI

from runner.core import CountedComm, Partition
from runner.core import primitives as P
from runner.cost.collectives import step_bytes
from strategies import PricingContext
from strategies.domain import DomainParallel
from strategies.transformer.context_parallel import SequenceParallelGPT
from strategies.transformer.gpt import GPT

WORLD = MPI.COMM_WORLD
GRID_OF = make_grids([(4, 1), (2, 2)])
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}

VOCAB, LENGTH, BATCH = 50, 10, 4


def seeded(shape: list[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def group_sum(value: float, comm: CountedComm) -> float:
    """Σ over the group, uncounted (through the transport)."""
    if comm.transport is None or comm.size == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    comm.transport.allreduce_(total)
    return float(total)


@check
def ring_shift_is_adjoint_to_the_opposite_shift() -> None:
    for shape in ((4, 1), (2, 2)):
        comm = GRID_OF[shape].model
        p, me = comm.size, comm.rank
        for sizes in ((3, 0, 2, 1)[:p], tuple(range(p + 1, 1, -1))):
            for offset in (1, -1, 2):
                for dtype in (torch.float32, torch.float64):
                    where = f"{p} ranks, lengths {sizes}, offset {offset}, {dtype}"
                    x = seeded([2, sizes[me], 3], 100 + me, dtype)
                    source = (me - offset) % p
                    y = seeded([2, sizes[source], 3], 200 + me, dtype)
                    fx = P.ring_shift_op(x, comm, 1, sizes, offset)
                    assert torch.equal(fx, seeded([2, sizes[source], 3], 100 + source, dtype)), \
                        where
                    xg = x.clone().requires_grad_(True)
                    out = P.ring_shift(xg, comm, 1, sizes, offset)
                    (by_autograd,) = torch.autograd.grad(out, xg, grad_outputs=y)
                    lhs = group_sum(float((fx * y).sum()), comm)
                    bound = (group_sum(float((fx ** 2).sum()), comm)
                             * group_sum(float((y ** 2).sum()), comm)) ** 0.5
                    for label, fy in (("adjoint", P.ring_shift_adjoint_op(y, comm, 1, sizes,
                                                                          offset)),
                                      ("autograd", by_autograd)):
                        assert fy.shape == x.shape, (where, label, fy.shape)
                        rhs = group_sum(float((x * fy).sum()), comm)
                        gap = abs(lhs - rhs) / max(abs(lhs), abs(rhs), bound, 1e-30)
                        assert gap <= TOL[dtype], f"ring shift {where} ({label}): gap {gap}"


def sequential_gpt() -> GPT:
    torch.manual_seed(3)
    return GPT(VOCAB, LENGTH, width=32, layers=2, heads=4).double()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    return x, torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)


def close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got - want).abs().max().item()
    scale = max(1.0, want.abs().max().item())
    assert got.shape == want.shape and err <= tol * scale, f"{what}: err {err}"


@check
def sequence_parallel_gpt_equals_the_sequential_one() -> None:
    for shape in ((4, 1), (2, 2)):
        grid = GRID_OF[shape]
        scale = grid.size / (BATCH * LENGTH)  # the row contract's: the mean over all ranks
        for mode in ("allgather", "ring"):
            where = f"{shape[0]}x{shape[1]} {mode}"
            reference = sequential_gpt()
            strategy = DomainParallel(bucket_cap_mb=0.01, first_bucket_mb=0.002,
                                      kv_exchange=mode,
                                      pricing=PricingContext(global_batch=BATCH))
            with torch.device("meta"):  # as the runner predicts: shapes alone
                meta = GPT(VOCAB, LENGTH, width=32, layers=2, heads=4).double()
            predicted = step_bytes(strategy.predict_ops(meta, (LENGTH,), grid.shape, BATCH))
            model = strategy.parallelize(copy.deepcopy(reference), (LENGTH,), grid)
            assert isinstance(model, SequenceParallelGPT), where
            inputs, targets = model.input_rows(BATCH), model.output_rows(BATCH)
            params = list(model.parameters())
            assert len(params) == len(list(reference.parameters())), where
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
            opt = torch.optim.AdamW(params, lr=1e-2)
            for step in range(3):
                x, y = batch(step)
                reference.zero_grad()
                ref_loss = F.cross_entropy(reference(x).reshape(-1, VOCAB), y.reshape(-1))
                ref_loss.backward()
                ref_value = float(ref_loss.detach())
                model.zero_grad()
                before = grid.counter.snapshot()
                score = model.score(model(x[inputs]), y[targets])
                (score.loss_sum * scale).backward()
                model.finish_gradient_sync()
                measured = grid.counter.since(before).nbytes
                # the prediction is rank 0's (uneven pieces: a ring moves others' lengths)
                assert grid.rank != 0 or measured == predicted, (
                    f"{where}: measured {measured} B, predicted {predicted} B")
                count = group_sum(score.count, grid.world)
                assert count == BATCH * LENGTH, f"{where}: {count} targets scored"
                loss = group_sum(float(score.loss_sum.detach()), grid.world) / (BATCH * LENGTH)
                tol = 1e-10 if step == 0 else 1e-8
                assert abs(loss - ref_value) <= tol * max(1.0, abs(ref_value)), (
                    f"{where} step {step}: loss {loss} vs {ref_value}")
                for (name, want), got in zip(reference.named_parameters(), params, strict=True):
                    assert got.grad is not None and want.grad is not None, (where, name)
                    close(got.grad, want.grad, tol, f"{where} step {step} {name} gradient")
                ref_opt.step()
                opt.step()
            for (name, want), got in zip(reference.named_parameters(), params, strict=True):
                close(got.detach(), want.detach(), 1e-8, f"{where} {name} after 3 steps")
            # what evaluation counts: each target scored once, the arg-max right as often
            x, y = batch(99)
            with torch.no_grad():
                ref_out = reference(x)
                right = int((ref_out.argmax(-1) == y).sum())
                got = model.score(model(x[inputs]), y[targets], correct=True)
            assert got.correct is not None
            assert group_sum(float(got.correct), grid.world) == right, where
            own = Partition(LENGTH, grid.pr).slice(grid.model_index)
            assert got.count == (targets.stop - targets.start) * (own.stop - own.start), where


if __name__ == "__main__":
    run_checks()
