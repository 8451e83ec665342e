"""Validation: the model's loss and accuracy on the validation set, its rows split over the
ranks; for an optimizer with a centre variable, the centre's next to the replicas'.

The set is scored in global batches of at most `trainer.batch_size` rows (`batch_size`), each
split over the ranks as a training batch is, so that a forward never holds more than a training
step's rows: one forward over a real validation set would not fit in a GPU's memory. A language
model's pieces are also at most about EVAL_TARGETS targets (its logits are targets ×
vocabulary). The loss and accuracy are sums over the pieces: the same numbers however the set is
cut, up to floating-point summation order.

A piece with fewer rows than the ranks that split it (`trainer.eval_samples=1` on a 2 x 2 grid)
would leave a rank without rows, which not every layer's collectives take: it is scored padded
with copies of its first row, and those copies scored alone are taken off again (`_fed`), so an
empty shard contributes nothing and the numbers are one process's.

Inputs and targets are scored on the model's device (moved there when they arrive elsewhere);
the sums stay there until the last piece (one read back), and only the three sums each rank
contributes travel, as a host float64 control message."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from runner.core import CountedComm, Partition
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


def _chunks(rows: int, targets_per_row: int, batch_size: int | None = None,
            ranks: int = 1) -> list[slice]:
    """Pieces of the global set's rows: global batches of at most `batch_size` rows (None: no
    limit), a language model's also of at most about EVAL_TARGETS targets. Cut evenly (sizes
    differ by one at most, rather than a small remainder last) and never below `ranks` rows
    where the set has them, so every rank of the batch group gets rows of every piece, as in
    training. Every rank cuts the same pieces (the collectives match)."""
    most = rows if batch_size is None else batch_size
    if targets_per_row > 1:
        most = min(most, max(1, EVAL_TARGETS // targets_per_row))
    count = -(-rows // max(most, 1))
    count = max(1, min(count, rows // max(ranks, 1)))
    pieces = Partition(rows, count)
    return [pieces.slice(i) for i in range(count)]


# A piece's inputs and targets on this rank, and the sign its score is summed with (-1: padding
# scored alone, taken off again).
Fed = tuple[torch.Tensor, torch.Tensor, int]


def _score(model: ParallelModel, pieces: Iterable[Fed], comm: CountedComm) -> Evaluation:
    """Loss and accuracy of `model` fed each piece's inputs, each rank scoring its output
    rows, summed over `comm`."""
    device = model_device(model)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, correct
    count = 0
    model.eval()
    with torch.no_grad():
        for x, targets, sign in pieces:
            x = x.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            score = model.score(model(x), targets, correct=True)
            assert score.correct is not None
            # summed on the device in float64, piece by piece: no read back per piece
            sums += sign * torch.stack([score.loss_sum.double(), score.correct.double()])
            count += sign * score.count
    model.train()
    loss_sum, correct = sums.tolist()  # one read back from the device
    # host: control (three numbers, summed over the ranks)
    stats = torch.tensor([loss_sum, correct, count], dtype=torch.float64)
    comm.allreduce_(stats, label="eval")
    loss_sum, correct, count = stats.tolist()
    return Evaluation(loss_sum / count, correct / count)


def evaluate(model: ParallelModel, x: torch.Tensor, y: torch.Tensor,
             batch_size: int | None = None) -> Evaluation:
    """Validation loss and accuracy over the whole set in global batches of at most
    `batch_size` rows (None: the whole set at once, a language model's in pieces), the rows of
    each split over all ranks."""
    def pieces() -> Iterator[Fed]:
        # one piece at a time: a user's lazily read dataset reads only this rank's rows of it
        for rows in _chunks(len(x), targets_per_row(y), batch_size, model.grid.pc):
            yield from _fed(model, x, y, rows)

    return _score(model, pieces(), model.loss_comm)


def _fed(model: ParallelModel, x: torch.Tensor, y: torch.Tensor, piece: slice
         ) -> Iterator[Fed]:
    """This rank's inputs and targets of `piece`, split as a training batch is. A piece too
    short to give every batch group a row is fed with `pc` copies of its first row after it,
    and then those copies alone with the sign -1: the sums are the piece's own, and no rank is
    fed an empty shard. Each is yielded before the next one's rows are asked for (a model may
    note the size of the batch it is about to be fed, `input_rows`)."""
    size, pc = piece.stop - piece.start, model.grid.pc
    if size >= pc:
        yield (x[_within(piece, model.input_rows(size))],
               y[_within(piece, model.output_rows(size))], 1)
        return
    device = x.device if isinstance(x, torch.Tensor) else None  # a map-style set reads on host
    padded = torch.cat([torch.arange(piece.start, piece.stop, device=device),
                        torch.full((pc,), piece.start, device=device)])
    for order, sign in ((padded, 1), (padded[size:], -1)):
        rows = len(order)
        yield (x[_picked(order, model.input_rows(rows), x)],
               y[_picked(order, model.output_rows(rows), y)], sign)


def _picked(order: torch.Tensor, rows: slice, data: object) -> torch.Tensor:
    """The set's rows at `rows` of `order`, as an index into `data` (on its device)."""
    index = order[rows]
    return index.to(data.device) if isinstance(data, torch.Tensor) else index


