"""Datasets: real (scikit-learn's bundled 8×8 digits) and synthetic (seeded, sized by config):
images or feature vectors, and token documents with Zipf–Mandelbrot word frequencies.

Every rank loads the same tensors; a strategy picks its samples of each global batch. Nothing is
downloaded: digits ships inside scikit-learn, and is read from its data file without importing
scikit-learn (whose import pulls in scipy and costs every rank seconds at start-up).
"""

from __future__ import annotations

import gzip
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from runner.config.registry import register_dataset

_SPLIT_SEED = 0  # the train/val split is fixed, whatever the run's seed


@dataclass(frozen=True)
class DatasetSpec:
    input_shape: tuple[int, ...]
    num_classes: int
    train_size: int
    val_size: int
    vocab_size: int | None = None  # token datasets: samples are int64 token ids below this
    padding_id: int | None = None  # the id that fills short documents (no word)
    # A sample's targets: () one class; (T,) a class per position (next-token: the token ids
    # that follow each position, `num_classes` the vocabulary)
    target_shape: tuple[int, ...] = ()


@dataclass
class ClassificationData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


class DatasetError(ValueError):
    """A dataset's rows do not keep the contract: one line naming the row and the value."""


def is_class_index(dtype: torch.dtype) -> bool:
    """Whether values of `dtype` are class indices: integers (a bool is a truth value)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def dtype_problem(values: torch.Tensor, inputs: bool) -> str | None:
    """What is wrong with the type of a row's inputs (complex, bool) or targets (not an
    integer), named with its first value."""
    first = values.reshape(-1)[0].item() if values.numel() else None
    if inputs and (values.is_complex() or values.dtype == torch.bool):
        return (f"input {first} is a {values.dtype}: inputs are real numbers (features) or "
                f"integers (token ids)")
    if not inputs and not is_class_index(values.dtype):
        return f"target {first} is a {values.dtype}, not a class index (an integer)"
    return None


def targets_problem(targets: torch.Tensor, classes: int) -> tuple[int, str] | None:
    """The first row of `targets` (one or more per row) with a target that is no class index
    in [0, `classes`), and what it is; None: every one is. Vectorised: one pass."""
    problem = dtype_problem(targets, inputs=False)
    if problem is not None:
        return 0, problem
    flat = targets.reshape(len(targets), -1)
    outside = (flat < 0) | (flat >= classes)
    if not bool(outside.any()):
        return None
    row = int(outside.any(dim=1).nonzero()[0])
    value = int(flat[row][outside[row]][0])
    return row, f"target {value} is outside [0, {classes}) classes"


def inputs_problem(inputs: torch.Tensor, vocab: int | None = None) -> tuple[int, str] | None:
    """The first row of `inputs` with a value that is not finite (features), or a token id
    outside [0, `vocab`) (integers), and what it is; None: every one is fine. Vectorised."""
    problem = dtype_problem(inputs, inputs=True)
    if problem is not None:
        return 0, problem
    flat = inputs.reshape(len(inputs), -1)
    if inputs.is_floating_point():
        if bool(torch.isfinite(flat.sum())):  # a nan or an inf carries into the sum: no mask
            return None
        bad = ~torch.isfinite(flat)  # one is not finite, or the sum overflowed
        what = "input value {} is not finite"
    elif vocab is not None:
        bad = (flat < 0) | (flat >= vocab)
        what = f"token id {{}} is outside the vocabulary [0, {vocab})"
    else:
        return None
    if not bool(bad.any()):
        return None
    row = int(bad.any(dim=1).nonzero()[0])
    return row, what.format(flat[row][bad[row]][0].item())


def check_loaded(data: ClassificationData, spec: DatasetSpec,
                 label: str = "") -> ClassificationData:
    """`data` as loaded, having kept `spec`'s contract, each set checked whole in one
    vectorised pass (a user's map-style dataset, read lazily, checks each batch's rows as it
    reads them): `DatasetError` names the first row that does not, prefixed with `label`."""
    for name, inputs, targets in (("train", data.train_x, data.train_y),
                                  ("val", data.val_x, data.val_y)):
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            continue
        problem = (inputs_problem(inputs, spec.vocab_size)
                   or targets_problem(targets, spec.num_classes))
        if problem is not None:
            raise DatasetError(f"{label}the {name} set's row {problem[0]}: {problem[1]}")
    return data


def _split(x: torch.Tensor, y: torch.Tensor, val_size: int) -> ClassificationData:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    val, train = order[:val_size], order[val_size:]
    return ClassificationData(x[train], y[train], x[val], y[val])


def _val_size(samples: int, val_fraction: float) -> int:
    return round(samples * val_fraction)


def digits_file() -> Path:
    """scikit-learn's `datasets/data/digits.csv.gz`, found without importing scikit-learn
    (`find_spec` of a top-level package locates it without running its `__init__`)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("scikit-learn, whose bundled digits this dataset reads, is not "
                         "installed: pip install scikit-learn")
    for location in spec.submodule_search_locations:
        path = Path(location) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise ValueError(f"scikit-learn at {spec.origin} has no datasets/data/digits.csv.gz")


