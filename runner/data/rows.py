"""Rows read from storage on demand: the contract every file-backed dataset keeps.

A built-in dataset of tensors is held whole by every rank; a file-backed one (a token file, an
image folder) is a `RowSource`: a rank reads only the rows of each global batch it needs, by
sample index, and a read is a pure function of (index, epoch) — random augmentation is keyed on
the run's seed, the epoch and the index, never on a worker's state — so a run resumed on any
grid, with any number of readers, reads exactly what an uninterrupted run read.

`source_data` puts a training and a validation source into the `ClassificationData` the loop
holds: its columns are `SourceColumn`s, which index like tensors (`column[indices]`), so
evaluation and the head's checks read them as they read a user's map-style dataset; the loop's
reader (`runner.training.feeding`) calls `RowSource.read` itself, once per micro-batch, for the
inputs and the targets together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from runner.zoo.datasets import ClassificationData, DatasetError


class DataFileError(DatasetError):
    """A file of the data is not what the dataset needs: one line naming the file (and the
    offset or row) and what is wrong."""


@runtime_checkable
class RowSource(Protocol):
    """A dataset's rows in storage, read by sample index."""

    def __len__(self) -> int:
        """The number of samples."""
        ...

    def read(self, indices: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs and targets of samples `indices` (int64, in that order) as drawn in
        `epoch` (what random augmentation is keyed on), on the host. Raises `DataFileError`
        naming the file for a row that cannot be read or breaks the dataset's contract."""
        ...

    def input_is_floating(self) -> bool:
        """Whether inputs are real numbers (images, features) rather than token ids."""
        ...


class SourceColumn:
    """The inputs (`field` 0) or the targets (1) of a `RowSource`, indexed like a tensor:
    `column[indices]`, `column[a:b]`, `len(column)`; floating inputs cast to `dtype` as read
    (`to`). A read is the source's epoch-0 read (evaluation: a validation set is not
    augmented)."""

    def __init__(self, source: RowSource, field: int, dtype: torch.dtype | None = None) -> None:
        self.source, self.field, self.dtype = source, field, dtype

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: torch.Tensor | slice | Sequence[int]) -> torch.Tensor:
        if isinstance(index, slice):
            indices = torch.arange(len(self.source))[index]
        else:
            indices = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        value = self.source.read(indices, 0)[self.field]
        return value.to(self.dtype) if self.dtype is not None else value

    def is_floating_point(self) -> bool:
        return self.field == 0 and self.source.input_is_floating()

    def to(self, dtype: torch.dtype) -> SourceColumn:
        return SourceColumn(self.source, self.field, dtype)


def source_data(train: RowSource, val: RowSource) -> ClassificationData:
    """A dataset's training and validation sources as the columns the loop holds."""
    return ClassificationData(SourceColumn(train, 0), SourceColumn(train, 1),  # type: ignore[arg-type]
                              SourceColumn(val, 0), SourceColumn(val, 1))  # type: ignore[arg-type]


def source_of(column: object) -> RowSource | None:
    """The `RowSource` behind a column, None for a tensor or a user's lazily read dataset."""
    return column.source if isinstance(column, SourceColumn) else None


def augmentation_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's random augmentation in one epoch: the same whoever reads it,
    whenever (a resumed run, another grid, another number of readers)."""
    # splitmix64's finaliser over the three numbers: neighbouring samples get unrelated seeds
    value = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index) & (2**64 - 1)
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (value ^ (value >> 31)) & (2**63 - 1)
