"""Per-layer layouts (`strategy=auto`, `strategies/layouts/chain.py`) against the sequential model,
in
one launch: `mpiexec -n 4 python THIS TMPDIR`, or in check_model_grid.py's, which imports it.

- every layout of every layer kind (domain in height and in height × width), alone and mixed in
  one model (pinned), on grids 2x1, 4x1,
  1x4 and 2x2: the output rows equal the sequential model's, every rank's piece of every
  gradient (found by its checkpoint placement: rows and columns of the global tensor) equals
  the sequential gradient's piece, and the collectives rank 0 issues are exactly the predicted
  ones;
- end to end: train() with strategy=auto (chosen) and with pinned mixed layouts — a domain
  prefix of digits' CNN at 4x1 (which strategy=domain refuses), 2-D fully-connected layers at
  2x2 — gives the single-process losses to 1e-5 relative and moves the predicted bytes.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from harness import check, make_grids, one_process_losses, run_checks, train_losses, train_run
from mpi4py import MPI
from torch import nn

from runner.core import ProcessGrid
from runner.core.placement import place_whole, placement_of
from strategies import PricingContext
from strategies.auto import AutoLayout

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
OUT = (Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")) / "check_layouts"
GRIDS = [(2, 1), (4, 1), (1, 4), (2, 2)]
GRID_OF = make_grids(GRIDS)
BATCH = 14  # divisible by every pc here; pieces of 14 over 4 ranks are uneven


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 11), nn.ReLU(), nn.Linear(11, 9), nn.Tanh(),
                         nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 5))


def cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 5, 3, padding=1), nn.BatchNorm2d(5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(5, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(6 * 4 * 3, 9), nn.ReLU(), nn.Linear(9, 5))


# (model, sample shape, pinned layouts): each Linear layout and each Conv2d layout at least
# once, in pairs that need every kind of redistribution between them.
CASES = [
    ("mlp", mlp, (3, 4), {"1": "batch", "3": "batch", "5": "batch", "7": "batch"}),
    ("mlp", mlp, (3, 4), {"1": "row", "3": "col", "5": "row", "7": "col_rows"}),
    ("mlp", mlp, (3, 4), {"1": "2d", "3": "2d_t", "5": "2d", "7": "2d_t"}),
    ("mlp", mlp, (3, 4), {"1": "2d", "3": "row", "5": "batch", "7": "col"}),
    ("mlp", mlp, (3, 4), {"1": "col_rows", "3": "2d_t", "5": "col", "7": "2d"}),
    ("cnn", cnn, (2, 8, 6), {"0": "domain", "4": "domain", "7": "2d", "9": "row"}),
    ("cnn", cnn, (2, 8, 6), {"0": "domain_hw", "4": "domain_hw", "7": "2d", "9": "batch"}),
    ("cnn", cnn, (2, 8, 6), {"0": "domain_hw", "4": "domain", "7": "row", "9": "col"}),
    ("cnn", cnn, (2, 8, 6), {"0": "filters", "4": "batch", "7": "col", "9": "2d_t"}),
    ("cnn", cnn, (2, 8, 6), {"0": "batch", "4": "filters", "7": "batch", "9": "col_rows"}),
    ("cnn", cnn, (2, 8, 6), {}),  # auto's own choice
]


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert got.shape == want.shape and err <= tol * scale, (
        f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}, err {err}")


def piece_of(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The rows and columns of `whole` that `param`'s placement says it holds."""
    place = placement_of(param)
    assert place is not None
    rows = whole.reshape(1) if whole.dim() == 0 else whole
    rows = rows[place.start:place.stop]
    if place.col_stop is not None:
        rows = rows[:, place.col_start:place.col_stop]
    return rows.reshape(param.shape)