@register_dataset("digits")
class Digits:
    """scikit-learn's 1797 handwritten 8×8 digits, scaled to [0, 1], shaped (1, 8, 8)."""

    samples = 1797

    def __init__(self, val_fraction: float = 0.2) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = val_fraction

    def spec(self) -> DatasetSpec:
        digits_file()  # a missing scikit-learn is refused by the head, before any rank starts
        val = _val_size(self.samples, self.val_fraction)
        return DatasetSpec((1, 8, 8), 10, self.samples - val, val)

    def load(self) -> ClassificationData:
        # numpy is already loaded by torch; the parse is `sklearn.datasets.load_digits`'s own
        # (np.loadtxt of the gunzipped text, float64; the last column is the label), so the
        # tensors are bit-for-bit those built from load_digits() (tests/test_datasets.py).
        import numpy as np

        with gzip.open(digits_file(), mode="rt", encoding="utf-8") as text:
            data = np.loadtxt(text, delimiter=",")
        images = data[:, :-1].reshape(-1, 8, 8)
        target = data[:, -1].astype(int, copy=False)
        x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
        y = torch.tensor(target, dtype=torch.long)
        return check_loaded(_split(x, y, self.spec().val_size), self.spec(), "dataset=digits: ")


MAX_NOISE = 1e6  # beyond it the samples are noise alone (and float32 overflows near 1e38)


