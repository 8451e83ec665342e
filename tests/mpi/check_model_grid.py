"""Model and grid strategies against the sequential model, in one launch:
`mpiexec -n 4 python THIS TMPDIR` (with the checks of `check_layouts.py` and `check_domain.py`,
which it imports: one start of 4 ranks for all three). Grids smaller than 4 use the first ranks
of the world.

- each distributed layer: forward output and the gradients of input, weight and bias equal the
  sequential layer's once assembled (shards gathered, partial input gradients summed);
- memory: each rank holds its 1/Pr of every fully-connected weight;
- end to end: train() with strategy=model / grid at (2,1), (4,1), (1,4), (2,2) (model only where
  pc=1), for an MLP and a CNN whose widths do not divide by pr, gives the single-process losses to
  1e-5 relative over 30 steps, and moves exactly the predicted bytes every step;
- evaluation in global batches of `trainer.batch_size` rows gives the loss and accuracy of one
  forward over the whole set (float64: to summation order), under every strategy and grid.
- a ResNet under grid 2x2 (BatchNorm over ranks, split layers) reads no device value on a step
  that does not read its loss, on every rank (tests/test_host_syncs.py's count).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import check_domain  # noqa: F401
import check_layouts  # noqa: F401
import pytest
import torch
from harness import check, make_grids, one_process_losses, run_checks, train_losses, train_run
from mpi4py import MPI
from torch import nn

from runner.core import Partition, ProcessGrid
from runner.core.primitives import all_gather_op
from strategies.grid import build_grid_model, split_at_first_linear
from strategies.layers.split import SplitConv2d, SplitLinear

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's `tests`
from tests.test_host_syncs import (
    BASE,
    IMAGES,
    RESNET,
    assert_as_the_readme_states,
    train_counting,
)

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/check_model_grid")
GRIDS = [(2, 1), (4, 1), (1, 4), (2, 2)]



GRID_OF = make_grids([*GRIDS, (1, 2)])


def sub_grid(pr: int, pc: int) -> ProcessGrid | None:
    return GRID_OF[pr, pc]


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert got.shape == want.shape and err <= tol * scale, (
        f"{what}: {got.shape} vs {want.shape}, err {err}")


def layer_stacks() -> dict[str, tuple[nn.Sequential, tuple[int, ...]]]:
    torch.manual_seed(3)
    return {
        "linear": (nn.Sequential(nn.Linear(7, 13)), (7,)),
        "linear_relu_linear": (nn.Sequential(nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 5)), (7,)),
        "conv": (nn.Sequential(nn.Conv2d(3, 7, 3, padding=1)), (3, 6, 5)),
        "conv_pool_flatten_linear": (nn.Sequential(nn.Conv2d(2, 5, 3, padding=1), nn.ReLU(),
                                                   nn.MaxPool2d(2), nn.Flatten(),
                                                   nn.Linear(5 * 3 * 2, 9)), (2, 6, 4)),
        # Padding modes other than zeros: the sharded convolution pads as nn.Conv2d does.
        "conv_reflect_same": (nn.Sequential(nn.Conv2d(3, 7, 3, padding=1, padding_mode="reflect"),
                                            nn.ReLU(), nn.Conv2d(7, 4, 3, padding="same",
                                                                 padding_mode="circular")),
                              (3, 6, 5)),
        # A bias before a BatchNorm has a gradient of exactly zero, and float32 noise there:
        # without one, as ResNets have it.
        "conv_bn_linear_bn": (nn.Sequential(nn.Conv2d(2, 5, 3, padding=1, bias=False),
                                            nn.BatchNorm2d(5), nn.ReLU(), nn.MaxPool2d(2),
                                            nn.Flatten(), nn.Linear(5 * 3 * 2, 9, bias=False),
                                            nn.BatchNorm1d(9)), (2, 6, 4)),
    }


def compare_stack(name: str, seq: nn.Sequential, sample: tuple[int, ...], grid: ProcessGrid,
                  split: int) -> None:
    batch = 4 * grid.size + 4
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(batch, *sample, generator=gen)
    ref = [p.detach().clone() for p in seq.parameters()]
    seq_x = x.clone().requires_grad_(True)
    seq_out = seq(seq_x)
    probe = torch.randn(seq_out.shape, generator=gen)
    (seq_out * probe).sum().backward()
    # The parallel model reuses the layer objects (batch-parallel ones as they are): keep the
    # sequential gradients aside and start the distributed run from clean ones.
    seq_grads = {id(p): p.grad.clone() for p in seq.parameters()}
    for p, r in zip(seq.parameters(), ref, strict=True):
        p.grad = None
        assert torch.equal(p.detach(), r)
    pmodel = build_grid_model(seq, grid, split, True, 1 << 20, 1 << 20)
    rows_in = Partition(batch, grid.pc).slice(grid.batch_index)
    rows_out_local = Partition(rows_in.stop - rows_in.start, grid.pr).slice(grid.model_index)
    rows_out = slice(rows_in.start + rows_out_local.start, rows_in.start + rows_out_local.stop)
    assert pmodel.input_rows(batch) == rows_in and pmodel.output_rows(batch) == rows_out
    local_x = x[rows_in].clone().requires_grad_(True)
    out = pmodel(local_x)
    close(out.detach(), seq_out.detach()[rows_out], f"{name} output")
    # Each rank's loss covers its own rows: together, the sequential loss.
    (out * probe[rows_out]).sum().backward()
    pmodel.finish_gradient_sync()  # sums over replicas and scales by 1/P

    # Input gradient: the model group's partial gradients add up to the sequential one.
    summed = local_x.grad.clone()
    grid.model.allreduce_(summed)
    close(summed, seq_x.grad[rows_in], f"{name} input gradient")
    # Parameters: sharded ones are gathered along dim 0 over the model group.
    shard_modules = [m for m in pmodel.body if isinstance(m, (SplitLinear, SplitConv2d))]
    seq_sharded = [m for m in list(seq)[split:] if isinstance(m, (nn.Linear, nn.Conv2d))]
    for shard, whole in zip(shard_modules, seq_sharded, strict=True):
        total = whole.weight.shape[0]
        part = Partition(total, grid.pr)
        for pname in ("weight", "bias"):
            local = getattr(shard, pname)
            if local is None:
                continue
            assert local.shape[0] == part.sizes[grid.model_index], (name, local.shape, part)
            grad = all_gather_op(local.grad * grid.size, grid.model, 0, part)
            close(grad, seq_grads[id(getattr(whole, pname))], f"{name} {pname} gradient")
    for p in pmodel.prefix.parameters():  # the very same objects as the sequential prefix
        close(p.grad * grid.size, seq_grads[id(p)], f"{name} batch-parallel parameter gradient")


@check
def distributed_layers_equal_sequential_layers() -> None:
    for pr, pc in GRIDS:
        grid = sub_grid(pr, pc)
        if grid is None:
            continue
        for name, (seq, _) in layer_stacks().items():
            for split in sorted({0, split_at_first_linear(seq)}):  # model layout, grid layout
                fresh, sample = layer_stacks()[name]  # a parallel model keeps hooks on layers
                compare_stack(f"{name} {pr}x{pc} split {split}", fresh, sample, grid, split)


@check
def each_rank_holds_its_share_of_every_weight() -> None:
    grid = sub_grid(4, 1)
    if grid is None:
        return
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Flatten(), nn.Linear(64, 30), nn.ReLU(), nn.Linear(30, 21), nn.ReLU(),
                        nn.Linear(21, 10))
    pmodel = build_grid_model(seq, grid, 0, True, 1 << 20, 1 << 20)
    linears = [m for m in pmodel.body if isinstance(m, SplitLinear)]
    for shard, out_features in zip(linears, (30, 21, 10), strict=True):
        rows = shard.weight.shape[0]
        assert rows == Partition(out_features, 4).sizes[grid.model_index]
        assert out_features // 4 <= rows <= -(-out_features // 4)
        assert shard.weight.shape[1] == shard.in_features
    full = sum(p.numel() for p in seq.parameters())
    mine = sum(p.numel() for p in pmodel.parameters())
    assert mine <= full / 4 + (64 + 30 + 21 + 3), (mine, full)


@check
def every_measured_collective_is_predicted() -> None:
    """One step: the multiset of (operation, group, group size, bytes) rank 0 issues equals the
    strategy's prediction, for every strategy and grid, MLP and CNN with uneven widths."""
    from collections import Counter

    from runner.zoo.models import cnn, mlp, resnet
    from strategies import STRATEGIES

    for pr, pc in [*GRIDS, (1, 2)]:
        grid = sub_grid(pr, pc)
        if grid is None:
            continue
        grid.counter.keep_records = True
        for model_name, build, sample in (
                ("mlp", lambda: mlp((1, 8, 8), 10, hidden=(30, 21)), (1, 8, 8)),
                ("cnn", lambda: cnn((1, 8, 8), 10, channels=(6, 10), hidden=(30, 21)),
                 (1, 8, 8)),
                ("cnn_bn", cnn_with_batch_norm, (1, 8, 8)),
                ("resnet", lambda: resnet((1, 8, 8), 10, widths=(4, 6), blocks=(1, 1)),
                 (1, 8, 8)),
                ("user_residual_mlp", ResidualMLP, (1, 8, 8))):
            for name in ("data", "model", "grid", "domain"):
                strategy = STRATEGIES.get(name)(bucket_cap_mb=0.004, first_bucket_mb=0.001)
                if (strategy.check(grid.shape, 32)
                        or strategy.check_model(build(), sample, grid.shape)):
                    continue  # refused before anything starts, as validation would
                torch.manual_seed(0)
                model = build()
                pmodel = strategy.parallelize(model, sample, grid)
                x = torch.randn(32, *sample)
                y = torch.randint(0, 10, (32,))
                grid.counter.records.clear()
                out = pmodel(x[pmodel.input_rows(32)])
                torch.nn.functional.cross_entropy(out, y[pmodel.output_rows(32)]).backward()
                pmodel.finish_gradient_sync()
                measured = Counter((r.op, r.group, r.group_size, r.nbytes)
                                   for r in grid.counter.records)
                predicted = Counter(op.key for op in strategy.predict_ops(
                    build(), sample, grid.shape, 32))
                if grid.rank == 0:
                    assert measured == predicted, (
                        f"{name} {model_name} {pr}x{pc}: measured-only {measured - predicted}, "
                        f"predicted-only {predicted - measured}")


