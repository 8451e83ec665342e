"""Sharded data parallelism (strategies/fsdp.py) against one process, in the launch of
`check_plans.py` (which imports this script): `mpiexec -n 4 python check_plans.py`.

gridrun's MLP, ResNet (BatchNorm with one process's statistics) and GPT (tied embedding and
head), the transformers library's Llama, in float64, under strategy=fsdp 1x2 and 1x4 at stages
1, 2 and 3: every step's loss equals one process's to 1e-9 relative (SGD with momentum; AdamW),
every final piece equals the block of one process's parameter its placement names, the pieces
tile every parameter (a checkpoint loads on any grid), and the bytes rank 0 moves every step are
the predicted ones (under stage 3 the second gather of each unit whose backward reads its
weights included), and so are the most whole parameters held at once, with prefetch (the
default: a unit's gather issued ahead, its buffer counted from then; a model whose backward
holds the most) and without, none left held or in flight after the steps; under bf16 the
gathers move half the bytes and the losses stay within bf16's rounding of one process's under
the same autocast.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from harness import check, make_grids
from plan_harness import (
    assert_moved_as_predicted,
    built,
    tagged_copy,
    train_as_one_process,
)
from torch import nn

from runner.core import ProcessGrid
from runner.core.placement import place_whole
from runner.zoo.models import mlp, resnet
from strategies import STRATEGIES, PricingContext
from strategies.transformer import GPT
from tests import plan_models

GRIDS = make_grids([(1, 2), (1, 4)])
VOCAB, T, BATCH, CLASSES = 48, 8, 8, 4
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def optimizer(params: list[nn.Parameter], name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def compare(factory: Callable[[], nn.Module], sample: tuple[int, ...], stage: int,
            shape: tuple[int, int], tokens: bool, opt: str = "sgd",
            units: str | list[str] = "auto", prefetch: bool = True) -> None:
    grid: ProcessGrid | None = GRIDS[shape]
    if grid is None:
        return
    what = (f"{factory.__name__} fsdp stage {stage} {shape[0]}x{shape[1]} {opt}"
            f"{'' if prefetch else ' no prefetch'}")
    strategy = STRATEGIES.get("fsdp")(stage=stage, units=units, bucket_cap_mb=0.004,
                                      first_bucket_mb=0.001, prefetch=prefetch)
    seq = built(factory, tokens)
    assert strategy.check(grid.shape, BATCH) == [], what
    assert strategy.check_model(seq, sample, grid.shape) == [], (
        what, strategy.check_model(seq, sample, grid.shape))
    ops = strategy.predict_ops(seq, sample, grid.shape, BATCH)
    pmodel = strategy.parallelize(tagged_copy(seq, tokens), sample, grid)
    assert len(pmodel.units) >= 2, (what, pmodel.layouts)
    gen = torch.Generator().manual_seed(9)
    if tokens:
        x = torch.randint(1, VOCAB, (BATCH, *sample), generator=gen)
        y = torch.randint(0, VOCAB, (BATCH, *sample), generator=gen)
    else:
        x = torch.randn(BATCH, *sample, generator=gen, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    shards = sum(p.numel() for p in pmodel.parameters())
    assert shards < sum(p.numel() for p in seq.parameters()), what  # pieces, not copies
    train_as_one_process(seq, pmodel, grid, x, y, ops, what,
                         lambda params: optimizer(params, opt))
    # the most whole parameters held at once (prefetched ones from their issue) as predicted,
    # and none left held, nor any gather in flight, after the steps
    gathered = strategy.predict_memory(seq, sample, grid.shape, 0)["gathered parameters"]
    assert pmodel.gathered_peak_bytes() == gathered, (what, pmodel.gathered_peak_bytes(),
                                                      gathered)
    assert pmodel.gathered.live == 0 and not pmodel._ahead and not pmodel._behind, what
    if grid.rank == 0:
        print(f"{what}: {gathered} bytes gathered at most, as predicted", flush=True)


def mlp_net() -> nn.Module:
    return mlp((1, 4, 4), CLASSES, hidden=(24, 24))


class Shift(nn.Module):
    """x + a learned offset: backward reads none of its weights (no regather at stage 3)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(width) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


