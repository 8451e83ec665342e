"""An output projection split by vocabulary (or classes) by a parallel plan (`vocab` on the
model's head: strategies/layers/vocab_head.py) against one process, in one launch:
`mpiexec -n 4 python THIS`.

The transformers library's Llama (its head untied) with `lm_head: vocab`, and its BERT
classifier with `classifier: vocab` (split by classes), in float64, under strategy=model 2x1 and
strategy=grid 2x2: each rank's logits stay a piece of the vocabulary; every step's loss, and
the loss and accuracy after training, equal one process's to 1e-9 relative; every final
parameter piece equals the block of one process's parameter its placement names; the bytes rank
0 moves every step are the predicted ones, and fewer than the same plan with a gathered
(`colwise`) head moves.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `tests` is this checkout's, whatever else is installed

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import check, make_grids, run_checks  # noqa: E402
from mpi4py import MPI  # noqa: E402
from plan_harness import (  # noqa: E402
    TOLERANCE,
    assert_moved_as_predicted,
    assert_pieces_equal,
    built,
    tagged_copy,
)
from torch import nn  # noqa: E402

from runner.core import ProcessGrid  # noqa: E402
from runner.cost.collectives import step_bytes  # noqa: E402
from strategies import STRATEGIES, ParallelModel, Strategy  # noqa: E402
from strategies.plans.module_plan import DECLARED_STYLES, declared_plan  # noqa: E402
from strategies.probe import logits_of  # noqa: E402
from tests import plan_models  # noqa: E402

WORLD = MPI.COMM_WORLD
GRIDS = make_grids([(2, 1), (2, 2)])
VOCAB, T, BATCH, CLASSES = 50, 8, 8, 4
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def relative_gap(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-300)


def vocab_and_gathered(strategy_name: str, plan: dict[str, str],
                       head: str) -> tuple[Strategy, Strategy]:
    """The strategy with `plan` and its head split by vocabulary, and the same with the head
    gathered (`colwise`), to compare the bytes they move."""
    make = STRATEGIES.get(strategy_name)
    return (make(bucket_cap_mb=0.004, first_bucket_mb=0.001, plan={**plan, head: "vocab"}),
            make(bucket_cap_mb=0.004, first_bucket_mb=0.001, plan={**plan, head: "colwise"}))


def batch(classes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: token ids, and a class per sequence or a next token per position."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(1, VOCAB, (BATCH, T), generator=gen)
    y = (torch.randint(0, classes, (BATCH,), generator=gen) if classes
         else torch.randint(0, VOCAB, (BATCH, T), generator=gen))
    return x, y


def train_alike(what: str, seq: nn.Module, pmodel: ParallelModel, grid: ProcessGrid,
                x: torch.Tensor, y: torch.Tensor, predicted: Counter[Any]) -> None:
    """Three SGD steps of one process and of the parallel model: every step's loss the same,
    each rank's logits a piece of the vocabulary (never gathered), and the bytes rank 0 moves
    the `predicted` ones."""
    targets = y.numel()
    scale = grid.size / targets
    seq_opt = torch.optim.SGD(seq.parameters(), lr=0.5, momentum=0.9)
    par_opt = torch.optim.SGD(pmodel.parameters(), lr=0.5, momentum=0.9)
    x_local, y_local = x[pmodel.input_rows(BATCH)], y[pmodel.output_rows(BATCH)]
    grid.counter.keep_records = True
    for step in range(3):
        seq_opt.zero_grad()
        out = logits_of(seq(x))
        seq_loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        seq_loss.backward()
        pmodel.zero_grad()
        grid.counter.records.clear()
        logits = pmodel(x_local)
        # every row of the group, a piece of the vocabulary: never gathered
        assert logits.shape[0] == len(x_local), what
        assert logits.shape[-1] == out.shape[-1] // grid.pr, (what, logits.shape)
        score = pmodel.score(logits, y_local)
        (score.loss_sum * scale).backward()
        pmodel.finish_gradient_sync()
        assert_moved_as_predicted(grid, predicted, what, step)
        loss = grid.world.mpi_comm.allreduce(score.loss_sum.item()) / targets
        assert relative_gap(loss, seq_loss.item()) <= TOLERANCE, (what, step, loss,
                                                                  seq_loss.item())
        seq_opt.step()
        par_opt.step()
    grid.counter.keep_records = False


def assert_scores_equal(what: str, seq: nn.Module, pmodel: ParallelModel, grid: ProcessGrid,
                        x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The loss and the accuracy of the trained weights, as evaluation scores them, equal one
    process's; the targets scored right, and all of them."""
    x_local, y_local = x[pmodel.input_rows(BATCH)], y[pmodel.output_rows(BATCH)]
    with torch.no_grad():
        out = logits_of(seq(x))
        out = out.reshape(-1, out.shape[-1])
        seq_loss = F.cross_entropy(out, y.reshape(-1), reduction="sum").item()
        seq_right = (out.argmax(dim=1) == y.reshape(-1)).sum().item()
        score = pmodel.score(pmodel(x_local), y_local, correct=True)
    assert score.correct is not None
    loss, right, count = grid.world.mpi_comm.allreduce(
        torch.tensor([score.loss_sum.item(), score.correct.item(), score.count],
                     dtype=torch.float64)).tolist()
    assert count == y.numel() and right == seq_right, (what, count, right, seq_right)
    assert relative_gap(loss, seq_loss) <= TOLERANCE, (what, loss, seq_loss)
    return right, count


