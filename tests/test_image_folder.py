"""dataset=image_folder: class folders of images written here with PIL. Units: what the folders
list, reads as a pure function of (index, epoch), threads, the pixels against a hand
computation. The head's one-line refusals of bad folders, and real ranks: a grid trains what
one process trains and resumes it exactly, and a damaged file a rank meets ends the run with one
line naming it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.config.registry import DATASETS, load_plugins
from runner.data.image_folder import IMAGENET_MEAN, IMAGENET_STD, ImageFolder
from runner.data.rows import DataFileError, source_of
from runner.zoo.datasets import DatasetSpec
from runner.zoo.userdata import sampled_rows
from tests.conftest import (
    assert_ok,
    read_metrics,
    read_summary,
    run_cli,
    run_cli_together,
    train_losses,
)

CLASSES = ("ant", "bee", "cow")
PER_CLASS = 12
SMALL = {"size": 16, "resize": 18}  # quick reads: 16x16 crops of images scaled to 18 px


def write_images(root: Path, classes: tuple[str, ...] = CLASSES, per_class: int = PER_CLASS,
                 seed: int = 0) -> Path:
    """`per_class` images of 20x24 or 24x20 per class folder, class-coloured with noise, PNG and
    every third one JPEG; a hidden file in the first folder (ignored)."""
    generator = np.random.default_rng(seed)
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True)
        colour = np.array([80 * label % 256, 255 - 60 * label, 40 + 70 * label]) % 256
        for i in range(per_class):
            shape = (20, 24, 3) if i % 2 else (24, 20, 3)
            noise = generator.integers(-40, 41, size=shape)
            pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
            suffix = ".jpg" if i % 3 == 2 else ".png"
            Image.fromarray(pixels).save(folder / f"{name}_{i:02d}{suffix}")
    (root / classes[0] / ".DS_Store").write_bytes(b"\0\1")
    return root


@pytest.fixture
def images(tmp_path: Path) -> Path:
    return write_images(tmp_path / "images")


# -- units ----------------------------------------------------------------------------------------

def test_the_spec_lists_classes_and_sizes_without_decoding(images: Path, tmp_path: Path) -> None:
    load_plugins()
    assert DATASETS.get("image_folder") is ImageFolder
    dataset = ImageFolder(root=str(images), **SMALL)
    # 12 per class, round(1.2) = 1 held out of each
    assert dataset.spec() == DatasetSpec((3, 16, 16), 3, 33, 3)
    assert dataset.class_names() == CLASSES
    train, val = dataset.sources()
    assert sorted(train.labels.tolist()) == [0] * 11 + [1] * 11 + [2] * 11
    assert sorted(val.labels.tolist()) == [0, 1, 2]
    assert all(".DS_Store" not in train.names[i] for i in range(len(train)))
    # the held-out split is fixed: the augmentation's seed does not move it
    other = ImageFolder(root=str(images), seed=7, **SMALL).listing()
    assert other.val == dataset.listing().val and other.train == dataset.listing().train
    # explicit classes: a subset, in the order given
    chosen = ImageFolder(root=str(images), classes=["cow", "ant"], **SMALL)
    assert chosen.class_names() == ("cow", "ant") and chosen.spec().num_classes == 2
    cow = {name for name, label in zip(*chosen.listing().train, strict=True) if label == 0}
    assert cow and all(name.startswith("cow/") for name in cow)
    # a validation folder of the same classes
    val_root = write_images(tmp_path / "val", per_class=2, seed=1)
    separate = ImageFolder(root=str(images), val_root=str(val_root), **SMALL)
    assert separate.spec() == DatasetSpec((3, 16, 16), 3, 36, 6)
    assert str(separate.sources()[1].path(0)).startswith(str(val_root))
    # loading lists the files and builds the sources: the columns read them
    data = dataset.load()
    assert source_of(data.train_x) is not None and len(data.val_y) == 3
    assert data.train_x[torch.tensor([0, 5])].shape == (2, 3, 16, 16)


def test_nested_folders_hidden_entries_and_images_as_stored(tmp_path: Path) -> None:
    root = write_images(tmp_path / "images", per_class=2)
    (root / "ant" / "more").mkdir()
    Image.new("RGB", (30, 40), (9, 9, 9)).save(root / "ant" / "more" / "deep.bmp")
    for hidden in (root / ".cache", root / "bee" / ".thumbs"):
        hidden.mkdir()
        (hidden / "junk.txt").write_text("ignored")
    (root / "README.txt").write_text("beside the class folders: not a class's data")
    dataset = ImageFolder(root=str(root), val_fraction=0.5, size=20, resize=None)
    train, val = dataset.listing().train, dataset.listing().val
    assert "ant/more/deep.bmp" in train[0] + val[0] and len(train[0]) + len(val[0]) == 7
    dataset.check()  # images as stored: 20x24, 24x20 and 30x40 hold a 20x20 crop
    with pytest.raises(DataFileError, match=r"\.(png|jpg): 2[04]x2[04] pixels, smaller than "
                                            r"dataset.size=22 \(give dataset.resize"):
        ImageFolder(root=str(root), val_fraction=0.5, size=22, resize=None).check()
    Image.new("RGB", (8, 8)).save(root / "stray.png")
    with pytest.raises(DataFileError, match=f"^{root / 'stray.png'}: an image outside any class"):
        ImageFolder(root=str(root), size=20).spec()


def test_options_are_checked_together() -> None:
    with pytest.raises(ValueError) as raised:
        ImageFolder(size=0, val_fraction=1.5, mean=[0.5, 0.5], std=[1, 0, 1], flip="yes",
                    classes=["only"])
    message = str(raised.value)
    for said in ("dataset.root is required", "dataset.val_fraction must be in (0, 1), got 1.5",
                 "dataset.size must be", "dataset.mean must be 3 numbers",
                 "dataset.std must be 3 numbers > 0", "dataset.flip must be true or false",
                 "dataset.classes must be"):
        assert said in message
    assert "\n" not in message
    with pytest.raises(ValueError, match=r"dataset.resize must be null or an integer >= "):
        ImageFolder(root="x", size=32, resize=16)


def test_a_read_is_a_pure_function_of_index_and_epoch(images: Path) -> None:
    train, val = ImageFolder(root=str(images), **SMALL).sources()
    again, _ = ImageFolder(root=str(images), **SMALL).sources()
    rows = torch.arange(len(train))
    first, labels = train.read(rows, 3)
    assert first.dtype == torch.float32 and first.shape == (33, 3, 16, 16)
    assert labels.dtype == torch.int64 and torch.equal(labels, train.labels)
    assert torch.equal(first, again.read(rows, 3)[0])  # another reader, the same pixels
    assert torch.equal(first[[4, 1]], train.read(torch.tensor([4, 1]), 3)[0])  # any batch
    # another epoch draws other crops and flips (most samples differ)
    later = train.read(rows, 4)[0]
    assert sum(not torch.equal(a, b) for a, b in zip(first, later, strict=True)) > 25
    # another seed too
    seeded, _ = ImageFolder(root=str(images), seed=1, **SMALL).sources()
    assert not torch.equal(first, seeded.read(rows, 3)[0])
    # validation never augments: every epoch reads the centred crop
    val_rows = torch.arange(len(val))
    assert torch.equal(val.read(val_rows, 0)[0], val.read(val_rows, 9)[0])
    # nor does training without random crop and flip
    plain, _ = ImageFolder(root=str(images), flip=False, random_crop=False, **SMALL).sources()
    assert torch.equal(plain.read(rows, 0)[0], plain.read(rows, 5)[0])
    with pytest.raises(IndexError):
        train.read(torch.tensor([33]), 0)


def test_reads_from_four_threads_equal_serial_reads(images: Path) -> None:
    train, _ = ImageFolder(root=str(images), **SMALL).sources()
    batches = [(torch.randperm(33, generator=torch.Generator().manual_seed(i))[:8], i % 3)
               for i in range(12)]
    serial = [train.read(rows, epoch) for rows, epoch in batches]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda batch: train.read(*batch), batches))
    for (x, y), (tx, ty) in zip(serial, threaded, strict=True):
        assert torch.equal(x, tx) and torch.equal(y, ty)


def test_pixels_are_resized_cropped_and_normalised_as_computed_by_hand(tmp_path: Path) -> None:
    generator = np.random.default_rng(3)
    tall = generator.integers(0, 256, size=(22, 18, 3), dtype=np.uint8)  # h 22, w 18
    wide = generator.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)  # h 20, w 24
    for root in (tmp_path / "train", tmp_path / "val"):
        for name, pixels in (("a", tall), ("b", wide)):
            (root / name).mkdir(parents=True)
            Image.fromarray(pixels).save(root / name / "x.png")
    train, val = ImageFolder(root=str(tmp_path / "train"), val_root=str(tmp_path / "val"),
                             **SMALL).sources()
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def normalised(crop: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).float() / 255.0
        return (x - mean) / std

    # the shorter side is 18 already: no resize; the centred crop starts at row 3, column 1
    expected_tall = normalised(tall[3:19, 1:17])
    # 24x20 scaled to 21x18 (the longer side rounded down), then rows 1.., columns 2..
    resized = np.asarray(Image.fromarray(wide).resize((21, 18), Image.Resampling.BILINEAR))
    expected_wide = normalised(resized[1:17, 2:18])
    x, y = val.read(torch.tensor([0, 1]), 5)
    assert y.tolist() == [0, 1] or y.tolist() == [1, 0]  # validation order is shuffled
    by_label = {int(label): image for label, image in zip(y, x, strict=True)}
    assert float((by_label[0] - expected_tall).abs().max()) <= 1e-6
    assert float((by_label[1] - expected_wide).abs().max()) <= 1e-6
    # a training read is some 16x16 window of the same pixels, flipped or not
    image = train.read(torch.tensor([0]), 2)[0][0]
    windows = [normalised(window) for top in range(7) for left in range(3)
               for window in (tall[top:top + 16, left:left + 16],
                              tall[top:top + 16, left:left + 16][:, ::-1])]
    assert any(torch.allclose(image, w, rtol=0, atol=1e-6) for w in windows)


def test_a_damaged_file_is_named_by_the_read(images: Path) -> None:
    train, _ = ImageFolder(root=str(images), **SMALL).sources()
    broken = train.path(5)
    broken.write_bytes(broken.read_bytes()[:60])  # truncated
    with pytest.raises(DataFileError, match=f"^{broken}: "):
        train.read(torch.tensor([4, 5]), 0)


# -- the head: bad folders refused in one line before any rank starts -----------------------------

def _empty_class(root: Path) -> str:
    for image in (root / "bee").iterdir():
        if not image.name.startswith("."):
            image.unlink()
    (root / "bee" / ".hidden.png").write_bytes(b"x")
    return f"{root / 'bee'}: a class folder without images"


def _text_as_png(root: Path) -> str:
    # the first training image, or a held-out one: in the head's sample either way
    (root / "ant" / "ant_00.png").write_text("not a picture\n")
    return f"{root / 'ant' / 'ant_00.png'}: not an image PIL can read"


def _other_extension(root: Path) -> str:
    (root / "cow" / "labels.csv").write_text("a,b\n")
    return f"{root / 'cow' / 'labels.csv'}: not an image by its extension"


BAD_FOLDERS = {
    "missing_root": lambda root: f"dataset.root={root / 'nowhere'}: no such directory",
    "empty_class": _empty_class,
    "text_as_png": _text_as_png,
    "other_extension": _other_extension,
    "val_root_classes": lambda root: (f"dataset.val_root={root.parent / 'val'}: its class "
                                      f"folders are not dataset.root's: it lacks cow; it has "
                                      f"cat, which dataset.root has not"),
}


def test_the_head_refuses_bad_folders_in_one_line_naming_them(tmp_path: Path) -> None:
    jobs, expected = [], []
    for name, damage in BAD_FOLDERS.items():
        root = write_images(tmp_path / name / "images")
        write_images(tmp_path / name / "val", classes=("ant", "bee", "cat"), per_class=1)
        expected.append(damage(root))
        where = root / "nowhere" if name == "missing_root" else root
        extra = [f"dataset.val_root={tmp_path / name / 'val'}"] if name == "val_root_classes" \
            else []
        jobs.append(["model=cnn", "dataset=image_folder", f"dataset.root={where}", *extra,
                     "dataset.size=16", "dataset.resize=18", "grid.pr=1", "grid.pc=1",
                     f"hydra.run.dir={tmp_path / name / 'run'}"])
    for name, result, said in zip(BAD_FOLDERS, run_cli_together(*jobs), expected, strict=True):
        assert result.returncode == 2, (name, result.stderr)
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error: dataset=image_folder: ") and said in last, (name, last)
        assert "Traceback" not in result.stderr
        assert not (tmp_path / name / "run").exists()


# -- real ranks -----------------------------------------------------------------------------------

RESNET = ["model=resnet", "model.widths=[4,8]", "model.blocks=[1,1]", "model.stem=cifar",
          "dataset=image_folder", "dataset.size=16", "dataset.resize=18", "trainer.steps=6",
          "trainer.batch_size=8", "trainer.dtype=float64", "trainer.eval_every=null",
          "optimizer.lr=0.05", "seed=3"]


def _relative_gap(a: list[float], b: list[float]) -> float:
    assert a and len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_a_grid_trains_on_an_image_folder_as_one_process_does_and_resumes_exactly(
        images: Path, tmp_path: Path) -> None:
    """33 training images in batches of 8: steps 5 and 6 are the second epoch's, with other
    crops and flips. A 2x2 grid resumed from the 1-process run's step-3 checkpoint reads the
    same pixels for them."""
    runs = {"grid_2x2": ["strategy=grid", "grid.pr=2", "grid.pc=2"],
            "one_process": ["strategy=grid", "grid.pr=1", "grid.pc=1",
                            "trainer.checkpoint_every=3"]}
    for result in run_cli_together(*[[*RESNET, f"dataset.root={images}", *grid,
                                      f"hydra.run.dir={tmp_path / name}"]
                                     for name, grid in runs.items()]):
        assert_ok(result)
    grid, one = (train_losses(tmp_path / name) for name in runs)
    assert len(grid) == 6 and all(loss > 0 for loss in grid)
    assert _relative_gap(grid, one) <= 1e-9
    summaries = [read_summary(tmp_path / name) for name in runs]
    assert all(s["status"] == "completed" for s in summaries)
    assert _relative_gap([summaries[0]["val_loss"]], [summaries[1]["val_loss"]]) <= 1e-9
    resumed, checkpoint = tmp_path / "resumed_2x2", tmp_path / "one_process" / "checkpoints"
    assert_ok(run_cli(*RESNET, f"dataset.root={images}", *runs["grid_2x2"],
                      f"trainer.resume={checkpoint / 'step-00000003'}",
                      f"hydra.run.dir={resumed}"))
    later = [m for m in read_metrics(resumed) if "split" not in m]
    assert [m["step"] for m in later] == [4, 5, 6]
    assert _relative_gap([m["loss"] for m in later], one[3:]) <= 1e-9


def test_a_rank_meeting_a_damaged_file_ends_the_run_in_one_line(images: Path,
                                                                tmp_path: Path) -> None:
    # every training image but those the head decodes is damaged: the first batch meets one
    train, _ = ImageFolder(root=str(images), **SMALL).sources()
    sampled = set(sampled_rows(len(train)))
    damaged = [train.path(i) for i in range(len(train)) if i not in sampled]
    for path in damaged:
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG signature, then nothing
    run_dir = tmp_path / "run"
    result = run_cli(*RESNET, f"dataset.root={images}", "strategy=data", "grid.pr=1",
                     "grid.pc=2", f"hydra.run.dir={run_dir}")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert any(f"{path}: " in last for path in damaged), last
    assert "DataFileError" in last and "\n" not in read_summary(run_dir)["error"]
