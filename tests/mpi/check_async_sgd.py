"""SC17's asynchronous baselines on real ranks (`runner/optim/parameter_server.py`); these checks
run in check_easgd.py's launch (`mpiexec -n 4 python check_easgd.py TMPDIR`), or alone.

- with one replica each is plain SGD: `async_sgd` and `hogwild_sgd` torch's SGD, `async_msgd`
  torch's SGD with momentum μ (1 × 1 on each rank, and `grid` 2 × 1, where the convolutions are
  group-replicated), to 1e-10 in float64; a 1-replica `async_msgd` run resumed from its step-10
  checkpoint repeats the uninterrupted run's losses bit for bit;
- with four replicas (1 × 4, and `grid` 2 × 2: pieces and group-replicated parameters) nothing
  pushed is lost: W = W₀ − η Σ∇ for `async_sgd` and `hogwild_sgd`, and for `async_msgd`
  W − W₀ = −(μV + ηΣ∇)/(1 − μ), which holds only if every V, W read-modify-write is atomic —
  the same run without the lock breaks it;
- on 2 × 2, a resumed `async_msgd` holds the checkpoint's server weights and velocity in its
  windows (every replica saved the same V) and each replica its own weights;
- each reaches 0.9 validation accuracy on digits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from harness import check, run_checks, train_losses, train_run
from mpi4py import MPI
from omegaconf import OmegaConf
from torch import nn

from runner.checkpoint.read import Checkpoint
from runner.cli.validation import validate
from runner.core import ProcessGrid
from runner.optim.easgd import _flatten_into
from runner.optim.parameter_server import (
    SERVER_VELOCITY,
    AsyncMSGD,
    AsyncSGD,
    HogwildSGD,
    ParameterServer,
)
from runner.records.rundir import RunDir
from runner.training.loop import build_training
from strategies import STRATEGIES
from strategies.data import DataParallel

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/check_async_sgd")
MU = 0.9


def config(optimizer: dict, strategy: str = "data", pr: int = 1, pc: int = 1, steps: int = 20,
           model: str = "mlp", every: int | None = None, resume: str | None = None) -> dict:
    model_cfg = ({"name": "mlp", "hidden": [32], "activation": "tanh"} if model == "mlp" else
                 {"name": "cnn", "channels": [3], "kernel_size": 3, "hidden": [16],
                  "activation": "tanh"})
    return {
        "seed": 1, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": steps, "batch_size": 32, "log_every": 1, "eval_every": None,
                    "checkpoint_every": every, "resume": resume, "threads": 1,
                    "dtype": "float64"},
        "model": model_cfg,
        "dataset": {"name": "digits", "val_fraction": 0.2},
        "strategy": {"name": strategy},
        "optimizer": optimizer,
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


def summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


def pair_grid() -> ProcessGrid:
    """Ranks {0, 1} and {2, 3}: two 2 × 1 grids side by side."""
    return ProcessGrid(2, 1, WORLD.Split(RANK // 2, RANK))


def assert_same_run(path: Path, reference: Path, label: str) -> None:
    got, want = train_losses(path)[0], train_losses(reference)[0]
    gap = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert gap < 1e-10, f"{label}: losses differ from plain SGD by {gap}"
    val_gap = abs(summary(path)["val_loss"] - summary(reference)["val_loss"])
    assert val_gap < 1e-10, f"{label}: validation loss differs from plain SGD by {val_gap}"


@check
def one_replica_is_plain_sgd() -> None:
    # Each rank a 1 × 1 run of its own; then the pairs as 2 × 1 grids (group-replicated convs).
    lr = 0.05
    alone = ProcessGrid(1, 1)
    name, momentum = (("async_sgd", 0.0), ("hogwild_sgd", 0.0), ("async_msgd", MU),
                      ("async_msgd", 0.5))[RANK % 4]
    options: dict[str, Any] = {"momentum": momentum} if name == "async_msgd" else {}
    path = train_run(config({"name": name, "lr": lr, **options}), OUT / f"one_{RANK}", alone)
    reference = train_run(config({"name": "sgd", "lr": lr, "momentum": momentum}),
                          OUT / f"one_sgd_{RANK}", alone)
    assert_same_run(path, reference, f"{name} (momentum {momentum}) 1x1")
    grid = pair_grid()
    name, momentum = (("async_sgd", 0.0), ("async_msgd", MU))[RANK // 2 % 2]
    options = {"momentum": momentum} if name == "async_msgd" else {}
    pair = OUT / f"pair_{RANK // 2}"
    path = train_run(config({"name": name, "lr": lr, **options}, "grid", 2, 1, model="cnn"),
                     pair / name, grid)
    reference = train_run(config({"name": "sgd", "lr": lr, "momentum": momentum}, "grid", 2, 1,
                                 model="cnn"), pair / "sgd", grid)
    if grid.rank == 0:
        assert_same_run(path, reference, f"{name} grid 2x1")


@check
def one_replica_async_msgd_resumes_to_the_same_losses() -> None:
    # The server's W and V restored: 10 + 10 steps repeat 20, bit for bit (one replica): 1 × 1
    # on ranks 0 and 1 (MLP, CNN), grid 2 × 1 on ranks 2 and 3.
    pair = pair_grid()
    grid, strategy, model = ((ProcessGrid(1, 1), "data", ("mlp", "cnn")[RANK]) if RANK < 2 else
                             (pair, "grid", "cnn"))
    optimizer = {"name": "async_msgd", "lr": 0.05, "momentum": MU}
    run = OUT / f"resume_{min(RANK, 2)}"
    whole = train_run(config(optimizer, strategy, grid.pr, model=model, every=10),
                      run / "whole", grid)
    checkpoint = whole / "checkpoints" / "step-00000010"
    resumed = train_run(config(optimizer, strategy, grid.pr, model=model,
                               resume=str(checkpoint)), run / "resumed", grid)
    if grid.rank == 0:
        expected, got = train_losses(whole)[0], train_losses(resumed)[0]
        assert got == expected[10:], (got, expected[10:])


# -- four replicas: nothing pushed is lost ----------------------------------------------------

def replica_model(grid: ProcessGrid) -> Any:
    """A small float64 model: an MLP on 1 × 4 (`data`); on 2 × 2 (`grid`) a convolution
    before the first Linear, which every rank of a model group holds whole."""
    torch.manual_seed(5)
    if grid.pr == 1:
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)).double()
        return DataParallel().parallelize(model, (6,), grid, sync_replica_gradients=False)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(),
                          nn.Linear(2 * 4 * 4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return STRATEGIES.get("grid")().parallelize(model, (1, 4, 4), grid,
                                                sync_replica_gradients=False)


def push_steps(optimizer: ParameterServer, pmodel: Any, steps: int) -> torch.Tensor:
    """`steps` training steps of this replica on its own rows; returns the sum of the gradients
    this rank pushed (of the parameters it serves), laid end to end."""
    grid = optimizer.grid
    gen = torch.Generator().manual_seed(11)  # the same global batches on every rank
    shape = (6,) if grid.pr == 1 else (1, 4, 4)
    pushed = torch.zeros_like(optimizer.pulled)
    flat = torch.empty_like(pushed)
    for step in range(steps):
        x = torch.randn(16, *shape, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=gen)
        pmodel.zero_grad()
        output = pmodel(x[pmodel.input_rows(16)])
        pmodel.score(output, y[pmodel.output_rows(16)]).loss_sum.backward()
        pmodel.finish_gradient_sync()
        pushed += _flatten_into([p.grad for p in optimizer.owned], flat)
        optimizer.step(step)
    return pushed


def conserves(optimizer_cls: type[ParameterServer], grid: ProcessGrid, lr: float,
              **options: Any) -> float:
    """Run 12 steps on every replica; return the largest violation of the method's invariant
    (relative to the size of W's change)."""
    pmodel = replica_model(grid)
    optimizer = optimizer_cls(pmodel, grid, 12, lr=lr, **options)
    # W₀: the weights every replica starts from (reading the windows instead could see a
    # faster replica's first push)
    initial = _flatten_into(optimizer.owned, torch.empty_like(optimizer.pulled))
    pushed = push_steps(optimizer, pmodel, 12)
    grid.batch.allreduce_(pushed)  # G: every replica's pushes to this shard
    grid.world.barrier()  # every push is in
    moved = optimizer.centre(torch.empty_like(pushed)) - initial
    if isinstance(optimizer, AsyncMSGD):
        velocity = optimizer.server_velocity(torch.empty_like(pushed))
        expected = -(optimizer.momentum * velocity + lr * pushed) / (1 - optimizer.momentum)
    else:
        expected = -lr * pushed
    optimizer.close()
    assert moved.abs().max() > 1e-3, "the server hardly moved: nothing tested"
    return float((moved - expected).abs().max() / moved.abs().max())


class UnlockedMSGD(AsyncMSGD):
    """`async_msgd` without its lock, every replica at piece 0 first, and every replica's read
    of a piece of V made before any writes it back (a barrier between): the read-modify-writes
    of V overlap every time (the negative control of the invariant)."""

    def step(self, step: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.owned]
        _flatten_into(grads, self.pushed).mul_(-self.base_lr)
        for owner in range(self.grid.pc):
            self._serve(owner)
        self._load(self.pulled)

    def _serve(self, owner: int) -> None:
        piece = self.weights.piece(owner)
        velocity = self.velocity.read(owner, self._velocity_read[piece])
        WORLD.Barrier()
        velocity.mul_(self.momentum).add_(self.pushed[piece])
        self.velocity.write(owner, velocity)
        self.weights.add(owner, velocity)
        self.weights.read(owner, self.pulled[piece])


@check
def four_replicas_lose_no_push() -> None:
    grids = {"1x4": ProcessGrid(1, SIZE, WORLD), "2x2": ProcessGrid(2, SIZE // 2, WORLD)}
    violations = {}
    for shape, grid in grids.items():
        violations[f"async_sgd {shape}"] = conserves(AsyncSGD, grid, 0.1)
        violations[f"hogwild_sgd {shape}"] = conserves(HogwildSGD, grid, 0.1)
        violations[f"async_msgd {shape}"] = conserves(AsyncMSGD, grid, 0.05, momentum=MU)
    violations["async_msgd without its lock"] = conserves(UnlockedMSGD, grids["1x4"], 0.05,
                                                          momentum=MU)
    # the worst piece of any rank, on every rank
    worst = {name: WORLD.allreduce(value, op=MPI.MAX) for name, value in violations.items()}
    if RANK == 0:
        print(f"conservation: largest relative violation {json.dumps(worst)}", flush=True)
    unlocked = worst.pop("async_msgd without its lock")
    for name, violation in worst.items():
        assert violation < 1e-12, f"{name}: a push was lost ({violation:.3g})"
    assert unlocked > 1e-6, f"without the lock the invariant still held ({unlocked:.3g})"


# -- four replicas: checkpoints, accuracy -------------------------------------------------------

@check
def a_resumed_async_msgd_holds_the_checkpoint_s_server() -> None:
    grid = ProcessGrid(2, SIZE // 2, WORLD)
    optimizer = {"name": "async_msgd", "lr": 0.05, "momentum": MU}
    first = train_run(config(optimizer, "grid", 2, SIZE // 2, steps=8, model="cnn", every=8),
                      OUT / "server_ckpt", grid)
    checkpoint = first / "checkpoints" / "step-00000008"
    cfg = OmegaConf.create(config(optimizer, "grid", 2, SIZE // 2, steps=16, model="cnn",
                                  resume=str(checkpoint)))
    directory = RunDir(OUT / "server_resumed")
    if grid.rank == 0:
        directory.create(cfg)
    grid.world.barrier()
    training = build_training(validate(cfg, world_size=grid.size), directory, grid)
    server = training.optimizer
    assert isinstance(server, AsyncMSGD)
    params = list(training.model.parameters())
    saved = Checkpoint(checkpoint)
    by_replica = [saved.read_states(SERVER_VELOCITY, r, params) for r in range(grid.pc)]
    for other in by_replica[1:]:  # saved at a step where the replicas meet: one V
        assert all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(by_replica[0], other, strict=True))
    restored = saved.read_states("model", grid.batch_index, params, optional=False)
    for param, value in zip(params, restored, strict=True):
        assert torch.equal(param.detach(), value), "the replica's own weights not restored"
    flat = torch.empty_like(server.pulled)
    windows = {"centre": server.centre(flat.clone()),
               SERVER_VELOCITY: server.server_velocity(flat.clone())}
    for kind, replica in (("centre", None), (SERVER_VELOCITY, grid.batch_index)):
        values = saved.read_states(kind, replica, server.owned)
        assert all(value is not None for value in values), f"{kind}: a parameter is missing"
        expected = _flatten_into([v for v in values if v is not None], flat.clone())
        assert torch.equal(windows[kind], expected), f"{kind} not restored in the windows"
    assert windows[SERVER_VELOCITY].abs().max() > 0, "a velocity of zeros tests nothing"
    training.close()


@check
def each_reaches_90_percent_on_digits() -> None:
    # the defaults of conf/optimizer/*.yaml
    methods = [({"name": "async_sgd", "lr": 0.1}, 100), ({"name": "hogwild_sgd", "lr": 0.1}, 100),
               ({"name": "async_msgd", "lr": 0.02, "momentum": MU}, 300)]
    grid = ProcessGrid(1, SIZE, WORLD)
    for optimizer, steps in methods:
        run = config(optimizer, pc=SIZE, steps=steps)
        run["trainer"]["dtype"] = "float32"
        run["model"] = {"name": "mlp", "hidden": [64], "activation": "relu"}
        path = train_run(run, OUT / f"acc_{optimizer['name']}", grid)
        if RANK == 0:
            result = summary(path)
            assert result["val_accuracy"] >= 0.9, (optimizer["name"], result["val_accuracy"])
            assert 0 < result["comm_time_share"] < 1


if __name__ == "__main__":
    run_checks()
