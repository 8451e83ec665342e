"""Resuming under the sharded sparse exchange is exact (`strategy.sparse=sharded`).

Under `sharded` each row of an embedding table has one owner, which alone updates it with the
true gradient; the other ranks' copies of the row, and of its optimizer state (momentum, Adam's
moments), are caches. A checkpoint must keep the owners' state for every row, not one rank's
copy of the whole table. Real ranks at 1 x 2, float64: 20 straight steps against 10 steps,
a checkpoint and a resume to 20 in the same run directory; the losses must agree bit for bit,
with Adam and with SGD's momentum. Rank 0's comm bytes per step are the same in both (a
checkpoint's traffic is not a step's).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.checkpoint import latest_checkpoint
from tests.conftest import MPIEXEC, ROOT, TIMEOUT_S, assert_ok, read_metrics

STEPS, HALF = 20, 10
TOKENS = ["model=bag_classifier", "model.embedding_dim=16", "dataset=tokens",
          "dataset.vocab_size=2000", "dataset.seq_len=16", "dataset.samples=1024",
          "strategy=data", "grid.pr=1", "grid.pc=2", "strategy.sparse=sharded",
          "trainer.dtype=float64", "trainer.batch_size=32", "trainer.eval_every=null", "seed=3"]
OPTIMIZERS = {"adam": ["optimizer=adam", "optimizer.lr=0.01"],
              "sgd_momentum": ["optimizer=sgd", "optimizer.lr=0.5", "optimizer.momentum=0.9"]}


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runner", *TOKENS, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_all(processes: list[subprocess.Popen[str]]) -> None:
    """Wait for every job; the first that failed is the error (the others are stopped)."""
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
            assert_ok(subprocess.CompletedProcess(process.args, process.returncode, stdout,
                                                  stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()  # the head forwards it to its ranks
                process.communicate()


def _steps(run_dir: Path) -> dict[int, dict[str, float]]:
    lines = [m for m in read_metrics(run_dir) if "split" not in m]
    steps = [m["step"] for m in lines]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {m["step"]: m for m in lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per optimizer: the straight run (its step-10 checkpoint is the halves' first: its own
    traffic, and the state it makes whole, change nothing a step does) and the halves. The
    independent jobs run at once: the straight runs with the first halves, then the resumes."""
    tmp = tmp_path_factory.mktemp("sparse_resume")
    dirs = {name: (tmp / f"{name}_straight", tmp / f"{name}_halves") for name in OPTIMIZERS}
    _finish_all([_start(*OPTIMIZERS[name], f"trainer.steps={steps}",
                        f"trainer.checkpoint_every={HALF}", f"hydra.run.dir={run_dir}")
                 for name, (straight, halves) in dirs.items()
                 for run_dir, steps in ((straight, STEPS), (halves, HALF))])
    for _, halves in dirs.values():
        checkpoint = latest_checkpoint(halves / "checkpoints")
        assert checkpoint is not None and checkpoint.name == f"step-{HALF:08d}"
    _finish_all([_start(*OPTIMIZERS[name], f"trainer.steps={STEPS}", "trainer.resume=auto",
                        f"hydra.run.dir={halves}") for name, (_, halves) in dirs.items()])
    return dirs


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_sharded_table_resumes_exactly(runs: dict[str, tuple[Path, Path]],
                                         optimizer: str) -> None:
    straight, halves = runs[optimizer]
    expected, got = _steps(straight), _steps(halves)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    assert all(got[s]["loss"] == expected[s]["loss"] for s in range(1, HALF + 1))
    assert all(got[s]["sparse"] == expected[s]["sparse"] for s in got)  # sharded every step
    worst = max(abs(got[s]["loss"] - expected[s]["loss"]) for s in range(HALF + 1, STEPS + 1))
    assert worst <= 1e-12, f"{optimizer}: resumed losses differ by up to {worst:.3g}"


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_checkpoint_s_traffic_is_no_step_s(runs: dict[str, tuple[Path, Path]],
                                            optimizer: str) -> None:
    """Step 11 follows the straight run's checkpoint (the table and its state made whole) and
    the resumed run's start: the same bytes, as every other step's."""
    straight, halves = runs[optimizer]
    expected, got = _steps(straight), _steps(halves)
    assert [got[s]["comm_bytes"] for s in got] == [expected[s]["comm_bytes"] for s in got]


# -- the hook itself, on real ranks (`ParallelModel.refresh_state_copies`) ----------------------