@register_dataset("synthetic")
class Synthetic:
    """Seeded classification data with learnable structure.

    Each class has a prototype; a sample is its class prototype plus Gaussian noise. For image
    shapes (C, H, W) prototypes are smooth patterns (upsampled coarse noise), so convolutions
    have spatial structure to find; for flat shapes they are random directions.
    """

    def __init__(self, shape: Sequence[int] = (64,), classes: int = 10, samples: int = 4096,
                 noise: float = 1.0, val_fraction: float = 0.2, seed: int = 0) -> None:
        self.shape = tuple(int(d) for d in shape)
        if not self.shape or any(d < 1 for d in self.shape):
            raise ValueError(f"dataset.shape must be positive sizes, got {list(shape)}")
        if classes < 2 or samples < classes:
            raise ValueError("dataset.classes must be >= 2 and dataset.samples >= classes")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        if not 0.0 <= noise <= MAX_NOISE:  # also NaN
            raise ValueError(f"dataset.noise={noise}: must be in [0, {MAX_NOISE:g}] (the noise's "
                             f"scale against prototypes of norm 1)")
        self.classes, self.samples, self.noise = classes, samples, noise
        self.val_fraction, self.seed = val_fraction, seed

    def spec(self) -> DatasetSpec:
        val = _val_size(self.samples, self.val_fraction)
        return DatasetSpec(self.shape, self.classes, self.samples - val, val)

    def load(self) -> ClassificationData:
        gen = torch.Generator().manual_seed(self.seed)
        if len(self.shape) == 3:
            c, h, w = self.shape
            coarse = torch.randn(self.classes, c, max(1, h // 4), max(1, w // 4), generator=gen)
            prototypes = F.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
        else:
            prototypes = torch.randn(self.classes, *self.shape, generator=gen)
        # Normalise prototypes so `noise` is a signal-to-noise knob independent of the shape.
        flat = prototypes.reshape(self.classes, -1)
        prototypes = (flat / flat.std(dim=1, keepdim=True)).reshape(prototypes.shape)
        y = torch.randint(0, self.classes, (self.samples,), generator=gen)
        x = prototypes[y] + self.noise * torch.randn(self.samples, *self.shape, generator=gen)
        return check_loaded(_split(x, y, self.spec().val_size), self.spec(),
                            "dataset=synthetic: ")


def zipf_mandelbrot(size: int, exponent: float, shift: float) -> torch.Tensor:
    """p(k) ∝ 1 / (k + shift)^exponent for ranks k = 1..size (float64, sums to 1): word
    frequencies in natural text (Mandelbrot's refinement of Zipf's law)."""
    ranks = torch.arange(1, size + 1, dtype=torch.float64)
    weights = (ranks + shift).pow(-exponent)
    return weights / weights.sum()


@register_dataset("tokens")
class ZipfTokens:
    """Documents of `seq_len` token ids from a vocabulary of `vocab_size`, id = frequency rank.

    A document of class c draws each token from a shared background with probability
    1 − `topic_share`, else from its class's topic. Both follow the Zipf–Mandelbrot law; the
    background ranks the ids in order (id 0 the most frequent), each topic ranks them in its own
    seeded shuffle. So a batch touches a few hot rows of the embedding table often and a long
    tail rarely, as text does, and the topic words make the class learnable.
    """

    def __init__(self, vocab_size: int = 10000, seq_len: int = 32, classes: int = 4,
                 samples: int = 8192, exponent: float = 1.1, shift: float = 2.7,
                 topic_share: float = 0.3, val_fraction: float = 0.2, seed: int = 0) -> None:
        problems = []
        if vocab_size < 2:
            problems.append(f"dataset.vocab_size must be >= 2, got {vocab_size}")
        if seq_len < 1:
            problems.append(f"dataset.seq_len must be >= 1, got {seq_len}")
        if classes < 2 or samples < classes:
            problems.append("dataset.classes must be >= 2 and dataset.samples >= classes")
        if exponent <= 0 or shift < 0:
            problems.append(f"dataset.exponent must be > 0 and dataset.shift >= 0, got "
                            f"{exponent} and {shift}")
        if not 0.0 <= topic_share <= 1.0:
            problems.append(f"dataset.topic_share must be in [0, 1], got {topic_share}")
        if not 0.0 < val_fraction < 1.0:
            problems.append(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        if problems:
            raise ValueError("; ".join(problems))
        self.vocab_size, self.seq_len, self.classes, self.samples = (vocab_size, seq_len,
                                                                     classes, samples)
        self.exponent, self.shift, self.topic_share = exponent, shift, topic_share
        self.val_fraction, self.seed = val_fraction, seed
        self._probabilities: torch.Tensor | None = None

    def spec(self) -> DatasetSpec:
        val = _val_size(self.samples, self.val_fraction)
        return DatasetSpec((self.seq_len,), self.classes, self.samples - val, val,
                           vocab_size=self.vocab_size)

    def token_probabilities(self) -> torch.Tensor:
        """(classes, vocab_size): the probability of each token id in a document of each class
        (computed once: the planner asks for every sparse mode)."""
        if self._probabilities is None:
            self._probabilities = self._token_probabilities()
        return self._probabilities

    def _token_probabilities(self) -> torch.Tensor:
        law = zipf_mandelbrot(self.vocab_size, self.exponent, self.shift)
        gen = torch.Generator().manual_seed(self.seed)
        topics = torch.stack([law[torch.argsort(torch.randperm(self.vocab_size, generator=gen))]
                              for _ in range(self.classes)])
        return (1 - self.topic_share) * law + self.topic_share * topics

    def load(self) -> ClassificationData:
        probabilities = self.token_probabilities()
        gen = torch.Generator().manual_seed(self.seed + 1)
        y = torch.randint(0, self.classes, (self.samples,), generator=gen)
        x = torch.empty(self.samples, self.seq_len, dtype=torch.long)
        for c in range(self.classes):
            members = torch.nonzero(y == c).flatten()
            draws = torch.multinomial(probabilities[c].float(), len(members) * self.seq_len,
                                      replacement=True, generator=gen)
            x[members] = draws.view(len(members), self.seq_len)
        return check_loaded(_split(x, y, self.spec().val_size), self.spec(), "dataset=tokens: ")

    def next_token(self) -> NextTokens:
        """The same documents, one token longer, as next-token targets: inputs a document's
        first `seq_len` tokens, targets its last `seq_len` (each position's next token)."""
        longer = ZipfTokens(self.vocab_size, self.seq_len + 1, self.classes, self.samples,
                            self.exponent, self.shift, self.topic_share, self.val_fraction,
                            self.seed)
        return NextTokens(longer, self.seq_len)

    def expected_unique_tokens(self, samples: int) -> float:
        """The expected number of distinct token ids in `samples` documents of random classes:
        Σ_v 1 − (mean_c (1 − p_cv)^seq_len)^samples. What one rank's batch touches of the
        embedding table, for the planner."""
        absent_from_one = (1 - self.token_probabilities()).pow(self.seq_len).mean(dim=0)
        return float((1 - absent_from_one.pow(samples)).sum())


class NextTokens:
    """A token dataset's documents of `seq_len` + 1 ids as next-token samples: inputs (N, T)
    the first T ids, targets (N, T) the ids one position later."""

    def __init__(self, documents: ZipfTokens, seq_len: int) -> None:
        self.documents, self.seq_len = documents, seq_len

    def spec(self) -> DatasetSpec:
        docs = self.documents.spec()
        assert docs.vocab_size is not None
        return DatasetSpec((self.seq_len,), docs.vocab_size, docs.train_size, docs.val_size,
                           vocab_size=docs.vocab_size, target_shape=(self.seq_len,))

    def load(self) -> ClassificationData:
        data = self.documents.load()
        return ClassificationData(data.train_x[:, :-1], data.train_x[:, 1:],
                                  data.val_x[:, :-1], data.val_x[:, 1:])

    def expected_unique_tokens(self, samples: int) -> float:
        return self.documents.expected_unique_tokens(samples)


CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
CIFAR10_RECORD = 1 + 3 * 32 * 32  # a label byte, then 1024 red, 1024 green, 1024 blue bytes
CIFAR10_TARBALL_DIR = "cifar-10-batches-bin"  # where cifar-10-binary.tar.gz unpacks its files
# The per-channel mean and standard deviation of the 50,000 training images' pixels (in
# [0, 1]): the published figures, used whatever `train_batches` and `limit` select, so a small
# run sees its images exactly as the full one does.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


@register_dataset("cifar10")
class Cifar10:
    """CIFAR-10 (Krizhevsky, 2009) from its binary version in a local directory (never
    downloaded): `data_batch_1.bin` … `data_batch_5.bin` train, `test_batch.bin` validates.
    Each file is a run of 3073-byte records: the label (0–9), then the 32×32 image's red, green
    and blue planes, row-major. `root` may also be the directory holding `cifar-10-batches-bin`
    (cifar-10-binary.tar.gz unpacked). Images (3, 32, 32) float32 in [0, 1], normalised per
    channel with the published training-set mean and standard deviation when `normalize`."""

    def __init__(self, root: str | None = None, train_batches: Sequence[int] = (1, 2, 3, 4, 5),
                 limit: int | None = None, normalize: bool = True,
                 classes: Sequence[str] = CIFAR10_CLASSES) -> None:
        problems = []
        if root is None or not str(root).strip():
            problems.append("dataset.root is required: the directory holding CIFAR-10's binary "
                            "files (data_batch_1.bin ... data_batch_5.bin, test_batch.bin, as "
                            "cifar-10-binary.tar.gz unpacks them); nothing is downloaded")
        batches = [int(b) for b in train_batches]
        if not batches or any(not 1 <= b <= 5 for b in batches) or len(set(batches)) < len(
                batches):
            problems.append(f"dataset.train_batches must be distinct numbers from 1 to 5, got "
                            f"{list(train_batches)}")
        if limit is not None and limit < 1:
            problems.append(f"dataset.limit must be null or >= 1, got {limit}")
        if len(classes) < 2 or len(set(classes)) < len(classes):
            problems.append(f"dataset.classes must be >= 2 distinct names (label i is the i-th), "
                            f"got {list(classes)}")
        if problems:
            raise ValueError("; ".join(problems))
        self.root = Path(str(root)).expanduser()
        self.train_batches, self.limit, self.normalize = batches, limit, normalize
        self.classes = tuple(str(c) for c in classes)

    def directory(self) -> Path:
        """`root`, or its `cifar-10-batches-bin` when the files are there."""
        if not self.root.is_dir():
            raise ValueError(f"dataset.root={self.root}: no such directory")
        nested = self.root / CIFAR10_TARBALL_DIR
        if not (self.root / "test_batch.bin").exists() and nested.is_dir():
            return nested
        return self.root

    def _records(self, name: str) -> tuple[Path, int]:
        """A file of the dataset and its number of records; ValueError naming it when it is
        missing or not a whole number of records."""
        directory = self.directory()
        path = directory / name
        if not path.is_file():
            where = (f"{self.root} or {self.root / CIFAR10_TARBALL_DIR}" if directory == self.root
                     else str(directory))
            raise ValueError(f"dataset.root={self.root}: CIFAR-10 file {name} is missing (looked "
                             f"in {where})")
        size = path.stat().st_size
        if size == 0 or size % CIFAR10_RECORD:
            raise ValueError(f"dataset.root={self.root}: {path} has {size} bytes, not a whole "
                             f"number of {CIFAR10_RECORD}-byte CIFAR-10 records (a truncated "
                             f"or foreign file)")
        return path, size // CIFAR10_RECORD

    def _train_files(self) -> list[tuple[Path, int]]:
        """The training files and how many records of each are used (`limit`)."""
        used, left = [], self.limit
        for batch in self.train_batches:
            path, records = self._records(f"data_batch_{batch}.bin")
            take = records if left is None else min(records, left)
            if take:
                used.append((path, take))
            if left is not None:
                left -= take
        return used

    def spec(self) -> DatasetSpec:
        # sizes from the files' lengths: the head checks every file without reading it
        train = sum(take for _, take in self._train_files())
        _, val = self._records("test_batch.bin")
        return DatasetSpec((3, 32, 32), len(self.classes), train, val)

    def _read(self, files: list[tuple[Path, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np

        chunks = [np.fromfile(path, dtype=np.uint8, count=take * CIFAR10_RECORD).reshape(
            take, CIFAR10_RECORD) for path, take in files]
        for (path, _), chunk in zip(files, chunks, strict=True):
            if chunk.size and int(chunk[:, 0].max()) >= len(self.classes):
                raise DatasetError(f"dataset.root={self.root}: {path} has label "
                                 f"{int(chunk[:, 0].max())}, but dataset.classes names "
                                 f"{len(self.classes)} classes")
        records = np.concatenate(chunks)
        y = torch.from_numpy(records[:, 0].astype(np.int64))
        x = torch.from_numpy(np.ascontiguousarray(records[:, 1:])).view(-1, 3, 32, 32)
        x = x.to(torch.float32).div_(255.0)
        if self.normalize:
            mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
            std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
            x = x.sub_(mean).div_(std)
        return x, y

    def load(self) -> ClassificationData:
        train_x, train_y = self._read(self._train_files())
        val_x, val_y = self._read([self._records("test_batch.bin")])
        return check_loaded(ClassificationData(train_x, train_y, val_x, val_y), self.spec(),
                            f"dataset.root={self.root}: ")
