"""A user's own dataset: `dataset._target_=my_pkg.data.make` (README, "Your own data").

The function (or class) named by `_target_` is called with the dataset's other config keys and
returns the training and validation sets: `(train, val)` or `{"train": ..., "val": ...}`, each
either a pair of tensors `(inputs, targets)` or a map-style `torch.utils.data.Dataset` whose
items are `(input, target)` (targets are class indices: gridrun's objective is cross-entropy).

Tensors are held whole by every rank, as the built-in datasets are. A map-style dataset is read
lazily: a rank calls `__getitem__` only for the rows of each global batch it needs (its share
under `data`, the whole batch of its model group under `model`), so the dataset's own storage
(files, a memory map) is never read whole. What cannot be learned from one row without reading
them all is asked of the dataset itself: `num_classes` (or a `classes` list, torchvision's
convention) and, for token ids, `vocab_size`.

What the rows hold is checked as they are read, in one vectorised pass over each batch's rows:
a target that is not an integer class index in [0, classes) (a bool, a float), an input that is
complex or not finite, a token id outside the vocabulary, a row that cannot be read (a
`__len__` that claims more rows than `__getitem__` gives). Tensors are checked whole, once, when
they are loaded; the head checks them too, and a sample of a map-style dataset's rows, before any
rank starts (`check_rows`). A problem is `UserDatasetError`: one line naming the row and the
value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from runner.zoo.datasets import (
    ClassificationData,
    DatasetError,
    DatasetSpec,
    check_loaded,
    dtype_problem,
    inputs_problem,
    is_class_index,
    targets_problem,
)


class UserDatasetError(DatasetError):
    """The user's dataset does not keep the contract (one line: what and why)."""


class LazyRows:
    """The inputs or the targets of a map-style dataset, read row by row on indexing. The two
    views of one dataset share the rows last read: a batch's targets come with its inputs.
    The rows read are checked (`rows_problem`) before they are handed on: `name` is the set's
    name, `limit` the number of classes (targets) or the vocabulary (token ids), `shape` a
    row's (None: the first row read's)."""

    def __init__(self, dataset: Any, field: int, shared: dict[int, tuple[Any, Any]],
                 dtype: torch.dtype | None = None, name: str = "train",
                 limit: int | None = None, shape: tuple[int, ...] | None = None) -> None:
        self.dataset, self.field, self.shared, self.dtype = dataset, field, shared, dtype
        self.name, self.limit, self.shape = name, limit, shape

    def __len__(self) -> int:
        return len(self.dataset)

    def _row(self, index: int) -> Any:
        if index not in self.shared:
            self.shared[index] = _item(self.dataset, index, self.name)
        return self.shared[index][self.field]

    def __getitem__(self, index: torch.Tensor | slice | Sequence[int]) -> torch.Tensor:
        if isinstance(index, slice):
            indices = list(range(len(self)))[index]
        elif isinstance(index, torch.Tensor):
            indices = index.flatten().tolist()
        else:
            indices = [int(i) for i in index]
        if self.field == 0:  # a new batch: forget the previous one's rows
            self.shared.clear()
        rows = [_as_tensor(self._row(i), self.name, i, self.field) for i in indices]
        if not rows:
            return torch.empty(0)
        shape = self.shape if self.shape is not None else tuple(rows[0].shape)
        for i, row in zip(indices, rows, strict=True):  # per row, not per value: shape, dtype
            what = (f"has {'inputs' if self.field == 0 else 'a target'} of shape "
                    f"{tuple(row.shape)}, the training set's are {shape}"
                    if tuple(row.shape) != shape else dtype_problem(row, self.field == 0))
            if what:
                raise UserDatasetError(f"the {self.name} set's row {i}: {what}")
        stacked = torch.stack(rows)
        problem = (inputs_problem(stacked, self.limit) if self.field == 0
                   else targets_problem(stacked, self.limit or 0))
        if problem is not None:
            raise UserDatasetError(f"the {self.name} set's row {indices[problem[0]]}: "
                                   f"{problem[1]}")
        return stacked.to(self.dtype) if self.dtype is not None else stacked

    def is_floating_point(self) -> bool:
        return torch.as_tensor(self._row(0)).is_floating_point()

    def to(self, dtype: torch.dtype) -> LazyRows:
        return LazyRows(self.dataset, self.field, self.shared, dtype, self.name, self.limit,
                        self.shape)


def _item(dataset: Any, index: int, name: str = "train") -> tuple[Any, Any]:
    """Row `index` of a map-style dataset; what the user's `__getitem__` raises is one line
    naming the row (an IndexError within `__len__`: a length that claims too many rows)."""
    try:
        item = dataset[index]
    except Exception as exc:  # the user's code
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        raised = f"{type(exc).__name__}{': ' + first if first else ''}"
        if isinstance(exc, IndexError):
            raise UserDatasetError(f"the {name} set's row {index} cannot be read ({raised}): "
                                   f"its __len__ says {len(dataset)} rows") from None
        raise UserDatasetError(f"the {name} set's row {index}: __getitem__ raised "
                               f"{raised}") from None
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise UserDatasetError(f"the {name} set's row {index} is a {type(item).__name__}, not "
                               f"an (input, target) pair")
    return item[0], item[1]