HOOK_CHECK = '''
import torch
import torch.nn.functional as F
from mpi4py import MPI

from runner.core import CommCounter, CountedComm, ProcessGrid
from runner.core.sparse import CyclicRows
from runner.datasets import ZipfTokens
from runner.models import bag_classifier
from runner.optim import SynchronousSGD, TorchAdam
from strategies.data import DataParallel
from strategies.sparse_exchange import UnevenState

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COUNTER = CommCounter(keep_records=True)
VOCAB, WIDTH = 503, 8  # a prime number of rows: owners with different row counts


def trained(optimizer_cls, **options):
    data = ZipfTokens(vocab_size=VOCAB, seq_len=16, samples=512).load()
    grid = ProcessGrid(1, SIZE, WORLD, counter=COUNTER)
    torch.manual_seed(0)
    model = bag_classifier((16,), 4, vocab_size=VOCAB, embedding_dim=WIDTH, hidden=(8,)).double()
    pmodel = DataParallel(sparse="sharded").parallelize(model, (16,), grid)
    optimizer = optimizer_cls(pmodel, grid, 6, **options)
    for step in range(6):
        rows = slice(step * 16 * SIZE + RANK * 16, step * 16 * SIZE + (RANK + 1) * 16)
        pmodel.zero_grad()
        F.cross_entropy(pmodel(data.train_x[rows]), data.train_y[rows]).backward()
        pmodel.finish_gradient_sync()
        optimizer.step(step)
    return pmodel, optimizer


def owners_truth(tensor):
    """Every owner's own rows of `tensor` (its copy), put together (by plain MPI)."""
    rows = CyclicRows(VOCAB, SIZE)
    truth = torch.empty_like(tensor)
    for owner in range(SIZE):
        piece = tensor[rows.owned(owner)].contiguous() if owner == RANK else None
        truth[rows.owned(owner)] = WORLD.bcast(piece, root=owner)
    return truth


for optimizer_cls, options in ((SynchronousSGD, {"lr": 0.5, "momentum": 0.9}),
                               (TorchAdam, {"lr": 0.01})):
    pmodel, optimizer = trained(optimizer_cls, **options)
    table = pmodel.module[0].weight
    index = [p is table for p in pmodel.parameters()].index(True)
    states = optimizer.param_states()
    kinds = [k for k in states if k not in optimizer.scalar_kinds()]
    assert kinds and all(states[k][index] is not None for k in kinds), "state on every rank"
    truth = {k: owners_truth(states[k][index]) for k in kinds}
    others = {k: [t.clone() for i, t in enumerate(states[k]) if i != index] for k in kinds}
    stale = [not torch.equal(states[k][index], truth[k]) for k in kinds]
    assert SIZE == 1 or any(WORLD.allgather(any(stale))), "nothing was stale: a weak check"
    before = len(COUNTER.records)
    pmodel.refresh_state_copies(states)  # the scalars (Adam's step) are left alone
    for k in kinds:  # filled in place, from the owners; the other parameters' state untouched
        assert torch.equal(optimizer.param_states()[k][index], truth[k]), k
        assert all(torch.equal(a, b) for a, b in zip(
            [t for i, t in enumerate(optimizer.param_states()[k]) if i != index], others[k]))
    moved = COUNTER.records[before:]
    assert [r.label for r in moved] == ["state refresh flags"] + ["0 state refresh"] * len(kinds)
    assert sum(r.nbytes for r in moved[1:]) == len(kinds) * table.numel() * 8
    before = len(COUNTER.records)
    pmodel.refresh_state_copies(states)  # nothing stale any more: nothing moves
    assert len(COUNTER.records) == before
    # a state some ranks lack: refused on every rank alike, and the ranks stay in step
    pmodel.module[0].weight.grad = None
    x = torch.zeros(16, 16, dtype=torch.long)
    pmodel.zero_grad()
    F.cross_entropy(pmodel(x), torch.zeros(16, dtype=torch.long)).backward()
    pmodel.finish_gradient_sync()  # a sharded step: the state is stale again
    uneven = {k: [None if (i == index and RANK == SIZE - 1) else t
                  for i, t in enumerate(states[k])] for k in kinds}
    try:
        pmodel.refresh_state_copies(uneven)
        raise AssertionError("uneven state was not refused")
    except UnevenState as exc:
        assert f"held by {SIZE - 1} of {SIZE} ranks" in str(exc), exc
    # none holds it: nothing but the flags moves
    before = len(COUNTER.records)
    pmodel.refresh_state_copies({k: [None] * len(states[k]) for k in kinds})
    assert [r.label for r in COUNTER.records[before:]] == ["state refresh flags"]
    WORLD.Barrier()
if RANK == 0:
    print("hook ok", flush=True)
'''


def test_the_hook_fills_every_copy_from_the_owners(tmp_path: Path) -> None:
    """Momentum and Adam's moments of the table made the owners' on every rank, in place, the
    other parameters' state untouched, the bytes counted under their own labels; nothing moves
    once whole; a state that some ranks lack is refused on all of them (no rank left waiting).
    Three ranks: owners of different numbers of rows."""
    script = tmp_path / "hook_check.py"
    script.write_text(HOOK_CHECK)
    result = subprocess.run([MPIEXEC, "-n", "3", sys.executable, str(script)], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0 and "hook ok" in result.stdout, (
        f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-4000:]}")
