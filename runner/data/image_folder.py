"""`dataset=image_folder`: images in class folders, `ROOT/<class>/<image>`, decoded with PIL as
each batch is read.

Class names are the sorted sub-folder names of ROOT (or `classes`, in label order); label i is
the i-th. A rank lists the folders and decodes only the images of the rows it reads: resize (the
shorter side to `resize`), crop a `size` x `size` square (random when training, centred for
validation), flip left-right at random (training), scale to [0, 1] and normalise per channel.
The random crop and flip of a sample are drawn from a generator seeded by (`seed`, epoch,
index) (`runner.data.rows.augmentation_seed`), so a read is a pure function of the index and
the epoch: a resumed run, another grid or any number of reader threads see the same pixels.

Validation is `val_root` (the same class folders) or a `val_fraction` of each class held out by
a fixed seeded split (the same whatever the run's seed). The head's `check` lists both sets and
decodes a sample of each; a file a rank meets later that is no image raises `DataFileError`
naming it. Nothing in a class folder is skipped but hidden files: a file whose extension is no
image's is refused by name.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from runner.config.registry import register_dataset
from runner.data.rows import DataFileError, augmentation_seed, source_data
from runner.zoo.datasets import ClassificationData, DatasetSpec

if TYPE_CHECKING:
    import numpy as np

# What PIL decodes, by extension (compared in lower case).
IMAGE_EXTENSIONS = (".bmp", ".gif", ".jpeg", ".jpg", ".pbm", ".pgm", ".png", ".pnm", ".ppm",
                    ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_SPLIT_SEED = 0  # the held-out split and the validation order, whatever the run's seed
_NAMES_SHOWN = 5  # folder names quoted in one message, at most


def is_image_name(name: str) -> bool:
    """Whether a file's name has an image's extension."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


class _Names:
    """Paths relative to a set's root, held as one bytes string and its offsets: about 30 bytes
    a file where a list of str takes over 100 (a million images, on every rank)."""

    def __init__(self, names: Sequence[str]) -> None:
        encoded = [os.fsencode(name) for name in names]
        self._blob = b"".join(encoded)
        self._ends = array("q", itertools.accumulate((len(e) for e in encoded), initial=0))

    def __len__(self) -> int:
        return len(self._ends) - 1

    def __getitem__(self, index: int) -> str:
        return os.fsdecode(self._blob[self._ends[index]:self._ends[index + 1]])


@dataclass(frozen=True)
class _Transform:
    size: int
    resize: int | None
    random_crop: bool
    flip: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


