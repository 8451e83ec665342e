"""Validation: the model's loss and accuracy on the validation set, its rows split over the
ranks; for an optimizer with a centre variable, the centre's next to the replicas'.

Inputs and targets are scored on the model's device (moved there when they arrive elsewhere);
only the three sums each rank contributes travel, as a host float64 control message."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runner.core import CountedComm, Partition
from runner.optim import ReplicaOptimizer
from strategies import ParallelModel


@dataclass
class Evaluation:
    loss: float
    accuracy: float


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model` computes: its first parameter's device (the host when it has none)."""
    param = next(model.parameters(), None)
    return torch.device("cpu") if param is None else param.device


def _score(model: ParallelModel, x: torch.Tensor, targets: torch.Tensor,
           comm: CountedComm) -> Evaluation:
    """Loss and accuracy of `model` fed `x`, each rank scoring its output rows, summed over
    `comm`."""
    device = model_device(model)
    x = x.to(device, non_blocking=True)
    targets = targets.to(device, non_blocking=True)
    model.eval()
    with torch.no_grad():
        out = model(x)
        sums = torch.stack([F.cross_entropy(out, targets, reduction="sum").double(),
                            (out.argmax(dim=1) == targets).sum().double()])
        loss_sum, correct = sums.tolist()  # one read back from the device
    model.train()
    # host: control (three numbers, summed over the ranks)
    stats = torch.tensor([loss_sum, correct, float(len(targets))], dtype=torch.float64)
    comm.allreduce_(stats, label="eval")
    loss_sum, correct, count = stats.tolist()
    return Evaluation(loss_sum / count, correct / count)


def evaluate(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
    """Validation loss and accuracy over the whole set, its rows split over all ranks."""
    return _score(model, x[model.input_rows(len(x))], y[model.output_rows(len(x))],
                  model.loss_comm)


def evaluate_replica(model: ParallelModel, x: torch.Tensor, y: torch.Tensor) -> Evaluation:
    """This replica's (model group's) own weights on the whole set, with no other replica
    taking part: the group is fed every row and each rank scores its sub-shard."""
    grid = model.grid
    # x[:]: every row (a user's map-style dataset is read only on indexing)
    return _score(model, x[:], y[Partition(len(x), grid.pr).slice(grid.model_index)],
                  grid.model)


def validation(model: ParallelModel, optimizer: ReplicaOptimizer, x: torch.Tensor,
               y: torch.Tensor, everyone: bool) -> dict[str, float] | None:
    """The validation line: the model's loss and accuracy, or for an optimizer with a centre
    variable the centre's, next to the workers' mean (`everyone`: every replica takes part) or
    replica 0's own (asynchronous runs mid-way: replica 0 alone, so nobody waits; other
    replicas return None)."""
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
