"""What each step is fed: this rank's rows of the next global batch, read ahead.

The sample order is the sampler's (`sampling.EpochSampler`: the same on every rank and grid).
The feeder draws the steps to come from a copy of it and reads their rows on background threads
(`runner.data.readahead`, `data.workers` threads, `data.prefetch` steps ahead) while the current
step computes; the sampler itself advances only as steps are taken, so a checkpoint records
where training stands, not where reading stands, and a resumed run reads from there.

A rank reads only its rows: each micro-batch's inputs (its batch group's piece) and the targets
of its outputs. A file-backed dataset (`runner.data.rows.RowSource`) reads them in one call per
micro-batch, keyed on the epoch for its augmentation; a user's map-style dataset is read one
batch at a time (its columns share the rows last read, and a user's `__getitem__` need not be
safe on two threads); tensors are gathered. On a GPU a batch read on the host lands in pinned
memory and is copied without blocking; a dataset held on the device is gathered there, and one
held in host memory for a step on the host gathered on the step's own thread (nothing to read
ahead).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from runner.data.readahead import ReadAhead
from runner.data.rows import source_of
from runner.training.sampling import EpochSampler
from runner.training.step import Feed
from runner.zoo.datasets import ClassificationData
from strategies.base import MicroBatch


@dataclass(frozen=True)
class StepRows:
    """A step's sample order (the global batch's sample indices), its epoch, and where the
    sampler stood after drawing it."""

    rows: torch.Tensor
    epoch: int
    position: int


HostBatch = list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets) per micro-batch


class BatchFeeder:
    """The next step's feeds (`next`), read `prefetch` steps ahead on `workers` threads, for
    the `steps` steps this start takes (nothing is read past the last)."""

    def __init__(self, data: ClassificationData, sampler: EpochSampler,
                 micro: Sequence[MicroBatch], device: torch.device, workers: int,
                 prefetch: int, steps: int) -> None:
        self.data, self.sampler, self.device = data, sampler, device
        self.micro = list(micro)
        held = data.train_x
        self.on_device = isinstance(held, torch.Tensor) and held.device.type != "cpu"
        self.pin = device.type == "cuda" and not self.on_device
        self._lock = threading.Lock()  # a user's dataset: one read at a time
        self.source = source_of(data.train_x)
        ahead = EpochSampler(sampler.num_samples, sampler.batch_size, seed=0)
        ahead.load_state(sampler.state())
        # Rows of tensors in host memory, for a host step, are gathered on the step's own thread,
        # as a plain loop indexes them: a reading thread's hand-off cost more than the gather
        # (0.12 ms a step on 2 cores) and nothing is read from a disk
        inline = self.on_device or (self.source is None and isinstance(held, torch.Tensor)
                                    and not self.pin)
        self.reader: ReadAhead[StepRows, HostBatch] = ReadAhead(
            self._read, self._plans(ahead, steps), 0 if inline else workers, prefetch)

    @staticmethod
    def _plans(ahead: EpochSampler, steps: int) -> Iterator[StepRows]:
        for _ in range(steps):
            rows = ahead.next_batch()
            yield StepRows(rows, ahead.epoch, ahead.position)

    def _read(self, step: StepRows) -> HostBatch:
        """This rank's rows of `step`, micro-batch by micro-batch (on a reading thread)."""
        rows, out = step.rows, []
        if self.on_device:
            rows = rows.pin_memory().to(self.data.train_x.device, non_blocking=True)
        for micro in self.micro:
            if self.source is not None:
                x, y = self._read_source(rows, micro, step.epoch)
            elif isinstance(self.data.train_x, torch.Tensor):
                x, y = self.data.train_x[rows[micro.inputs]], self.data.train_y[rows[micro.outputs]]
            else:
                with self._lock:
                    x = self.data.train_x[rows[micro.inputs]]
                    y = self.data.train_y[rows[micro.outputs]]
            if self.pin:
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x, y))
        return out

    def _read_source(self, rows: torch.Tensor, micro: MicroBatch,
                     epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One read of a row source for a micro-batch's inputs and targets (the targets' rows
        lie among the inputs' wherever a strategy gives a rank inputs; else they are read
        apart)."""
        assert self.source is not None
        inputs, outputs = micro.inputs, micro.outputs
        dtype = getattr(self.data.train_x, "dtype", None)
        x, y = self.source.read(rows[inputs], epoch)
        if inputs.start <= outputs.start and outputs.stop <= inputs.stop:
            y = y[outputs.start - inputs.start:outputs.stop - inputs.start]
        else:
            y = self.source.read(rows[outputs], epoch)[1]
        return (x.to(dtype) if dtype is not None else x), y

    def next(self, micro: Sequence[MicroBatch]) -> list[Feed]:
        """The next step's feeds: the sampler advances by one global batch. `micro`: the step's
        micro-batches as the model gives them (the slices the reads were planned with)."""
        self.sampler.next_batch()
        planned, host = self.reader.next()
        # the sampler's place, not its rows: comparing tensors would read them in the step
        if (planned.epoch, planned.position) != (self.sampler.epoch, self.sampler.position) or [
                (m.inputs, m.outputs) for m in micro] != [(m.inputs, m.outputs)
                                                          for m in self.micro]:
            raise RuntimeError("the rows read ahead are not the step's: the sampler or the "
                               "micro-batches changed under the reader")
        return [Feed(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True),
                     m) for (x, y), m in zip(host, micro, strict=True)]

    def close(self) -> None:
        self.reader.close()