def shifted_net() -> nn.Module:
    """Units whose backward reads their weights (the second and third Linear) around one whose
    backward reads none: under stage 3 backward regathers the third then the second, and with
    prefetch holds both at once, more than forward ever holds."""
    return nn.Sequential(nn.Linear(8, 32), Shift(32), nn.Linear(32, 32), Shift(32),
                         nn.Linear(32, CLASSES))


def resnet_net() -> nn.Module:
    return resnet((3, 8, 8), CLASSES, widths=(8, 16), blocks=(1, 1))


def gpt_net() -> nn.Module:
    return GPT(VOCAB, T, width=16, layers=2, heads=2)


def llama_net() -> nn.Module:
    return plan_models.hf_llama(VOCAB, (T,))


@check
def sharded_data_parallelism_equals_one_process_at_every_stage() -> None:
    for stage in (1, 2, 3):
        compare(mlp_net, (1, 4, 4), stage, (1, 4), tokens=False)
        compare(gpt_net, (T,), stage, (1, 4), tokens=True)
    compare(mlp_net, (1, 4, 4), 3, (1, 2), tokens=False, opt="adamw")
    compare(resnet_net, (3, 8, 8), 3, (1, 2), tokens=False)
    compare(gpt_net, (T,), 2, (1, 2), tokens=True, opt="adamw", units=["blocks.*"])
    compare(shifted_net, (8,), 3, (1, 2), tokens=False)  # backward's prefetch holds the most
    # every gather when its unit starts, every regather when backward first reads it
    compare(gpt_net, (T,), 3, (1, 2), tokens=True, prefetch=False)
    compare(shifted_net, (8,), 1, (1, 2), tokens=False, prefetch=False)
    if HAVE_TRANSFORMERS:
        compare(llama_net, (T,), 3, (1, 4), tokens=True, opt="adamw")
        compare(llama_net, (T,), 1, (1, 2), tokens=True, units=["LlamaDecoderLayer"])


@check
def bf16_training_gathers_half_the_bytes_and_trains_as_one_process() -> None:
    """trainer.precision=bf16: the whole parameters gathered (and their gradients scattered) in
    bf16, the pieces and AdamW's state float32; the losses within bf16's rounding of one
    process's under the same autocast."""
    grid: ProcessGrid | None = GRIDS[(1, 2)]
    if grid is None:
        return
    half = STRATEGIES.get("fsdp")(pricing=PricingContext(compute_dtype=torch.bfloat16))
    full = STRATEGIES.get("fsdp")()
    torch.manual_seed(3)
    seq = mlp_net()
    place_whole(seq)
    sample = (1, 4, 4)
    ops = half.predict_ops(seq, sample, grid.shape, BATCH)
    gathered = sum(op.nbytes for op in ops if op.op == "allgather")
    assert 2 * gathered == sum(op.nbytes for op in full.predict_ops(seq, sample, grid.shape, BATCH)
                               if op.op == "allgather")
    pmodel = half.parallelize(tagged_copy(seq, False), sample, grid)
    assert all(p.dtype == torch.float32 for p in pmodel.parameters())
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(BATCH, *sample, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    seq_opt = optimizer(list(seq.parameters()), "adamw")
    par_opt = optimizer(list(pmodel.parameters()), "adamw")
    predicted = Counter(op.key for op in ops)
    grid.counter.keep_records = True
    for step in range(3):
        seq_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seq_loss = F.cross_entropy(seq(x), y)
        seq_loss.backward()
        pmodel.zero_grad()
        grid.counter.records.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            score = pmodel.score(pmodel(x[pmodel.input_rows(BATCH)]), y[pmodel.output_rows(BATCH)])
        (score.loss_sum * grid.size / BATCH).backward()
        pmodel.finish_gradient_sync()
        assert_moved_as_predicted(grid, predicted, "mlp bf16", step)
        loss = grid.world.mpi_comm.allreduce(score.loss_sum.item()) / BATCH
        assert abs(loss - seq_loss.item()) <= 2e-2 * abs(seq_loss.item()), (step, loss,
                                                                            seq_loss.item())
        seq_opt.step()
        par_opt.step()
    grid.counter.keep_records = False
