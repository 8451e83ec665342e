"""A small GPT trained end to end by every strategy, on 4 ranks, against one process (and, in
the same launch, the checks of `check_tensor_parallel.py` and `check_sequence.py`).

- each strategy (data, data with the token table exchanged sparsely, model with the gather
  layout, grid with the Megatron pairing, domain splitting the sequence with either key/value
  exchange) reproduces the single-process losses of 20 AdamW steps in float64 to 1e-5, with
  measured bytes == predicted bytes on every step, and reports a validation perplexity;
- a checkpoint written by `grid` 2×2 at step 10 resumes under `model` 4×1 and under one
  process, and both finish with the uninterrupted run's losses;
- under `grid` 2×2 (the head split by vocabulary over two ranks) a step reads no device value
  unless it reads its loss, on every rank (tests/test_host_syncs.py's count).
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's `tests`

# The split layers' own checks run in this launch too: one start-up of 4 ranks, not three.
import check_sequence  # noqa: F401
import check_tensor_parallel  # noqa: F401
import pytest
from harness import check, make_grids, one_process_losses, run_checks, train_losses, train_run
from mpi4py import MPI

from tests.test_host_syncs import BASE, assert_as_the_readme_states, train_counting

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/check_gpt")

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
GRID_OF = make_grids([(1, 1), (1, 4), (4, 1), (2, 2)])

STEPS = 20
GPT = {"name": "gpt", "width": 32, "layers": 2, "heads": 4, "mlp_ratio": 2, "bias": True,
       "tie_weights": True, "sparse_embedding": False, "context": None}
TOKENS = {"name": "tokens", "vocab_size": 48, "seq_len": 10, "classes": 4, "samples": 400,
          "val_fraction": 0.2, "seed": 0}


def run_config(strategy: dict, pr: int, pc: int, model: dict | None = None,
               resume: str | None = None, checkpoint_every: int | None = None) -> dict:
    return {
        "seed": 3, "grid": {"pr": pr, "pc": pc},
        "trainer": {"steps": STEPS, "batch_size": 8, "log_every": 1, "eval_every": STEPS,
                    "checkpoint_every": checkpoint_every, "resume": resume, "threads": None,
                    "dtype": "float64"},
        "model": model or GPT, "dataset": TOKENS, "strategy": strategy,
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.01},
        "launcher": {"command": None, "args": []},
        "debug": {"fail_at_step": None},
    }


UNTIED_SPARSE = {**GPT, "tie_weights": False, "sparse_embedding": True}
RUNS = [
    # name, strategy, pr, pc, model, bytes checked (a sparse exchange's rows depend on the data)
    ("data", {"name": "data"}, 1, 4, GPT, True),
    ("data_sparse", {"name": "data", "sparse": "allgather"}, 1, 4, UNTIED_SPARSE, False),
    ("model_gather", {"name": "model", "tp_layout": "gather"}, 4, 1, GPT, True),
    ("grid_pairing", {"name": "grid", "tp_layout": "pairing"}, 2, 2, GPT, True),
    ("grid_untied", {"name": "grid", "tp_layout": "pairing"}, 2, 2,
     {**GPT, "tie_weights": False}, True),
    ("domain_ring", {"name": "domain", "kv_exchange": "ring"}, 4, 1, GPT, True),
    ("domain_allgather", {"name": "domain", "kv_exchange": "allgather"}, 2, 2, GPT, True),
]


@functools.cache
def references() -> dict[str, list[float]]:
    """One process's losses for each model of `RUNS`, by `json.dumps(model, sort_keys=True)`."""
    models = {json.dumps(model, sort_keys=True): model for _, _, _, _, model, _ in RUNS}
    return one_process_losses({key: (run_config({"name": "data"}, 1, 1, model),
                                     OUT / f"reference_{index}")
                               for index, (key, model) in enumerate(models.items())})


def assert_same(name: str, want: list[float], got: list[float]) -> None:
    assert len(got) == len(want), (name, len(got), len(want))
    gap = max(abs(a - b) / abs(a) for a, b in zip(want, got, strict=True))
    assert gap <= 1e-5, f"{name}: relative gap {gap} ({want[-1]} against {got[-1]})"


@check
def every_strategy_reproduces_the_single_process_losses() -> None:
    wanted = references()
    for name, strategy, pr, pc, model, bytes_checked in RUNS:
        grid = GRID_OF[pr, pc]
        path = train_run(run_config(strategy, pr, pc, model), OUT / name, grid)
        if grid.rank != 0:
            continue
        got, lines = train_losses(path)
        assert_same(name, wanted[json.dumps(model, sort_keys=True)], got)
        summary = json.loads((path / "summary.json").read_text())
        assert summary["val_perplexity"] == math.exp(summary["val_loss"]), summary
        assert summary["tokens_per_s"] > 0, summary
        if bytes_checked:
            predicted = summary["predicted_comm_bytes_per_step"]
            assert all(m["comm_bytes"] == predicted for m in lines), (
                f"{name}: measured {[m['comm_bytes'] for m in lines[:3]]} predicted {predicted}")


@check
def a_checkpoint_resumes_on_other_grids() -> None:
    want = references()[json.dumps(GPT, sort_keys=True)]
    grid = GRID_OF[2, 2]
    first = train_run(run_config({"name": "grid", "tp_layout": "pairing"}, 2, 2,
                                 checkpoint_every=10), OUT / "written", grid)
    checkpoint = str(first / "checkpoints" / "step-00000010")
    for name, strategy, pr, pc in (("resumed_model", {"name": "model"}, 4, 1),
                                   ("resumed_one", {"name": "data"}, 1, 1),
                                   ("resumed_domain", {"name": "domain"}, 2, 2)):
        grid = GRID_OF[pr, pc]
        if grid is None:
            continue
        path = train_run(run_config(strategy, pr, pc, resume=checkpoint), OUT / name, grid)
        if grid.rank == 0:
            got, lines = train_losses(path)
            assert lines[0]["step"] == 11, lines[0]
            assert_same(name, want[10:], got)


@check
def a_step_reads_the_device_only_where_the_readme_says() -> None:
    config = {**BASE, "model": GPT, "dataset": TOKENS, "grid": {"pr": 2, "pc": 2},
              "strategy": {"name": "grid", "tp_layout": "pairing"}}
    grid = GRID_OF[2, 2]
    assert grid is not None
    with pytest.MonkeyPatch.context() as patch:
        reads, _ = train_counting(config, OUT / "host_reads", patch, grid)
    assert_as_the_readme_states(reads, config, f"gpt grid 2x2, rank {RANK}")


if __name__ == "__main__":
    run_checks()
