"""Domain parallelism against the sequential model, in one launch:
`mpiexec -n 4 python THIS TMPDIR`, or in check_model_grid.py's, which imports it. Groups
smaller than 4 use the first ranks of the world.

- each height-split convolution and pooling layer: output and the gradients of input, weight
  and bias equal torch's on the whole image (kernels 1, 3, 5; strides 1, 2; padding 0, 1, 2;
  heights not divisible by the ranks; overlap on and off), to 1e-5 in float32;
- end to end: train() with strategy=domain at (2,1), (4,1), (2,2) on the CNN reproduces the
  single-process losses over 30 steps and moves exactly the predicted bytes. This runs in
  float64: with max-pooling, float32 rounding is amplified chaotically by training (one process
  with 1 and with 2 threads already differs by 1e-1 after 50 steps of this run), so only float64
  shows that the mathematics is the same. It agrees to 1e-12 here; the bar is 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from harness import (
    assert_one_process,
    check,
    make_grids,
    one_process_losses,
    run_checks,
    train_run,
)
from mpi4py import MPI
from torch import nn

from runner.core import CountedComm, ProcessGrid
from strategies.layers.spatial import SpatialWindowed

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
OUT = (Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")) / "check_domain"


GRID_OF = make_grids([(2, 1), (3, 1), (4, 1), (2, 2)])


def sub_comm(size: int) -> CountedComm | None:
    grid = GRID_OF[size, 1]
    return None if grid is None else grid.model


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    err = (got - want).abs().max().item() if want.numel() else 0.0
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert got.shape == want.shape and err <= tol * scale, (
        f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}, err {err}")


def layers():
    for kernel in (1, 3, 5):
        for stride in (1, 2):
            for padding in (0, 1, 2):
                if padding <= kernel // 2:
                    yield f"conv k{kernel} s{stride} p{padding}", nn.Conv2d(3, 4, kernel, stride,
                                                                             padding)
    yield "maxpool k2", nn.MaxPool2d(2)
    yield "maxpool k3 s2 p1", nn.MaxPool2d(3, 2, 1)
    yield "avgpool k2", nn.AvgPool2d(2)
    yield "avgpool k3 s1 p1", nn.AvgPool2d(3, 1, 1)
    yield "avgpool k3 s1 p1 divisor 5", nn.AvgPool2d(3, 1, 1, divisor_override=5)


@check
def split_layers_equal_whole_image_layers() -> None:
    for size in (2, 3, 4):
        comm = sub_comm(size)
        if comm is None:
            continue
        for height in (4 * size + 3, 2 * size + 1, 11):
            for name, layer in layers():
                torch.manual_seed(5)
                layer.reset_parameters() if hasattr(layer, "reset_parameters") else None
                gen = torch.Generator().manual_seed(height)
                x = torch.randn(2, 3, height, 7, generator=gen)
                whole_x = x.clone().requires_grad_(True)
                whole = layer(whole_x)
                if whole.shape[2] < size:
                    continue
                probe = torch.randn(whole.shape, generator=gen)
                (whole * probe).sum().backward()
                grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
                for overlap in (True, False):
                    layer.zero_grad()
                    split = SpatialWindowed(layer, comm, height, overlap)
                    own_in = slice(*split.plan.own_rows)
                    out_part = split.plan.out_part
                    own_out = out_part.slice(comm.rank)
                    slab = x[:, :, own_in].clone().requires_grad_(True)
                    out = split(slab)
                    what = f"{name} H={height} on {size} ranks overlap={overlap}"
                    close(out.detach(), whole.detach()[:, :, own_out], f"{what} output")
                    (out * probe[:, :, own_out]).sum().backward()
                    close(slab.grad, whole_x.grad[:, :, own_in], f"{what} input gradient")
                    for n, p in layer.named_parameters():
                        summed = p.grad.clone()
                        comm.allreduce_(summed)
                        close(summed, grads[n], f"{what} {n} gradient")


MODELS = {
    "cnn": {"name": "cnn", "channels": [6, 8], "kernel_size": 5, "hidden": [32],
            "activation": "relu"},
    # a module tree: halos inside residual blocks, shortcut convolutions on the same slabs,
    # BatchNorm statistics over every rank's slabs (strategies/layers/tree.py)
    "resnet": {"name": "resnet", "widths": [4, 6], "blocks": [1, 1]},
}
STEPS = {"cnn": 30, "resnet": 15}


def run_config(pr: int, pc: int, model: str = "cnn") -> dict:
    return {
        "seed": 1, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": STEPS[model], "batch_size": 16, "log_every": 1, "eval_every": 50,
                    "checkpoint_every": None, "resume": None, "threads": None,
                    "dtype": "float64"},
        "model": MODELS[model],
        "dataset": {"name": "synthetic", "shape": [2, 16, 16], "classes": 10, "samples": 512,
                    "noise": 5.0, "val_fraction": 0.25, "seed": 1},
        "strategy": {"name": "domain" if pr * pc > 1 else "grid"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


def run(pr: int, pc: int, grid: ProcessGrid, model: str) -> Path:
    return train_run(run_config(pr, pc, model), OUT / f"domain_{model}_{pr}x{pc}", grid)


@check
def domain_training_reproduces_the_single_process_losses() -> None:
    references = one_process_losses({model: (run_config(1, 1, model),
                                             OUT / f"domain_{model}_1x1") for model in MODELS})
    for model in MODELS:
        reference = references[model]
        for pr, pc in ((2, 1), (4, 1), (2, 2)):
            grid = GRID_OF[pr, pc]
            if grid is None:
                continue
            path = run(pr, pc, grid, model)
            if grid.rank != 0:
                continue
            assert len(reference) == STEPS[model]
            assert_one_process(path, reference, 1e-5, f"domain {model} {pr}x{pc}")


if __name__ == "__main__":
    run_checks()