def _within(piece: slice, rows: slice) -> slice:
    """`rows` of `piece` (a slice of the set) as a slice of the set."""
    return slice(piece.start + rows.start, piece.start + rows.stop)


def evaluate_replica(model: ParallelModel, x: torch.Tensor, y: torch.Tensor,
                     batch_size: int | None = None) -> Evaluation:
    """This replica's (model group's) own weights on the whole set, with no other replica
    taking part: the group is fed every row of each piece (global batches of at most
    `batch_size` rows) and each rank scores its sub-shard."""
    grid = model.grid

    def pieces() -> Iterator[Fed]:
        # x[rows]: every row (a user's map-style dataset is read only on indexing)
        for rows in _chunks(len(x), targets_per_row(y), batch_size, grid.pc):
            yield x[rows], y[_within(rows, model.own_rows(rows.stop - rows.start))], 1

    return _score(model, pieces(), grid.model)


def validation(model: ParallelModel, optimizer: ReplicaOptimizer, x: torch.Tensor,
               y: torch.Tensor, everyone: bool,
               batch_size: int | None = None) -> dict[str, float] | None:
    """The validation line: the model's loss and accuracy (a language model's per token, and
    its perplexity exp(loss)), or for an optimizer with a centre
    variable the centre's, next to the workers' mean (`everyone`: every replica takes part) or
    replica 0's own (asynchronous runs mid-way: replica 0 alone, so nobody waits; other
    replicas return None). `batch_size`: the rows of each global batch the set is scored in
    (`trainer.batch_size`; None: the whole set at once)."""
    line = _validation(model, optimizer, x, y, everyone, batch_size)
    if line is not None and targets_per_row(y) > 1:  # a language model: its perplexity
        line.update({key.replace("loss", "perplexity"): math.exp(min(value, 700.0))
                     for key, value in line.items() if key.endswith("loss")})
    return line


def _validation(model: ParallelModel, optimizer: ReplicaOptimizer, x: torch.Tensor,
                y: torch.Tensor, everyone: bool,
                batch_size: int | None) -> dict[str, float] | None:
    if not optimizer.has_centre:
        result = evaluate(model, x, y, batch_size)
        return {"loss": result.loss, "accuracy": result.accuracy}
    grid = model.grid
    if everyone:
        with optimizer.centre_weights():
            centre = evaluate(model, x, y, batch_size)
        own = evaluate_replica(model, x, y, batch_size)
        workers = torch.tensor([own.loss, own.accuracy], dtype=torch.float64)  # host: control
        grid.batch.allreduce_(workers, label="eval")
        workers_loss, workers_accuracy = (workers / grid.pc).tolist()
        return {"loss": centre.loss, "accuracy": centre.accuracy, "workers_loss": workers_loss,
                "workers_accuracy": workers_accuracy}
    if grid.batch_index != 0:
        return None
    with optimizer.centre_weights():
        centre = evaluate_replica(model, x, y, batch_size)
    own = evaluate_replica(model, x, y, batch_size)
    return {"loss": centre.loss, "accuracy": centre.accuracy, "worker0_loss": own.loss,
            "worker0_accuracy": own.accuracy}
