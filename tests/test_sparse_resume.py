"""Resuming under the owners-only sharded exchange is exact (`strategy.sparse=sharded`).

Under `sharded` each rank holds only its block of each embedding table's rows (and their
optimizer state), plus the replicated hot rows, which take the steps while their owners' copies
go stale. A checkpoint must keep the true value and state of every row: the hot replicas are
written back into their owners' blocks first, the blocks are saved as row blocks of the table,
and the replicas and their choice are kept too. Real ranks at 1 x 2, float64: 20 straight steps
with a checkpoint at step 10, and that checkpoint resumed to 20; the losses must agree bit for
bit, with Adam and with SGD's momentum. Rank 0's comm bytes per step are the same in both (a
checkpoint's traffic is not a step's). The same checkpoint resumed on one process (the table
whole again) gives the straight run's losses to rounding. (Resuming in the run's own directory,
`trainer.resume=auto`, is tests/test_checkpoint.py's.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.layout import latest_checkpoint
from tests.conftest import MPIEXEC, ROOT, TIMEOUT_S, assert_ok, read_metrics, run_cli_together

STEPS, HALF = 20, 10
TOKENS = ["model=bag_classifier", "model.embedding_dim=16", "dataset=tokens",
          "dataset.vocab_size=2000", "dataset.seq_len=16", "dataset.samples=1024",
          "strategy=data", "grid.pr=1", "grid.pc=2", "strategy.sparse=sharded",
          "trainer.dtype=float64", "trainer.batch_size=32", "trainer.eval_every=null", "seed=3"]
OPTIMIZERS = {"adam": ["optimizer=adam", "optimizer.lr=0.01"],
              "sgd_momentum": ["optimizer=sgd", "optimizer.lr=0.5", "optimizer.momentum=0.9"]}


def _run_all(*jobs: list[str]) -> None:
    """The independent jobs at once; each must succeed."""
    for result in run_cli_together(*[[*TOKENS, *args] for args in jobs]):
        assert_ok(result)


def _batch(metrics: dict[str, Any]) -> dict[str, Any]:
    return {table: {key: report[key] for key in ("mode", "rows", "density", "hot_rows")}
            for table, report in metrics["sparse"].items()}


def _steps(run_dir: Path) -> dict[int, dict[str, float]]:
    lines = [m for m in read_metrics(run_dir) if "split" not in m]
    steps = [m["step"] for m in lines]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {m["step"]: m for m in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per optimizer: the straight run (its step-10 checkpoint's own traffic, and the state it
    makes whole, change nothing a step does) and that checkpoint resumed on 2 ranks and on one
    process. The independent jobs run at once: the straight runs, then the resumes."""
    tmp = tmp_path_factory.mktemp("sparse_resume")
    dirs = {name: (tmp / f"{name}_straight", tmp / f"{name}_resumed") for name in OPTIMIZERS}
    _run_all(*[[*OPTIMIZERS[name], f"trainer.steps={STEPS}", f"trainer.checkpoint_every={HALF}",
                f"hydra.run.dir={straight}"] for name, (straight, _) in dirs.items()])
    halfway = {name: straight / "checkpoints" / f"step-{HALF:08d}"
               for name, (straight, _) in dirs.items()}
    assert all(latest_checkpoint(c.parent) is not None and c.is_dir() for c in halfway.values())
    _run_all(*[[*OPTIMIZERS[name], f"trainer.steps={STEPS}", f"trainer.resume={halfway[name]}",
                f"hydra.run.dir={resumed}"] for name, (_, resumed) in dirs.items()],
             *[[*OPTIMIZERS[name], f"trainer.steps={STEPS}", "grid.pc=1",
                f"trainer.resume={halfway[name]}", f"hydra.run.dir={tmp / f'{name}_one'}"]
               for name in dirs])
    return dirs


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_sharded_checkpoint_resumes_on_one_process(runs: dict[str, tuple[Path, Path]],
                                                     optimizer: str) -> None:
    straight, resumed = runs[optimizer]
    expected, got = _steps(straight), _steps(resumed.parent / f"{optimizer}_one")
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    worst = max(abs(got[s]["loss"] - expected[s]["loss"]) / abs(expected[s]["loss"])
                for s in got)
    assert worst <= 1e-12, f"{optimizer}: one process's losses differ by up to {worst:.3g}"


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_sharded_table_resumes_exactly(runs: dict[str, tuple[Path, Path]],
                                         optimizer: str) -> None:
    straight, resumed = runs[optimizer]
    expected, got = _steps(straight), _steps(resumed)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    # sharded every step, the same rows
    assert all(_batch(got[s]) == _batch(expected[s]) for s in got)
    worst = max(abs(got[s]["loss"] - expected[s]["loss"]) for s in got)
    assert worst <= 1e-12, f"{optimizer}: resumed losses differ by up to {worst:.3g}"


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_checkpoint_s_traffic_is_no_step_s(runs: dict[str, tuple[Path, Path]],
                                            optimizer: str) -> None:
    """Step 11 follows the straight run's checkpoint (the table and its state made whole) and
    the resumed run's start: the same bytes, as every other step's."""
    straight, resumed = runs[optimizer]
    expected, got = _steps(straight), _steps(resumed)
    assert [got[s]["comm_bytes"] for s in got] == [expected[s]["comm_bytes"] for s in got]


