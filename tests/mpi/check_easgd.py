"""The elastic averaging family on real ranks, in one launch: `mpiexec -n 4 python THIS TMPDIR`.

- the one-sided vector: pieces read and added without their owner's help (an owner outside MPI
  until the others are done), the ticket lock excludes, the turn counter orders;
- `sync_easgd` against a two-step example worked by hand, and `easgd` against the same example
  served in rank order; with Nesterov momentum against EAMSGD (Algorithm 2) written out; ρ = 0
  is independent SGD per replica (plain, heavy-ball and Nesterov momentum as torch's);
- with a period τ, the steps without an exchange make no collective across replicas;
- `sync_easgd` is deterministic and the same mathematics under `grid` 2×2 and `domain` 2×2 (a
  replica is a model group, the centre sharded like the weights) as under `data` 1×2;
- every method reaches 0.9 validation accuracy on digits;
- with rank 3 held before its step 2, the other workers finish their steps under every
  asynchronous method (`async_easgd`, `hogwild_easgd`, `async_sgd`, `async_msgd`,
  `hogwild_sgd`), while under `sync_easgd` none begins a step before a straggling rank 3 has
  begun the one before.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's `tests`

import check_async_sgd  # noqa: F401
import torch
import torch.nn.functional as F
from harness import check, run_checks, train_losses, train_run
from mpi4py import MPI
from torch import nn

from runner.core import ProcessGrid
from runner.core.rma import OneSidedVector
from runner.optim.easgd import RoundRobinEASGD, SyncEASGD
from strategies.data import DataParallel
from tests.gates import read_ahead

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/check_easgd")


def sub_grid(pr: int, pc: int) -> ProcessGrid | None:
    sub = WORLD.Split(0 if RANK < pr * pc else MPI.UNDEFINED, RANK)
    return None if sub == MPI.COMM_NULL else ProcessGrid(pr, pc, sub)


OWNER_WAIT_S = 60.0  # a safety net: the others' exchanges take well under a second


@check
def one_sided_pieces_need_no_help_from_their_owner() -> None:
    grid = ProcessGrid(1, SIZE, WORLD)
    done = OUT / "owner_away"  # a file per other rank once its exchanges are made
    if RANK == 0:
        shutil.rmtree(done, ignore_errors=True)
        done.mkdir(parents=True)
    shared = OneSidedVector(grid.batch, torch.arange(10, dtype=torch.float64), label="t")
    WORLD.Barrier()
    if RANK == SIZE - 1:
        # Not in MPI until every other rank has made its 20 exchanges with this rank's piece:
        # had they needed its help, they could not finish.
        deadline = time.monotonic() + OWNER_WAIT_S
        while len(list(done.iterdir())) < SIZE - 1:
            assert time.monotonic() < deadline, (
                f"the others' exchanges with a piece whose owner is away did not finish within "
                f"{OWNER_WAIT_S:.0f} s")
            time.sleep(0.01)
    else:
        for _ in range(20):
            shared.acquire(SIZE - 1)
            piece = shared.read(SIZE - 1, torch.empty(len(range(10)[shared.piece(SIZE - 1)]),
                                                      dtype=torch.float64))
            shared.add(SIZE - 1, torch.ones_like(piece))
            shared.release(SIZE - 1)
        (done / str(RANK)).touch()
    WORLD.Barrier()
    whole = shared.read_all(torch.empty(10, dtype=torch.float64))
    expected = torch.arange(10, dtype=torch.float64)
    expected[shared.piece(SIZE - 1)] += 20 * (SIZE - 1)
    assert torch.equal(whole, expected), f"{whole} != {expected}"
    shared.close()


@check
def ticket_lock_excludes_and_turns_go_in_rank_order() -> None:
    grid = ProcessGrid(1, SIZE, WORLD)
    shared = OneSidedVector(grid.batch, torch.zeros(2 * SIZE, dtype=torch.float64))
    marker = torch.empty(2, dtype=torch.float64)
    mine = torch.tensor([float(RANK + 1), 0.0], dtype=torch.float64)
    for _ in range(15):  # everybody hammers piece 0; inside the lock nobody else may be there
        shared.acquire(0)
        assert shared.read(0, marker)[0] == 0, "two ranks inside the lock at once"
        shared.add(0, mine)
        time.sleep(1e-4)
        assert shared.read(0, marker)[0] == RANK + 1, "another rank entered the lock"
        shared.add(0, -mine)
        shared.release(0)
    one = torch.tensor([0.0, 1.0], dtype=torch.float64)
    for round_ in range(3):
        shared.wait_turn(round_ * SIZE + RANK)
        count = shared.read(0, marker)[1].item()
        assert count == round_ * SIZE + RANK, f"turn {round_ * SIZE + RANK} saw count {count}"
        shared.add(0, one)
        shared.next_turn()
    shared.close()


def scalar_workers(optimizer_cls: type, alpha: float,
                   **options: object) -> tuple[list[float], float]:
    """Two steps of a 1-weight model per worker, worker i's loss a_i·w²/2 (a_i = i + 1), from
    w = 1; lr 0.5. Returns the weights after each step and the centre."""
    grid = ProcessGrid(1, SIZE, WORLD)
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    pmodel = DataParallel().parallelize(model, (1,), grid, sync_replica_gradients=False)
    optimizer = optimizer_cls(pmodel, grid, 2, lr=0.5, moving_rate=alpha, **options)
    weights = []
    for step in range(2):
        weight = pmodel.module.weight
        weight.grad = (RANK + 1) * weight.detach().clone()
        optimizer.step(step)
        weights.append(weight.item())
    WORLD.Barrier()  # every worker's exchange is in
    centre = optimizer.centre(torch.empty(1, dtype=torch.float64)).item()
    optimizer.close()
    return weights, centre


@check
def sync_easgd_matches_the_hand_computed_example() -> None:
    # By hand, 4 workers, lr 0.5, α = 1/8, W̄ = 1 and Wᵢ = 1 at the start:
    # step 1: all differences 0, so W̄ = 1 and Wᵢ = 1 − 0.5·aᵢ = (0.5, 0, −0.5, −1).
    # step 2: gradients aᵢWᵢ = (0.5, 0, −1.5, −4); dᵢ = (Wᵢ − 1)/8 = −(1, 2, 3, 4)/16;
    #         W̄ = 1 + Σdᵢ = 1 − 10/16 = 0.375;
    #         Wᵢ = Wᵢ − 0.5·∇ᵢ − dᵢ = (0.3125, 0.125, 0.4375, 1.25).
    assert SIZE == 4
    weights, centre = scalar_workers(SyncEASGD, 0.125)
    assert weights == [(0.5, 0.0, -0.5, -1.0)[RANK], (0.3125, 0.125, 0.4375, 1.25)[RANK]], weights
    assert centre == 0.375, centre


@check
def round_robin_easgd_serves_workers_in_rank_order() -> None:
    # Step 2 as above, but worker i reads the centre after workers 0..i-1 have moved it.
    weights, centre = scalar_workers(RoundRobinEASGD, 0.125)
    expected_centre, expected = 1.0, []
    for worker, w in enumerate((0.5, 0.0, -0.5, -1.0)):
        d = 0.125 * (w - expected_centre)
        expected_centre += d
        expected.append(w - 0.5 * (worker + 1) * w - d)
    assert weights[1] == expected[RANK], (weights, expected)
    assert centre == expected_centre, (centre, expected_centre)


@check
def nesterov_momentum_easgd_is_eamsgd_algorithm_2() -> None:
    # Zhang, Choromanska & LeCun's EAMSGD, written out here as the paper states it: the gradient
    # at the look-ahead x + μv, v ← μv − η∇(x + μv), x ← x + v; and at the start of every τ-th
    # (here every) iteration x ← x − α(x − x̃), x̃ ← x̃ + Σ α(x − x̃) over the workers, which is
    # where our step ends. The model holds the look-ahead point.
    lr, mu, alpha = 0.5, 0.5, 0.125
    weights, centre = scalar_workers(SyncEASGD, alpha, momentum=mu, nesterov=True)
    xs, vs, c = [1.0] * SIZE, [0.0] * SIZE, 1.0
    lookahead = []
    for _ in range(2):
        for i in range(SIZE):
            gradient = (i + 1) * (xs[i] + mu * vs[i])
            vs[i] = mu * vs[i] - lr * gradient
            xs[i] += vs[i]
        moves = [alpha * (x - c) for x in xs]
        c += sum(moves)
        xs = [x - m for x, m in zip(xs, moves, strict=True)]
        lookahead.append(xs[RANK] + mu * vs[RANK])
    assert all(abs(a - b) < 1e-12 for a, b in zip(weights, lookahead, strict=True)), \
        (weights, lookahead)
    assert abs(centre - c) < 1e-12, (centre, c)


@check
def zero_elastic_force_is_independent_sgd_per_replica() -> None:
    for options, torch_options in (({}, {}), ({"momentum": 0.9}, {"momentum": 0.9}),
                                   ({"momentum": 0.9, "nesterov": True},
                                    {"momentum": 0.9, "nesterov": True})):
        independent_replicas(options, torch_options)


def independent_replicas(options: dict, torch_options: dict) -> None:
    """ρ = 0: each replica is plain SGD (heavy-ball and Nesterov momentum as torch's)."""
    grid = ProcessGrid(1, SIZE, WORLD)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    reference = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    reference.load_state_dict(model.state_dict())
    pmodel = DataParallel().parallelize(model, (6,), grid, sync_replica_gradients=False)
    optimizer = SyncEASGD(pmodel, grid, 10, lr=0.1, rho=0.0, **options)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, **torch_options)
    gen = torch.Generator().manual_seed(RANK)  # each replica its own data
    for step in range(10):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        pmodel.zero_grad()
        F.cross_entropy(pmodel(x), y).backward()
        optimizer.step(step)
        plain.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        plain.step()
    for got, want in zip(pmodel.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    ranks = WORLD.allgather(pmodel.module[0].weight.sum().item())
    assert len(set(ranks)) == SIZE, "replicas with different data must differ"
    optimizer.close()


def config(optimizer: dict, strategy: str = "data", pr: int = 1, pc: int = SIZE,
           steps: int = 300, model: str = "mlp", dtype: str = "float32",
           debug: dict | None = None, eval_every: int | None = None) -> dict:
    model_cfg = ({"name": "mlp", "hidden": [64], "activation": "relu"} if model == "mlp" else
                 {"name": "cnn", "channels": [4, 6], "kernel_size": 3, "hidden": [24],
                  "activation": "relu"})
    return {
        "seed": 0, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": steps, "batch_size": 32, "log_every": 1, "eval_every": eval_every,
                    "checkpoint_every": None, "resume": None, "threads": 1, "dtype": dtype},
        "model": model_cfg,
        "dataset": {"name": "digits", "val_fraction": 0.2},
        "strategy": {"name": strategy},
        "optimizer": optimizer,
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None, **(debug or {})},
    }


def summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


@check
def sync_easgd_is_deterministic_and_the_same_under_every_strategy() -> None:
    sync = {"name": "sync_easgd", "lr": 0.1, "rho": 2.0, "period": 2}
    runs = {}
    for name, strategy, pr, pc in (("data_a", "data", 1, 2), ("data_b", "data", 1, 2),
                                   ("grid", "grid", 2, 2), ("domain", "domain", 2, 2)):
        grid = sub_grid(pr, pc)
        if grid is not None:
            path = train_run(config(sync, strategy, pr, pc, steps=20, model="cnn",
                                    dtype="float64"), OUT / f"sync_{name}", grid)
            runs[name] = train_losses(path)[0] if grid.rank == 0 else None
    if RANK == 0:
        assert runs["data_a"] == runs["data_b"], "the same run twice gave other losses"
        for name in ("grid", "domain"):
            gap = max(abs(a - b) / abs(b) for a, b in zip(runs[name], runs["data_a"],
                                                          strict=True))
            assert gap < 1e-9, f"sync_easgd under {name} 2x2 differs from data 1x2 by {gap}"


@check
def with_a_period_steps_without_an_exchange_meet_no_other_replica() -> None:
    # sync_easgd, τ = 3, grid 2 × 2: on the steps between exchanges the loss is reduced over
    # the replica (model group) alone and the batch groups (across replicas) carry nothing.
    grid = ProcessGrid(2, SIZE // 2, WORLD)
    grid.counter.keep_records = True
    grid.counter.records.clear()
    steps, period = 9, 3
    path = train_run(config({"name": "sync_easgd", "lr": 0.1, "period": period}, "grid", 2,
                            SIZE // 2, steps=steps), OUT / "period", grid)
    records = grid.counter.records
    grid.counter.keep_records = False
    loss_groups = [r.group for r in records if r.label == "loss"]
    exchanges = steps // period
    assert loss_groups.count("world") == exchanges, loss_groups
    assert loss_groups.count("model") == steps - exchanges, loss_groups
    across = {(r.label, r.op) for r in records if r.group == "batch"}
    assert across <= {("elastic", "allreduce"), ("eval", "allreduce")}, across
    assert sum(r.label == "elastic" and r.group == "batch" for r in records) == exchanges
    if RANK == 0:
        lines = train_losses(path)[1]
        flags = [bool(line.get("replica_loss")) for line in lines]
        assert flags == [(i + 1) % period != 0 for i in range(steps)], flags
        assert summary(path)["logged_loss"].startswith("global batch on exchange steps")


@check
def every_method_reaches_90_percent_on_digits() -> None:
    methods = [{"name": "sync_easgd", "lr": 0.2}, {"name": "easgd", "lr": 0.2},
               {"name": "async_easgd", "lr": 0.2}, {"name": "hogwild_easgd", "lr": 0.2},
               {"name": "async_measgd", "lr": 0.05, "momentum": 0.9}]
    grid = ProcessGrid(1, SIZE, WORLD)
    for optimizer in methods:
        path = train_run(config(optimizer), OUT / f"acc_{optimizer['name']}", grid)
        if RANK == 0:
            result = summary(path)
            assert result["val_accuracy"] >= 0.9, (optimizer["name"], result["val_accuracy"])
            assert 0 < result["comm_time_share"] < 1
    # a replica may be a whole model group, under an asynchronous method too
    grid = ProcessGrid(2, SIZE // 2, WORLD)
    path = train_run(config({"name": "async_easgd", "lr": 0.2}, "grid", 2, SIZE // 2),
                     OUT / "acc_async_grid", grid)
    if RANK == 0:
        assert summary(path)["val_accuracy"] >= 0.9, summary(path)["val_accuracy"]


ASYNCHRONOUS = ("async_easgd", "hogwild_easgd", "async_sgd", "async_msgd", "hogwild_sgd")


@check
def asynchronous_methods_do_not_wait_for_a_straggler() -> None:
    # Rank 3 is held before its step 2 until every other rank has begun its last step, which
    # they can only if they never wait for it (each notes the step it begins: tests.gates);
    # under sync_easgd it sleeps 40 ms in every step instead, and no other rank ever begins a
    # step before it has begun the one before (they meet in every step).
    grid = ProcessGrid(1, SIZE, WORLD)
    steps, straggler = 20, SIZE - 1
    furthest = {}
    for name in (*ASYNCHRONOUS, "sync_easgd"):  # each optimizer's default lr
        progress = OUT / f"straggler_{name}_progress"
        if RANK == 0:
            shutil.rmtree(progress, ignore_errors=True)
        WORLD.Barrier()
        run = config({"name": name}, steps=steps,
                     debug={"slow_rank": straggler, "slow_seconds": 0.04}
                     if name == "sync_easgd" else None)
        run["model"] = {"_target_": "tests.gates.paced_mlp", "progress": str(progress),
                        "straggler": straggler, "hold_until": 0 if name == "sync_easgd" else steps,
                        "hidden": [64], "activation": "relu"}
        train_run(run, OUT / f"straggler_{name}", grid)
        if RANK == 0:
            furthest[name] = read_ahead(progress)
    if RANK == 0:
        # the furthest step another rank had begun as the straggler began its step 2; the most
        # steps another was ahead of it under sync_easgd
        at_two = {name: dict(furthest[name]).get(2) for name in ASYNCHRONOUS}
        lead = max(other - mine for mine, other in furthest["sync_easgd"])
        print(f"straggler: the others' step at its step 2 {json.dumps(at_two)}; under "
              f"sync_easgd at most {lead} ahead", flush=True)
        for name in ASYNCHRONOUS:
            assert at_two[name] == steps, f"{name}: {furthest[name]}"
        assert len(furthest["sync_easgd"]) == steps and lead <= 0, (
            f"sync_easgd did not wait for the straggler: {furthest['sync_easgd']}")


if __name__ == "__main__":
    run_checks()