def compare(name: str, build, sample: tuple[int, ...], pins: dict[str, str],
            grid: ProcessGrid) -> None:
    torch.manual_seed(5)
    seq = build()
    place_whole(seq)
    names = {id(p): n for n, p in seq.named_parameters()}
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(BATCH, *sample, generator=gen)
    seq_out = seq(x)
    probe = torch.randn(seq_out.shape, generator=gen)
    (seq_out * probe).sum().backward()
    grads = {names[id(p)]: p.grad.clone() for p in seq.parameters()}
    seq.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    fresh = build()  # the parallel model reuses whole layers: start from a clean copy
    place_whole(fresh)
    strategy = AutoLayout(bucket_cap_mb=0.002, first_bucket_mb=0.001, layouts=pins,
                          pricing=PricingContext(global_batch=BATCH))
    assert not strategy.check_model(build(), sample, grid.shape), name
    pmodel = strategy.parallelize(fresh, sample, grid)
    grid.counter.keep_records = True
    grid.counter.records.clear()
    rows_in, rows_out = pmodel.input_rows(BATCH), pmodel.output_rows(BATCH)
    out = pmodel(x[rows_in])
    close(out.detach(), seq_out.detach()[rows_out], f"{name} output")
    (out * probe[rows_out]).sum().backward()
    pmodel.finish_gradient_sync()
    for param in pmodel.parameters():
        place = placement_of(param)
        assert place is not None, name
        close(param.grad * grid.size, piece_of(grads[place.name], param),
              f"{name} gradient of {place.name}")
    measured = Counter((r.op, r.group, r.group_size, r.nbytes) for r in grid.counter.records)
    predicted = Counter(op.key for op in strategy.predict_ops(build(), sample, grid.shape,
                                                              BATCH))
    # rank 0's prediction (the first pieces of uneven partitions are the largest)
    assert grid.rank != 0 or measured == predicted, (
        f"{name}: measured-only {measured - predicted}, predicted-only {predicted - measured}")


@check
def every_layout_alone_and_mixed_equals_the_sequential_model() -> None:
    for pr, pc in GRIDS:
        grid = GRID_OF[pr, pc]
        if grid is None:
            continue
        for model, build, sample, pins in CASES:
            if "domain" in pins.values() and pr > 2:
                continue  # height 4 after the pooling: the second domain conv needs pr <= 4
            if "domain_hw" in pins.values() and (pr > 2 or pc > 2):
                continue  # and width 3: pc <= 3
            compare(f"{model} {pins} {pr}x{pc}", build, sample, pins, grid)


def run_config(model: dict, pins: dict[str, str] | None, pr: int, pc: int, steps: int) -> dict:
    strategy = {"name": "auto", "layouts": pins or {}} if pins is not None else {"name": "grid"}
    return {
        "seed": 1, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": steps, "batch_size": 32, "log_every": 1, "eval_every": steps,
                    "checkpoint_every": None, "resume": None, "threads": None},
        "model": model, "dataset": {"name": "digits", "val_fraction": 0.2},
        "strategy": strategy, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


CNN = {"name": "cnn", "channels": [6, 10], "kernel_size": 3, "hidden": [30, 21],
       "activation": "relu"}
# digits' CNN: conv 0, relu 1, pool 2, conv 3, relu 4, pool 5, flatten 6, linear 7, relu 8,
# linear 9, relu 10, linear 11 (runner.zoo.models.cnn)
RUNS = [
    ("domain_prefix", CNN, {"0": "domain", "3": "domain", "7": "row", "9": "col", "11": "batch"},
     4, 1),
    ("tiles_prefix", CNN, {"0": "domain_hw", "3": "domain_hw", "7": "2d", "9": "2d_t",
                           "11": "col_rows"}, 2, 2),
    ("two_d", CNN, {"0": "batch", "3": "filters", "7": "2d", "9": "2d_t", "11": "2d"}, 2, 2),
    ("chosen", CNN, {}, 2, 2),
]


@check
def training_reproduces_the_single_process_losses() -> None:
    steps = 15
    reference = one_process_losses({"cnn": (run_config(CNN, None, 1, 1, steps),
                                            OUT / "reference")})["cnn"]
    for name, model, pins, pr, pc in RUNS:
        grid = GRID_OF[pr, pc]
        if grid is None:
            continue
        path = train_run(run_config(model, pins, pr, pc, steps), OUT / name, grid)
        if grid.rank != 0:
            continue
        got, lines = train_losses(path)
        gap = max(abs(a - b) / abs(a) for a, b in zip(reference, got, strict=True))
        assert gap <= 1e-5, f"{name} {pr}x{pc}: relative gap {gap}"
        summary = json.loads((path / "summary.json").read_text())
        predicted = summary["predicted_comm_bytes_per_step"]
        assert all(m["comm_bytes"] == predicted for m in lines), (
            f"{name}: measured {lines[0]['comm_bytes']} predicted {predicted}")
        assert summary["layouts"] and summary["predicted_step_time_s"] > 0, summary
        for layer, layout in pins.items():
            assert summary["layouts"][layer] == layout, (name, summary["layouts"])


if __name__ == "__main__":
    run_checks()