# -- the write-back itself, on real ranks (`refresh_copies`, `refresh_state_copies`) -------------

HOOK_CHECK = '''
import torch
import torch.nn.functional as F
from mpi4py import MPI

from runner.core import CommCounter, ProcessGrid
from runner.core.row_sparse import BlockRows
from runner.zoo.datasets import ZipfTokens
from runner.zoo.models import bag_classifier
from runner.optim.sync import SynchronousSGD, TorchAdam
from strategies.data import DataParallel
from strategies.exchange.sparse_gradients import UnevenState

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COUNTER = CommCounter(keep_records=True)
VOCAB, WIDTH, HOT = 503, 8, 16  # a prime number of rows: blocks of different sizes


def trained(optimizer_cls, **options):
    data = ZipfTokens(vocab_size=VOCAB, seq_len=16, samples=512).load()
    grid = ProcessGrid(1, SIZE, WORLD, counter=COUNTER)
    torch.manual_seed(0)
    model = bag_classifier((16,), 4, vocab_size=VOCAB, embedding_dim=WIDTH, hidden=(8,)).double()
    pmodel = DataParallel(sparse="sharded", sparse_hot_rows=HOT).parallelize(model, (16,), grid)
    optimizer = optimizer_cls(pmodel, grid, 6, **options)
    for step in range(6):
        rows = slice(step * 16 * SIZE + RANK * 16, step * 16 * SIZE + (RANK + 1) * 16)
        pmodel.zero_grad()
        F.cross_entropy(pmodel(data.train_x[rows]), data.train_y[rows]).backward()
        pmodel.finish_gradient_sync()
        optimizer.step(step)
    return pmodel, optimizer


for optimizer_cls, options in ((SynchronousSGD, {"lr": 0.5, "momentum": 0.9}),
                               (TorchAdam, {"lr": 0.01})):
    pmodel, optimizer = trained(optimizer_cls, **options)
    module = pmodel.module[0]
    block = BlockRows(VOCAB, SIZE).block(RANK)
    assert module.weight.shape == (block.stop - block.start, WIDTH), module.weight.shape
    hot_ids = module.hot_ids[module.hot_ids >= 0]
    assert 0 < len(hot_ids) <= HOT, module.hot_ids
    params = list(pmodel.parameters())
    ids = [id(p) for p in params]
    table, hot = ids.index(id(module.weight)), ids.index(id(module.hot_weight))
    states = optimizer.param_states()
    kinds = [k for k in states if k not in optimizer.scalar_kinds()]
    assert kinds and all(states[k][table].shape == module.weight.shape for k in kinds), \
        "the optimizer's state of the table holds the owned rows only"
    mine = (hot_ids >= block.start) & (hot_ids < block.stop)
    local, slots = hot_ids[mine] - block.start, torch.nonzero(mine).flatten()
    stale = [not torch.equal(states[k][table][local], states[k][hot][slots]) for k in kinds]
    assert any(WORLD.allgather(any(stale))), "nothing was stale: a weak check"
    others = {k: [t.clone() for i, t in enumerate(states[k]) if i not in (table, hot)]
              for k in kinds}
    before = len(COUNTER.records)
    pmodel.refresh_copies()
    pmodel.refresh_state_copies(states)  # the scalars (Adam's step) are left alone
    assert len(COUNTER.records) == before, "the write-back is local"
    assert torch.equal(module.weight[local], module.hot_weight[slots])
    for k in kinds:  # the owners' rows take the replicas' state; nothing else changes
        assert torch.equal(states[k][table][local], states[k][hot][slots]), k
        assert all(torch.equal(a, b) for a, b in zip(
            [t for i, t in enumerate(states[k]) if i not in (table, hot)], others[k]))
    # the replicas' state without the owned rows' (or the other way round): refused
    uneven = {k: [None if i == table else t for i, t in enumerate(states[k])] for k in kinds}
    try:
        pmodel.refresh_state_copies(uneven)
        raise AssertionError("uneven state was not refused")
    except UnevenState as exc:
        assert "hot rows" in str(exc), exc
    WORLD.Barrier()
if RANK == 0:
    print("hook ok", flush=True)
'''


def test_the_hot_rows_are_written_back_into_their_owners(tmp_path: Path) -> None:
    """Each rank's table parameter and its momentum or Adam's moments hold its block of rows
    only; the hot replicas' weights and state are written back into their owners' rows, in
    place, without moving a byte; the other parameters' state is untouched; state held for the
    replicas but not for the owned rows is refused. Three ranks: blocks of different sizes."""
    script = tmp_path / "hook_check.py"
    script.write_text(HOOK_CHECK)
    result = subprocess.run([MPIEXEC, "-n", "3", sys.executable, str(script)], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0 and "hook ok" in result.stdout, (
        f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}")
