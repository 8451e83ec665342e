"""The conformance corpus (`tests/corpus_models.py`) under every strategy, against one process,
in one launch: `mpiexec -n 4 python THIS TMPDIR`, or in check_plans.py's, which imports it.

For every corpus model (and the transformers library's GPT-2 and BERT where it is installed)
and every (strategy, grid) of `CASES`, the head's validation either refuses the run (each
refusal is one line naming the module: tests/test_corpus.py checks their wording) or the run on
real ranks gives one process's training losses (float64, 1e-9 relative) and moves every step
exactly the bytes predicted for it. Random draws (dropout, stochastic depth, attention dropout)
and BatchNorm subclasses are part of it: under `data` they are one process's.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests` is this checkout's, whatever else is installed

from harness import (  # noqa: E402
    assert_one_process,
    check,
    make_grids,
    one_process_losses,
    run_checks,
    train_run,
    wait_politely,
)
from mpi4py import MPI  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from runner.cli.validation import validate  # noqa: E402
from runner.config.schema import ConfigError  # noqa: E402
from tests import corpus_models as corpus  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
OUT = (Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")) / "check_corpus"
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
MODELS = (*corpus.IMAGE_MODELS, *corpus.TOKEN_MODELS,
          *(corpus.TRANSFORMERS_MODELS if HAVE_TRANSFORMERS else ()))
GRIDS = make_grids(sorted({(pr, pc) for _, pr, pc in corpus.CASES}))
TOLERANCE = 1e-9


def accepted_runs() -> set[tuple[str, str, int, int]]:
    """The (model, strategy, pr, pc) the head's validation accepts (as before any rank starts),
    each validated on one rank, for all ranks."""
    mine = set()
    combos = [(model, strategy, pr, pc) for strategy, pr, pc in corpus.CASES for model in MODELS]
    for index, (model, strategy, pr, pc) in enumerate(combos):
        if index % WORLD.Get_size() != RANK:
            continue
        try:
            validate(OmegaConf.create(corpus.run_config(model, strategy, pr, pc)))
            mine.add((model, strategy, pr, pc))
        except ConfigError:
            pass
    return set().union(*WORLD.allgather(mine))


@check
def every_accepted_run_gives_one_process_losses_and_the_predicted_bytes() -> None:
    reference = one_process_losses({model: (corpus.run_config(model, "data", 1, 1),
                                            OUT / f"{model}_reference") for model in MODELS})
    runs = accepted_runs()
    trained = []
    for strategy, pr, pc in corpus.CASES:
        grid = GRIDS[pr, pc]
        for model in MODELS:
            if (model, strategy, pr, pc) not in runs:
                continue
            if grid is not None:
                path = train_run(corpus.run_config(model, strategy, pr, pc),
                                 OUT / f"{model}_{strategy}_{pr}x{pc}", grid)
                if grid.rank == 0:
                    assert_one_process(path, reference[model], TOLERANCE,
                                       f"{model} under {strategy} {pr}x{pc}")
            trained.append(f"{model}:{strategy}")
            wait_politely()
    if RANK == 0:  # the share each strategy trains, for the README
        print("trained " + " ".join(trained), flush=True)
    # every model trains under data but those whose draws cannot be cut into rows
    assert all(f"{model}:data" in trained for model in MODELS
               if model not in corpus.REFUSED_BY_DATA), trained


if __name__ == "__main__":
    run_checks()