def compare(factory: Callable[[], nn.Module], plan: dict[str, str], head: str,
            strategy_name: str, shape: tuple[int, int], classes: int | None = None) -> None:
    grid: ProcessGrid | None = GRIDS[shape]
    if grid is None:
        return
    what = f"{factory.__name__} {strategy_name} {shape[0]}x{shape[1]}"
    strategy, gathered = vocab_and_gathered(strategy_name, plan, head)
    seq = built(factory)
    assert strategy.check_model(seq, (T,), grid.shape) == [], (
        what, strategy.check_model(seq, (T,), grid.shape))
    ops = strategy.predict_ops(seq, (T,), grid.shape, BATCH)
    gathered_ops = gathered.predict_ops(seq, (T,), grid.shape, BATCH)
    assert step_bytes(ops) < step_bytes(gathered_ops), (
        what, step_bytes(ops), step_bytes(gathered_ops))
    pmodel = strategy.parallelize(tagged_copy(seq), (T,), grid)
    assert getattr(pmodel, "layouts", {}).get(head) == "vocab", what
    x, y = batch(classes)
    train_alike(what, seq, pmodel, grid, x, y, Counter(op.key for op in ops))
    right, count = assert_scores_equal(what, seq, pmodel, grid, x, y)
    assert_pieces_equal(seq, pmodel, what)
    if grid.rank == 0:
        print(f"{what}: {step_bytes(ops)} bytes a step as predicted (a gathered head: "
              f"{step_bytes(gathered_ops)}); accuracy {right:.0f}/{count:.0f} as one process",
              flush=True)


def untied_llama() -> nn.Module:
    model = plan_models.hf_llama(VOCAB, (T,))
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


def bert_classifier() -> nn.Module:
    return plan_models.hf_bert(VOCAB, CLASSES, (T,))


def llama_plan() -> dict[str, str]:
    """Llama's declared plan, given as a user's (the head's style replaced by `compare`)."""
    return {pattern: DECLARED_STYLES[style]
            for pattern, style in declared_plan(untied_llama()).items()}


@check
def a_language_models_head_split_by_vocabulary_equals_one_process() -> None:
    if not HAVE_TRANSFORMERS:
        return
    plan = llama_plan()
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        compare(untied_llama, plan, "lm_head", strategy_name, shape)


@check
def a_classifier_head_split_by_classes_equals_one_process() -> None:
    if not HAVE_TRANSFORMERS:
        return
    for strategy_name, shape in (("model", (2, 1)), ("grid", (2, 2))):
        compare(bert_classifier, plan_models.BERT_PLAN, "classifier", strategy_name, shape,
                classes=CLASSES)


if __name__ == "__main__":
    run_checks()