@check
def evaluation_in_batches_equals_one_forward() -> None:
    """A set of 37 rows (no batch size divides it) scored in global batches of 8 and 12 rows
    (pieces of 7 to 8 and 12 to 13 rows, each split over the batch group as training splits a
    batch), and at the smallest size a batch may have on the grid: the loss and accuracy of
    the whole set at once, to float64's summation order, for every strategy and grid."""
    from runner.training.evaluation import evaluate
    from runner.zoo.models import mlp, resnet
    from strategies import STRATEGIES

    for pr, pc in [*GRIDS, (1, 2)]:
        grid = sub_grid(pr, pc)
        if grid is None:
            continue
        for model_name, build in (
                ("mlp", lambda: mlp((1, 8, 8), 10, hidden=(30, 21)).double()),
                ("cnn_bn", lambda: cnn_with_batch_norm().double()),
                ("resnet", lambda: resnet((1, 8, 8), 10, widths=(4, 6), blocks=(1, 1)).double())):
            for name in ("data", "model", "grid", "domain"):
                strategy = STRATEGIES.get(name)()
                if (strategy.check(grid.shape, 32)
                        or strategy.check_model(build(), (1, 8, 8), grid.shape)):
                    continue  # refused before anything starts, as validation would
                torch.manual_seed(0)
                pmodel = strategy.parallelize(build(), (1, 8, 8), grid)
                gen = torch.Generator().manual_seed(5)
                x = torch.randn(37, 1, 8, 8, generator=gen, dtype=torch.float64)
                y = torch.randint(0, 10, (37,), generator=gen)
                whole = evaluate(pmodel, x, y)
                for batch in (8, 12, pc):
                    part = evaluate(pmodel, x, y, batch_size=batch)
                    what = f"{name} {model_name} {pr}x{pc} in batches of {batch}"
                    assert abs(part.loss - whole.loss) <= 1e-12 * abs(whole.loss), (
                        what, part.loss, whole.loss)
                    assert part.accuracy == whole.accuracy, (what, part, whole)