class ImageRows:
    """One set's images as a `RowSource`: row i is the i-th file and its class. `augment`: the
    training set's random crop and flip (keyed on `seed`, the epoch and the row); without it a
    read is the centred crop whatever the epoch (validation, and the head's check). Holds no
    mutable state: reads from several threads at once are safe."""

    def __init__(self, root: Path, names: _Names, labels: torch.Tensor, transform: _Transform,
                 augment: bool, seed: int) -> None:
        self.root, self.names, self.labels = root, names, labels
        self.transform, self.augment, self.seed = transform, augment, seed
        self._mean = torch.tensor(transform.mean, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(transform.std, dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.names)

    def input_is_floating(self) -> bool:
        return True

    def path(self, index: int) -> Path:
        return self.root / self.names[index]

    def read(self, indices: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np

        rows = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        size = self.transform.size
        # the batch's crops as bytes, then one conversion and normalisation for all of them:
        # per image, only decoding and a copy (the Python a reader thread holds the GIL for is
        # what the step's own thread waits on)
        pixels = np.empty((len(rows), size, size, 3), dtype=np.uint8)
        for i, index in enumerate(rows.tolist()):
            if not 0 <= index < len(self):
                raise IndexError(f"row {index} of an image set of {len(self)} rows")
            pixels[i] = self.crop(index, epoch)
        return self._normalised(pixels), self.labels[rows]

    def image(self, index: int, epoch: int) -> torch.Tensor:
        """Row `index` as drawn in `epoch`: (3, size, size) float32, normalised."""
        import numpy as np

        return self._normalised(np.array(self.crop(index, epoch)[None]))[0]  # a writable copy

    def _normalised(self, pixels: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).to(torch.float32)
        return x.div_(255.0).sub_(self._mean).div_(self._std).contiguous()

    def crop(self, index: int, epoch: int) -> np.ndarray:
        """Row `index` as drawn in `epoch`, cropped (and flipped): (size, size, 3) uint8. The
        crop's offsets and the flip are bits of the sample's augmentation seed (a hash of the
        seed, the epoch and the index: no generator state)."""
        path, t = self.path(index), self.transform
        pixels = decode(path, t.resize)
        height, width = pixels.shape[:2]
        if height < t.size or width < t.size:
            raise DataFileError(f"{path}: {width}x{height} pixels, smaller than dataset.size="
                                f"{t.size} (give dataset.resize to scale images up)")
        top, left, flip = (height - t.size) // 2, (width - t.size) // 2, False
        if self.augment and (t.random_crop or t.flip):
            bits = augmentation_seed(self.seed, epoch, index)
            if t.random_crop:  # 20 bits each: a bias below 1e-4 for any image under 100 px
                top = (bits & 0xFFFFF) % (height - t.size + 1)
                left = ((bits >> 20) & 0xFFFFF) % (width - t.size + 1)
            if t.flip:
                flip = bool((bits >> 40) & 1)
        crop = pixels[top:top + t.size, left:left + t.size]
        return crop[:, ::-1] if flip else crop


def decode(path: Path, resize: int | None) -> np.ndarray:
    """The image at `path` as RGB (height, width, 3) uint8, its shorter side scaled to `resize`
    (bilinear; the longer in proportion, rounded down), or as stored (None). `DataFileError`
    naming the file when PIL cannot read it."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            shape = _resized(opened.size, resize)
            if shape is not None and opened.format == "JPEG":
                # JPEG decodes at 1/2, 1/4 or 1/8 scale in its transform (no larger than
                # needed, never smaller than `shape`): 2-4x less decoding for a downscale
                opened.draft("RGB", shape)
            image = opened.convert("RGB")  # decodes the whole file: damage shows here
        if shape is not None and shape != image.size:
            image = image.resize(shape, Image.Resampling.BILINEAR)
        return np.asarray(image, dtype=np.uint8)
    except UnidentifiedImageError:
        raise DataFileError(f"{path}: not an image PIL can read (unknown format, or not an "
                            f"image at all)") from None
    except OSError as exc:
        if exc.strerror and exc.filename is not None:  # the file itself: gone, no permission
            raise DataFileError(f"{path}: cannot be read: {exc.strerror}") from None
        raise DataFileError(f"{path}: cannot be decoded: {_first_line(exc)}") from None
    except Exception as exc:  # PIL's decoders raise many kinds on damaged data: all this file's
        raise DataFileError(f"{path}: cannot be decoded: {type(exc).__name__}: "
                            f"{_first_line(exc)}") from None


def _resized(size: tuple[int, int], resize: int | None) -> tuple[int, int] | None:
    """(width, height) with the shorter side `resize`, the longer in proportion (rounded
    down); None: kept as stored."""
    if resize is None:
        return None
    width, height = size
    short, long = min(width, height), max(width, height)
    scaled = max(1, long * resize // short)
    return (resize, scaled) if width <= height else (scaled, resize)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _shown(names: Sequence[str]) -> str:
    """Some names, for a message: the first few, and how many more."""
    more = len(names) - _NAMES_SHOWN
    return ", ".join(names[:_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _directory(path: Path, option: str) -> Path:
    if not path.exists():
        raise DataFileError(f"{option}={path}: no such directory")
    if not path.is_dir():
        raise DataFileError(f"{option}={path}: not a directory (the layout is "
                            f"{option}/<class>/<image>)")
    return path


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    """A folder's entries but hidden ones, by name."""
    try:
        with os.scandir(folder) as listing:
            return sorted((e for e in listing if not e.name.startswith(".")),
                          key=lambda e: e.name)
    except OSError as exc:
        raise DataFileError(f"{folder}: cannot be listed: {exc.strerror}") from None


def class_folders(root: Path, option: str) -> list[str]:
    """The sorted names of `root`'s sub-folders (hidden ones aside). An image directly in
    `root` belongs to no class: refused by name; other files there (a licence, a list of
    labels) are no data of a class and are left alone."""
    folders = []
    for entry in _entries(root):
        if entry.is_dir():
            folders.append(entry.name)
        elif is_image_name(entry.name):
            raise DataFileError(f"{entry.path}: an image outside any class folder (the layout "
                                f"is {option}/<class>/<image>)")
    return folders


def images_in(folder: Path) -> list[str]:
    """The images under a class folder, at any depth, as sorted paths relative to it. Hidden
    files and folders are ignored; any other file that is not an image by its extension is
    refused by name (nothing is skipped silently)."""
    found: list[str] = []
    seen = {os.path.realpath(folder)}
    pending = [""]
    while pending:
        relative = pending.pop()
        for entry in _entries(folder / relative):
            name = f"{relative}/{entry.name}" if relative else entry.name
            if entry.is_dir():
                real = os.path.realpath(entry.path)
                if real in seen:  # a link back to a folder listed already: a loop
                    raise DataFileError(f"{entry.path}: a link to a folder already listed "
                                        f"({real})")
                seen.add(real)
                pending.append(name)
            elif not entry.is_file():
                raise DataFileError(f"{entry.path}: not a file nor a folder (a broken link?)")
            elif not is_image_name(entry.name):
                raise DataFileError(f"{entry.path}: not an image by its extension; a class "
                                    f"folder holds images only ({' '.join(IMAGE_EXTENSIONS)}), "
                                    f"hidden files aside")
            else:
                found.append(name)
    return sorted(found)


@dataclass(frozen=True)
class _Listing:
    classes: tuple[str, ...]
    train: tuple[list[str], list[int]]  # paths relative to root, and their labels
    val: tuple[list[str], list[int]]  # relative to val_root (or root), and their labels


def _held_out(count: int, fraction: float, class_name: str) -> list[int]:
    """Which of a class's `count` sorted files validate: round(count x fraction), at most all
    but one, drawn by a generator seeded by the class's name (so a class's split is the same
    whatever other classes there are)."""
    held = min(round(count * fraction), count - 1)
    seed = _SPLIT_SEED ^ zlib.crc32(os.fsencode(class_name))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return sorted(order[:held].tolist())


@register_dataset("image_folder")
class ImageFolder:
    """Images in class folders, `root/<class>/<image>` (any format PIL decodes), read by each
    rank as its batches need them. See docs/data_image_folder.md."""

    def __init__(self, root: str | None = None, val_root: str | None = None,
                 val_fraction: float = 0.1, size: int = 224, resize: int | None = 256,
                 flip: bool = True, random_crop: bool = True,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 seed: int = 0, classes: Sequence[str] | None = None) -> None:
        problems = []
        if root is None or not str(root).strip():
            problems.append("dataset.root is required: the folder of class folders, "
                            "ROOT/<class>/<image>")
        if val_root is not None and not str(val_root).strip():
            problems.append("dataset.val_root must be null or a folder of the same class folders")
        if val_root is None and not (_is_real(val_fraction) and 0.0 < val_fraction < 1.0):
            problems.append(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        if not _is_int(size) or size < 1:
            problems.append(f"dataset.size must be an integer >= 1, got {size}")
        elif resize is not None and (not _is_int(resize) or resize < size):
            problems.append(f"dataset.resize must be null or an integer >= dataset.size "
                            f"({size}), got {resize}")
        for name, value in (("flip", flip), ("random_crop", random_crop)):
            if not isinstance(value, bool):
                problems.append(f"dataset.{name} must be true or false, got {value}")
        for name, values in (("mean", mean), ("std", std)):
            numbers = list(values) if _is_sequence(values) else []
            if len(numbers) != 3 or not all(_is_real(v) and math.isfinite(v) for v in numbers) or (
                    name == "std" and not all(v > 0 for v in numbers)):
                wanted = "3 numbers > 0" if name == "std" else "3 numbers"
                problems.append(f"dataset.{name} must be {wanted} (red, green, blue), got "
                                f"{_listed(values)}")
        if not _is_int(seed):
            problems.append(f"dataset.seed must be an integer, got {seed}")
        if classes is not None:
            names = [str(c) for c in classes] if _is_sequence(classes) else []
            if (len(names) < 2 or len(set(names)) < len(names) or
                    any(not n or n.startswith(".") or "/" in n or n == ".." for n in names)):
                problems.append(f"dataset.classes must be null or >= 2 distinct folder names "
                                f"(label i is the i-th), got {_listed(classes)}")
        if problems:
            raise ValueError("; ".join(problems))
        self.root = Path(str(root)).expanduser()
        self.val_root = None if val_root is None else Path(str(val_root)).expanduser()
        self.val_fraction, self.seed = float(val_fraction), int(seed)
        self.transform = _Transform(int(size), None if resize is None else int(resize),
                                    random_crop, flip, _triple(mean), _triple(std))
        self.classes = None if classes is None else tuple(str(c) for c in classes)
        self._listed: _Listing | None = None

    # -- what the folders hold (listed once per process, nothing decoded) -------------------

    def _classes_in(self, root: Path, option: str) -> list[str]:
        if self.classes is None:
            return class_folders(root, option)
        missing = [name for name in self.classes if not (root / name).is_dir()]
        if missing:
            raise DataFileError(f"{option}={root}: dataset.classes names "
                                f"{_shown(missing)}, but {root / missing[0]} is no folder")
        return list(self.classes)

    def _images(self, root: Path, classes: Sequence[str]) -> list[list[str]]:
        """Each class's images, paths relative to `root`; a class without any refused."""
        per_class = []
        for name in classes:
            found = images_in(root / name)
            if not found:
                raise DataFileError(f"{root / name}: a class folder without images (hidden "
                                    f"files are ignored)")
            per_class.append([f"{name}/{image}" for image in found])
        return per_class

    def listing(self) -> _Listing:
        """Both sets' files and labels, and the class names (in label order)."""
        if self._listed is None:
            self._listed = self._list()
        return self._listed

    def _list(self) -> _Listing:
        root = _directory(self.root, "dataset.root")
        classes = self._classes_in(root, "dataset.root")
        if len(classes) < 2:
            raise DataFileError(f"dataset.root={root}: {len(classes)} class folder"
                                f"{'' if len(classes) == 1 else 's'}"
                                f"{f' ({_shown(classes)})' if classes else ''}; an image folder "
                                f"needs at least 2: ROOT/<class>/<image>")
        per_class = self._images(root, classes)
        if self.val_root is not None:
            val_root = _directory(self.val_root, "dataset.val_root")
            val_classes = self._classes_in(val_root, "dataset.val_root")
            if val_classes != classes:
                missing = [c for c in classes if c not in val_classes]
                extra = [c for c in val_classes if c not in classes]
                differences = ([f"it lacks {_shown(missing)}"] if missing else []) + (
                    [f"it has {_shown(extra)}, which dataset.root has not"] if extra else [])
                raise DataFileError(f"dataset.val_root={val_root}: its class folders are not "
                                    f"dataset.root's: {'; '.join(differences)} (labels are the "
                                    f"folders' sorted names: both sets need the same)")
            train = [(path, label) for label, paths in enumerate(per_class) for path in paths]
            val = [(path, label) for label, paths in enumerate(self._images(val_root, classes))
                   for path in paths]
        else:
            train, val = [], []
            for label, (name, paths) in enumerate(zip(classes, per_class, strict=True)):
                held = set(_held_out(len(paths), self.val_fraction, name))
                for i, path in enumerate(paths):
                    (val if i in held else train).append((path, label))
            if not val:
                raise DataFileError(f"dataset.val_fraction={self.val_fraction} holds out no "
                                    f"image of {len(train)} in {len(classes)} classes (rounded "
                                    f"per class): raise it, or give dataset.val_root")
        # validation in a fixed shuffled order: trainer.eval_samples=N scores every class
        order = torch.randperm(len(val), generator=torch.Generator().manual_seed(_SPLIT_SEED))
        val = [val[i] for i in order.tolist()]
        return _Listing(tuple(classes), ([p for p, _ in train], [y for _, y in train]),
                        ([p for p, _ in val], [y for _, y in val]))

    def sources(self) -> tuple[ImageRows, ImageRows]:
        """The training source (augmented) and the validation source (never)."""
        listed = self.listing()
        val_root = self.root if self.val_root is None else self.val_root

        def rows(root: Path, files: tuple[list[str], list[int]], augment: bool) -> ImageRows:
            return ImageRows(root, _Names(files[0]), torch.tensor(files[1], dtype=torch.long),
                             self.transform, augment, self.seed)

        return rows(self.root, listed.train, True), rows(val_root, listed.val, False)

    # -- the dataset plugin's contract --------------------------------------------------------

    def class_names(self) -> tuple[str, ...]:
        return self.listing().classes

    def spec(self) -> DatasetSpec:
        listed, size = self.listing(), self.transform.size
        return DatasetSpec((3, size, size), len(listed.classes), len(listed.train[0]),
                           len(listed.val[0]))

    def load(self) -> ClassificationData:
        # lists the folders only: each image is decoded when a batch reads it
        return source_data(*self.sources())

    def check(self) -> None:
        """The head's check, once before any rank starts: the folders' layout (listing), then
        a sample of each set's images decoded and transformed as a rank will."""
        from runner.zoo.userdata import sampled_rows

        for source in self.sources():
            for index in sampled_rows(len(source)):
                source.image(index, 0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _listed(value: Any) -> Any:
    return list(value) if _is_sequence(value) else value


def _triple(values: Sequence[float]) -> tuple[float, float, float]:
    first, second, third = (float(v) for v in values)
    return first, second, third
