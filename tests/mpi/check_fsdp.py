"""Sharded data parallelism (strategies/fsdp.py, its machinery in strategies/sharding/) against
one process, in the launch of `check_plans.py` (which imports this script):
`mpiexec -n 4 python check_plans.py`.

gridrun's MLP, ResNet (BatchNorm with one process's statistics) and GPT (tied embedding and
head), the transformers library's Llama, in float64, under strategy=fsdp 1x2 and 1x4 at stages
1, 2 and 3, and on the 2x2 grid (the model split over the model group by a plan by module or
GPT's tensor parallelism, each rank's part sharded over its batch group): every step's loss
equals one process's to 1e-9 relative (SGD with momentum; AdamW), every final piece equals the
block of one process's parameter its placement names, the pieces tile every parameter (a
checkpoint loads on any grid), and the bytes rank 0 moves every step are the predicted ones
(under stage 3 the second gather of each unit whose backward reads its weights included), and
so are the most whole parameters held at once, with prefetch (the default: a unit's gather
issued ahead, its buffer counted from then; a model whose backward holds the most) and
without, none left held or in flight after the steps; under bf16 the gathers move half the
bytes and the losses stay within bf16's rounding of one process's under the same autocast.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

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
from runner.cost.collectives import CommOp
from runner.zoo.models import mlp, resnet
from strategies import STRATEGIES, PricingContext
from strategies.probe import logits_of
from strategies.transformer.gpt import GPT
from tests import plan_models

GRIDS = make_grids([(1, 2), (1, 4), (2, 2)])
VOCAB, T, BATCH, CLASSES = 48, 8, 8, 4
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def optimizer(params: list[nn.Parameter], name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@dataclass(frozen=True)
class Net:
    """A model to shard: how it is built, one sample's shape, and whether it reads token ids
    (else features, one class per sample)."""

    build: Callable[[], nn.Module]
    sample: tuple[int, ...]
    tokens: bool


def compare(net: Net, stage: int, shape: tuple[int, int], opt: str = "sgd",
            units: str | list[str] = "auto", plan: dict[str, str] | None = None,
            prefetch: bool = True) -> None:
    grid: ProcessGrid | None = GRIDS[shape]
    if grid is None:
        return
    sample, tokens = net.sample, net.tokens
    what = (f"{net.build.__name__} fsdp stage {stage} {shape[0]}x{shape[1]} {opt}"
            f"{'' if prefetch else ' no prefetch'}")
    strategy = STRATEGIES.get("fsdp")(stage=stage, units=units, bucket_cap_mb=0.004,
                                      first_bucket_mb=0.001, plan=plan, prefetch=prefetch)
    seq = built(net.build, tokens)
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


MLP = Net(mlp_net, (1, 4, 4), tokens=False)
SHIFTED = Net(shifted_net, (8,), tokens=False)
RESNET = Net(resnet_net, (3, 8, 8), tokens=False)
GPT_NET = Net(gpt_net, (T,), tokens=True)
LLAMA = Net(llama_net, (T,), tokens=True)


@check
def sharded_data_parallelism_equals_one_process_at_every_stage() -> None:
    for stage in (1, 2, 3):
        compare(MLP, stage, (1, 4))
        compare(GPT_NET, stage, (1, 4))
    compare(MLP, 3, (1, 2), opt="adamw")
    compare(RESNET, 3, (1, 2))
    compare(GPT_NET, 2, (1, 2), opt="adamw", units=["blocks.*"])
    compare(SHIFTED, 3, (1, 2))  # backward's prefetch holds the most
    # every gather when its unit starts, every regather when backward first reads it
    compare(GPT_NET, 3, (1, 2), prefetch=False)
    compare(SHIFTED, 1, (1, 2), prefetch=False)
    if HAVE_TRANSFORMERS:
        compare(LLAMA, 3, (1, 4), opt="adamw")
        compare(LLAMA, 1, (1, 2), units=["LlamaDecoderLayer"])


@check
def two_dimensional_sharding_equals_one_process() -> None:
    """grid.pr=2: GPT split by its tensor parallelism, Llama by its declared plan, the MLP and
    ResNet by a plan given; each rank's part sharded over its batch group, the pieces of what a
    model group holds whole summed over the model group too."""
    compare(GPT_NET, 3, (2, 2))
    compare(GPT_NET, 1, (2, 2), opt="adamw")
    compare(MLP, 2, (2, 2), plan={"1": "colwise", "3": "rowwise"})
    compare(RESNET, 3, (2, 2), plan={"fc": "colwise"})
    if HAVE_TRANSFORMERS:
        compare(LLAMA, 2, (2, 2), opt="adamw")


@check
def bf16_training_gathers_half_the_bytes_and_trains_as_one_process() -> None:
    """trainer.precision=bf16: the whole parameters gathered (and their gradients scattered) in
    bf16, the pieces and AdamW's state float32; the losses within bf16's rounding of one
    process's under the same autocast. At 1x2 (the MLP) and 2x2 (GPT's tensor parallelism,
    whose embedding all-reduce then moves the bf16 rows the gathered table gives)."""
    for shape, net in (((1, 2), MLP), ((2, 2), GPT_NET)):
        grid: ProcessGrid | None = GRIDS[shape]
        if grid is not None:
            train_bf16(grid, net)


def train_bf16(grid: ProcessGrid, net: Net) -> None:
    sample, tokens = net.sample, net.tokens
    what = f"{net.build.__name__} bf16 {grid.pr}x{grid.pc}"
    half = STRATEGIES.get("fsdp")(pricing=PricingContext(compute_dtype=torch.bfloat16))
    full = STRATEGIES.get("fsdp")()
    torch.manual_seed(3)
    seq = net.build()
    place_whole(seq)
    ops = half.predict_ops(seq, sample, grid.shape, BATCH)
    def gathered(ops: list[CommOp]) -> int:
        return sum(op.nbytes for op in ops if op.op == "allgather" and op.layer.startswith("fsdp"))

    assert 2 * gathered(ops) == gathered(full.predict_ops(seq, sample, grid.shape, BATCH)), what
    pmodel = half.parallelize(tagged_copy(seq, tokens), sample, grid)
    assert all(p.dtype == torch.float32 for p in pmodel.parameters())
    gen = torch.Generator().manual_seed(9)
    if tokens:
        x = torch.randint(1, VOCAB, (BATCH, *sample), generator=gen)
        y = torch.randint(0, VOCAB, (BATCH, *sample), generator=gen)
    else:
        x = torch.randn(BATCH, *sample, generator=gen)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    seq_opt = optimizer(list(seq.parameters()), "adamw")
    par_opt = optimizer(list(pmodel.parameters()), "adamw")
    predicted = Counter(op.key for op in ops)
    grid.counter.keep_records = True
    for step in range(3):
        seq_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = logits_of(seq(x))
            seq_loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        seq_loss.backward()
        pmodel.zero_grad()
        grid.counter.records.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            score = pmodel.score(pmodel(x[pmodel.input_rows(BATCH)]), y[pmodel.output_rows(BATCH)])
        (score.loss_sum * grid.size / y.numel()).backward()
        pmodel.finish_gradient_sync()
        assert_moved_as_predicted(grid, predicted, what, step)
        loss = grid.world.mpi_comm.allreduce(score.loss_sum.item()) / y.numel()
        assert abs(loss - seq_loss.item()) <= 2e-2 * abs(seq_loss.item()), (what, step, loss,
                                                                            seq_loss.item())
        seq_opt.step()
        par_opt.step()
    grid.counter.keep_records = False