class ResidualMLP(nn.Module):
    """A user's module tree: a method call, a function, a skip connection (examples/byo's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block = nn.Linear(64, 30), nn.Sequential(nn.Linear(30, 30), nn.Tanh())
        self.head = nn.Linear(30, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x.flatten(1)))
        return self.head(h + self.block(h))


def cnn_with_batch_norm() -> nn.Sequential:
    """BatchNorm where each strategy puts it somewhere else: after a convolution (batch-parallel
    under grid, split by channel under model, on height slabs under domain) and after a
    fully-connected layer (split by feature under model and grid)."""
    return nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(6, 10, 3, padding=1), nn.BatchNorm2d(10),
                         nn.ReLU(), nn.Flatten(), nn.Linear(160, 30), nn.BatchNorm1d(30),
                         nn.ReLU(), nn.Linear(30, 10))


# The newer models' runs are shorter and on fewer grids (every grid's collectives are checked
# against the prediction in every_measured_collective_is_predicted all the same).
STEPS = {"mlp": 30, "cnn": 30, "vgg_bn": 20, "resnet": 20}
NEWER = {"vgg_bn": {"model": [(4, 1)], "grid": [(2, 2)]},
         "resnet": {"model": [(2, 1)], "grid": [(2, 2)]}}


def run_config(strategy: str, model: str, pr: int, pc: int) -> dict:
    model_cfg = {
        "mlp": {"name": "mlp", "hidden": [30, 21], "activation": "relu"},
        "cnn": {"name": "cnn", "channels": [6, 10], "kernel_size": 3, "hidden": [30, 21],
                "activation": "relu"},
        # BatchNorm after every convolution; no dropout (its draws are per rank)
        "vgg_bn": {"name": "vgg", "config": [6, "M", 10], "batch_norm": True, "hidden": 30,
                   "dropout": 0.0},
        # a module tree: residual additions, projection shortcuts (widths that do not divide
        # by Pr), BatchNorm (strategies/layers/tree.py)
        "resnet": {"name": "resnet", "widths": [4, 6], "blocks": [1, 1]},
    }[model]
    return {
        "seed": 1, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": STEPS[model], "batch_size": 32, "log_every": 1, "eval_every": 50,
                    "checkpoint_every": None, "resume": None, "threads": None},
        "model": model_cfg, "dataset": {"name": "digits", "val_fraction": 0.2},
        "strategy": {"name": strategy}, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


def run(strategy: str, model: str, pr: int, pc: int, grid: ProcessGrid) -> Path:
    return train_run(run_config(strategy, model, pr, pc), OUT / f"{strategy}_{model}_{pr}x{pc}",
                     grid)


@check
def training_reproduces_the_single_process_losses() -> None:
    models = ("mlp", "cnn", "vgg_bn", "resnet")
    references = one_process_losses({model: (run_config("grid", model, 1, 1),
                                             OUT / f"grid_{model}_1x1") for model in models})
    for model in models:
        reference = references[model]
        for strategy in ("model", "grid"):
            for pr, pc in GRIDS:
                if strategy == "model" and pc != 1:
                    continue
                if model in NEWER and (pr, pc) not in NEWER[model][strategy]:
                    continue  # the suite's time: the layouts these grids add are the same
                grid = sub_grid(pr, pc)
                if grid is None:
                    continue
                path = run(strategy, model, pr, pc, grid)
                if grid.rank != 0:
                    continue
                got, lines = train_losses(path)
                assert len(got) == STEPS[model]
                gap = max(abs(a - b) / abs(a) for a, b in zip(reference, got, strict=True))
                assert gap <= 1e-5, f"{strategy} {model} {pr}x{pc}: relative gap {gap}"
                summary = json.loads((path / "summary.json").read_text())
                predicted = summary["predicted_comm_bytes_per_step"]
                assert all(m["comm_bytes"] == predicted for m in lines), (
                    f"{strategy} {model} {pr}x{pc}: measured {lines[0]['comm_bytes']} "
                    f"predicted {predicted}")


@check
def a_step_reads_the_device_only_where_the_readme_says() -> None:
    config = {**BASE, "model": RESNET, "dataset": IMAGES, "strategy": {"name": "grid"},
              "grid": {"pr": 2, "pc": 2}}
    grid = sub_grid(2, 2)
    assert grid is not None
    with pytest.MonkeyPatch.context() as patch:
        reads, _ = train_counting(config, OUT / "host_reads", patch, grid)
    assert_as_the_readme_states(reads, config, f"resnet grid 2x2, rank {RANK}")


if __name__ == "__main__":
    run_checks()
