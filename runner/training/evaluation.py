"""Validation: the model's loss and accuracy on the validation set, its rows split over the
ranks; for an optimizer with a centre variable, the centre's next to the replicas'.

Inputs and targets are scored on the model's device (moved there when they arrive elsewhere);
only the three sums each rank contributes travel, as a host float64 control message."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runner.core import CountedComm
from runner.optim.sync import ReplicaOptimizer
from strategies import ParallelModel


@dataclass
class Evaluation:
    loss: float
    accuracy: float


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: its first parameter's device (the host when it has none)."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


# A language model's validation set is scored in pieces of about this many targets (positions)
# per piece of the global set: its logits (targets × vocabulary) would not fit at once.
EVAL_TARGETS = 4096


def targets_per_row(y: object) -> int:
    """1 for a class per sample, T for a token id per position (a user's lazily read targets
    are classes)."""
    return math.prod(y.shape[1:]) if isinstance(y, torch.Tensor) else 1


def _chunks(rows: int, targets_per_row: int) -> list[slice]:
    """Pieces of the global set's rows: one for a classifier, pieces of about EVAL_TARGETS
    targets for a language model. Every rank cuts the same pieces (collectives match)."""
    if targets_per_row <= 1:
        return [slice(0, rows)]
    size = max(1, EVAL_TARGETS // targets_per_row)
    return [slice(start, min(rows, start + size)) for start in range(0, max(rows, 1), size)]


def _score(model: ParallelModel, pieces: list[tuple[torch.Tensor, torch.Tensor]],
           comm: CountedComm) -> Evaluation:
    """Loss and accuracy of `model` fed each piece's inputs, each rank scoring its output
    rows, summed over `comm`."""
    device = model_device(model)
    loss_sum = correct = count = 0.0
    model.eval()
    with torch.no_grad():
        for x, targets in pieces:
            x = x.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            score = model.score(model(x), targets, correct=True)
            assert score.correct is not None
            sums = torch.stack([score.loss_sum.double(), score.correct.double()])
            piece_loss, piece_correct = sums.tolist()  # one read back from the device
            loss_sum, correct, count = (loss_sum + piece_loss, correct + piece_correct,
                                        count + score.count)
    model.train()
    # host: control (three numbers, summed over the ranks)
    stats = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    comm.allreduce_(stats, label="eval")
    loss_sum, correct, count = stats.tolist()
    return Evaluation(loss_sum / count, correct / count)


def evaluate(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
    """Validation loss and accuracy over the whole set, its rows split over all ranks."""
    pieces = []
    for rows in _chunks(len(x), targets_per_row(y)):
        size = rows.stop - rows.start
        # global slices: a user's lazily read dataset reads only this rank's rows
        pieces.append((x[_within(rows, model.input_rows(size))],
                       y[_within(rows, model.output_rows(size))]))
    return _score(model, pieces, model.loss_comm)


def _within(piece: slice, rows: slice) -> slice:
    """`rows` of `piece` (a slice of the set) as a slice of the set."""
    return slice(piece.start + rows.start, piece.start + rows.stop)


def evaluate_replica(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
    """This replica's (model group's) own weights on the whole set, with no other replica
    taking part: the group is fed every row and each rank scores its sub-shard."""
    grid = model.grid
    # x[rows]: every row, piece by piece (a user's map-style dataset is read only on indexing)
    pieces = [(x[rows], y[_within(rows, model.own_rows(rows.stop - rows.start))])
              for rows in _chunks(len(x), targets_per_row(y))]
    return _score(model, pieces, grid.model)


def validation(model: ParallelModel, optimizer: ReplicaOptimizer, x: torch.Tensor,
               y: torch.Tensor, everyone: bool) -> dict[str, float] | None:
    """The validation line: the model's loss and accuracy (a language model's per token, and
    its perplexity exp(loss)), or for an optimizer with a centre
    variable the centre's, next to the workers' mean (`everyone`: every replica takes part) or
    replica 0's own (asynchronous runs mid-way: replica 0 alone, so nobody waits; other
    replicas return None)."""
    line = _validation(model, optimizer, x, y, everyone)
    if line is not None and targets_per_row(y) > 1:  # a language model: its perplexity
        line.update({key.replace("loss", "perplexity"): math.exp(min(value, 700.0))
                     for key, value in line.items() if key.endswith("loss")})
    return line


def _validation(model: ParallelModel, optimizer: ReplicaOptimizer, x: torch.Tensor,
                y: torch.Tensor, everyone: bool) -> dict[str, float] | None:
    if not optimizer.has_centre:
        result = evaluate(model, x, y)
        return {"loss": result.loss, "accuracy": result.accuracy}
    grid = model.grid
    if everyone:
        with optimizer.centre_weights():
            centre = evaluate(model, x, y)
        own = evaluate_replica(model, x, y)
        workers = torch.tensor([own.loss, own.accuracy], dtype=torch.float64)  # host: control
        grid.batch.allreduce_(workers, label="eval")
        workers_loss, workers_accuracy = (workers / grid.pc).tolist()
        return {"loss": centre.loss, "accuracy": centre.accuracy, "workers_loss": workers_loss,
                "workers_accuracy": workers_accuracy}
    if grid.batch_index != 0:
        return None
    with optimizer.centre_weights():
        centre = evaluate_replica(model, x, y)
    own = evaluate_replica(model, x, y)
    return {"loss": centre.loss, "accuracy": centre.accuracy, "worker0_loss": own.loss,
            "worker0_accuracy": own.accuracy}