def _as_tensor(value: Any, name: str, index: int, field: int) -> torch.Tensor:
    """A row's input (`field` 0) or target (1) as a tensor, or one line naming the row."""
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        what = "input" if field == 0 else "target"
        raise UserDatasetError(f"the {name} set's row {index}: its {what} is a "
                               f"{type(value).__name__}, not a tensor or a number "
                               f"({str(exc).splitlines()[0][:120] if str(exc) else ''})") from None


def _is_map_style(part: Any) -> bool:
    return hasattr(part, "__getitem__") and hasattr(part, "__len__") and not isinstance(
        part, (tuple, list, torch.Tensor))


def _tensor_pair(name: str, part: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if (not isinstance(part, (tuple, list)) or len(part) != 2
            or not all(isinstance(t, torch.Tensor) for t in part)):
        raise UserDatasetError(f"the {name} set must be a map-style torch Dataset or a pair of "
                               f"tensors (inputs, targets), got {type(part).__name__}")
    inputs, targets = part
    if len(inputs) != len(targets):
        raise UserDatasetError(f"the {name} set has {len(inputs)} inputs and {len(targets)} "
                               f"targets")
    if targets.ndim != 1 or not is_class_index(targets.dtype):
        raise UserDatasetError(f"the {name} targets must be class indices (integers, one per "
                               f"row), got {targets.dtype} of shape {tuple(targets.shape)}")
    return inputs, targets


def _split(made: Any) -> tuple[Any, Any]:
    """(train, val) from what the user's function returned."""
    if isinstance(made, Mapping):
        missing = [k for k in ("train", "val") if k not in made]
        if missing:
            raise UserDatasetError(f"returned a mapping without {' and '.join(missing)} (it "
                                   f"needs 'train' and 'val')")
        return made["train"], made["val"]
    if isinstance(made, (tuple, list)) and len(made) == 2:
        if all(isinstance(t, torch.Tensor) for t in made):
            raise UserDatasetError("returned one pair of tensors (inputs, targets): return "
                                   "(train, val), each a pair of tensors or a Dataset")
        return made[0], made[1]
    raise UserDatasetError(f"returned a {type(made).__name__}: return (train, val) or "
                           f"{{'train': ..., 'val': ...}}")


class TargetDataset:
    """The dataset plugin for `dataset._target_`: `spec()` and `load()` as the registered
    datasets have, over what the user's function returns (called once per instance)."""

    def __init__(self, factory: Callable[..., Any], target: str, **options: Any) -> None:
        self.factory, self.target, self.options = factory, target, options
        self._parts: tuple[Any, Any] | None = None
        self._spec: DatasetSpec | None = None

    def _made(self) -> tuple[Any, Any]:
        if self._parts is None:
            try:
                made = self.factory(**self.options)
            except UserDatasetError:
                raise
            except Exception as exc:  # the user's code: one line, what it raised
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise UserDatasetError(f"{self.target} raised {type(exc).__name__}"
                                       f"{': ' + first if first else ''}") from None
            train, val = _split(made)
            for name, part in (("train", train), ("val", val)):
                if not _is_map_style(part):
                    _tensor_pair(name, part)
                if len(_rows_of(part)) == 0:
                    raise UserDatasetError(f"the {name} set is empty")
            self._parts = (train, val)
        return self._parts

    def spec(self) -> DatasetSpec:
        """The data's shapes and sizes, worked out once (a map-style dataset's row 0 is read
        for them: a rank's reads are its own rows, that one and no more)."""
        if self._spec is None:
            self._spec = self._worked_out_spec()
        return self._spec

    def _worked_out_spec(self) -> DatasetSpec:
        train, val = self._made()
        if _is_map_style(train):
            first, _ = _item(train, 0)
            sample = _as_tensor(first, "train", 0, 0)
            _refuse_input_type("the train set's row 0", sample)
            classes = _declared(train, "num_classes") or _class_list(train)
            if classes is None:
                raise UserDatasetError("the training Dataset says nothing of its classes: give "
                                       "it a `num_classes` attribute (or a `classes` list); "
                                       "gridrun reads only the rows each rank needs, so it "
                                       "does not scan them")
            vocab = _declared(train, "vocab_size")
        else:
            inputs, targets = _tensor_pair("train", train)
            _refuse_input_type("the train set's row 0", inputs)
            sample = inputs[0]
            val_targets = _tensor_pair("val", val)[1] if not _is_map_style(val) else targets
            classes = _declared(train, "num_classes") or _inferred_classes(targets,
                                                                          val_targets)
            vocab = _declared(train, "vocab_size")
            if vocab is None and not inputs.is_floating_point():
                vocab = int(inputs.max()) + 1
        if not sample.is_floating_point() and vocab is None:
            raise UserDatasetError("the inputs are integers (token ids) but the training "
                                   "Dataset has no `vocab_size` attribute")
        vocab = vocab if not sample.is_floating_point() else None
        return DatasetSpec(tuple(sample.shape), classes, len(_rows_of(train)),
                           len(_rows_of(val)), vocab_size=vocab)

    def check(self) -> None:
        """What the head checks of the data before any rank starts (`check_rows`); a rank
        checks tensors again as it loads them, and a map-style dataset's rows as it reads
        them (`LazyRows`)."""
        spec = self.spec()
        for name, part in zip(("train", "val"), self._made(), strict=True):
            check_rows(name, part, spec.input_shape, spec.num_classes, spec.vocab_size)

    def load(self) -> ClassificationData:
        train, val = self._made()
        spec = self.spec()
        data = ClassificationData(*_columns(train, "train", spec), *_columns(val, "val", spec))
        try:  # the tensors, whole (the user's function may give a rank other data)
            check_loaded(data, spec)
        except DatasetError as exc:
            raise UserDatasetError(str(exc)) from None
        return data


# Rows of a map-style dataset read in the head to check it (the first, the last and some
# between): a dataset is read lazily by the ranks, and the head never reads it whole.
SAMPLED_ROWS = 16


def sampled_rows(length: int) -> list[int]:
    """Which rows of a map-style dataset of `length` rows the head reads."""
    if length <= SAMPLED_ROWS:
        return list(range(length))
    step = (length - 1) / (SAMPLED_ROWS - 1)
    return sorted({round(i * step) for i in range(SAMPLED_ROWS)})


def _inferred_classes(*labels: torch.Tensor) -> int:
    """The class count of labels 0..K-1 (K = the largest + 1). Labels that leave most of that
    range unused are not class indices (a label of 10^9 would ask for 10^9 output scores):
    `UserDatasetError` asks for the count instead."""
    every = torch.cat([t.reshape(-1) for t in labels])
    largest, used = int(every.max()), int(torch.unique(every).numel())
    if largest + 1 > 2 * used + 16:
        raise UserDatasetError(f"the labels reach {largest} but take only {used} values: "
                               f"class indices lie in [0, number of classes); map them to "
                               f"0..{used - 1}, or give the training Dataset a `num_classes` "
                               f"attribute")
    return largest + 1


def check_rows(name: str, part: Any, shape: tuple[int, ...], classes: int,
               vocab: int | None = None) -> None:
    """The `name` set keeps the contract before any rank reads it: rows, each input of `shape`
    (the training set's), real and finite (or token ids below `vocab`), targets class indices
    in [0, `classes`). Tensors are checked whole; a map-style dataset on `sampled_rows`, and
    the error says it was a sample."""
    if _is_map_style(part):
        rows = sampled_rows(len(part))
        where = f" (read in the head: rows {rows[0]}..{rows[-1]}, {len(rows)} of {len(part)})"
        for index in rows:
            x, y = (_as_tensor(value, name, index, field)
                    for field, value in enumerate(_item(part, index, name)))
            if tuple(x.shape) != shape:
                raise UserDatasetError(f"the {name} set's row {index} has inputs of shape "
                                       f"{tuple(x.shape)}, the training set's are {shape}")
            problem = (inputs_problem(x.unsqueeze(0), vocab)
                       or targets_problem(y.reshape(1, -1), classes))
            if problem is not None:
                raise UserDatasetError(f"the {name} set's row {index}: {problem[1]}{where}")
        return
    inputs, targets = _tensor_pair(name, part)
    if tuple(inputs.shape[1:]) != shape:
        raise UserDatasetError(f"the {name} set has inputs of shape {tuple(inputs.shape[1:])}, "
                               f"the training set's are {shape}")
    problem = inputs_problem(inputs, vocab) or targets_problem(targets, classes)
    if problem is not None:
        raise UserDatasetError(f"the {name} set's row {problem[0]}: {problem[1]}")


def _refuse_input_type(where: str, inputs: torch.Tensor) -> None:
    """Inputs that are neither real numbers nor token ids (complex, bool), refused by name."""
    problem = dtype_problem(inputs, inputs=True)
    if problem is not None:
        raise UserDatasetError(f"{where}: {problem}")


def _rows_of(part: Any) -> Any:
    return part if _is_map_style(part) else part[0]


def _columns(part: Any, name: str, spec: DatasetSpec) -> tuple[Any, Any]:
    """Inputs and targets: the tensors themselves, or lazy views of a map-style dataset that
    check the rows they read against `spec`."""
    if not _is_map_style(part):
        return part[0], part[1]
    shared: dict[int, tuple[Any, Any]] = {}
    return (LazyRows(part, 0, shared, name=name, limit=spec.vocab_size,
                     shape=spec.input_shape),
            LazyRows(part, 1, shared, torch.long, name=name, limit=spec.num_classes))


def _declared(dataset: Any, name: str) -> int | None:
    value = getattr(dataset, name, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _class_list(dataset: Any) -> int | None:
    classes = getattr(dataset, "classes", None)
    return len(classes) if isinstance(classes, (list, tuple)) and classes else None
