"""The image models (ResNet with basic blocks, VGG) and the CIFAR-10 loader: shapes, the
published parameter counts, the blocks' shortcuts, torch.fx, and the binary format read from a
tiny dataset written here."""

from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from runner.cli.app import precheck
from runner.config.registry import DATASETS, MODELS, load_plugins
from runner.zoo.datasets import CIFAR10_CLASSES, CIFAR10_RECORD, Cifar10
from runner.zoo.models import BasicBlock, ResNet, resnet, vgg
from tests.conftest import ROOT, assert_ok, read_summary, run_cli


def preset(name: str) -> tuple[str, dict[str, Any]]:
    """A `conf/model/` preset: the registered name and its options."""
    options = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    return options.pop("name"), options


def build(name: str, input_shape: tuple[int, ...], num_classes: int,
          device: str = "cpu") -> nn.Module:
    load_plugins()
    registered, options = preset(name)
    with torch.device(device):
        model = MODELS.get(registered)(input_shape, num_classes, **options)
    assert isinstance(model, nn.Module)
    return model


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def blocks_of(model: ResNet) -> list[BasicBlock]:
    return [m for m in model.modules() if isinstance(m, BasicBlock)]


# ---------------------------------------------------------------------------------------------
# models


@pytest.mark.parametrize("name", ["resnet", "vgg"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_the_small_presets_classify_digits_and_32x32_images(name: str,
                                                            shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build(name, shape, 10)
    assert model(torch.randn(4, *shape)).shape == (4, 10)


@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32), (3, 224, 224)])
def test_the_large_presets_build_on_the_meta_device_for_any_image_size(
        shape: tuple[int, ...]) -> None:
    for name in ("resnet18", "vgg16"):
        model = build(name, shape, 7, device="meta")
        out = model(torch.zeros(2, *shape, device="meta"))
        assert out.shape == (2, 7), name


def test_cifar_resnet18_has_its_published_parameter_count() -> None:
    model = build("resnet18", (3, 32, 32), 10)
    assert count(model) == 11_173_962
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    # the ImageNet stem (conv 7x7/2, max-pool) at 1000 classes is torchvision's resnet18
    with torch.device("meta"):
        imagenet = resnet((3, 224, 224), 1000, widths=[64, 128, 256, 512], blocks=[2, 2, 2, 2],
                          stem="imagenet")
    assert count(imagenet) == 11_689_512


@pytest.mark.parametrize(("config", "batch_norm", "params"), [
    ("11", False, 132_863_336), ("13", False, 133_047_848), ("16", False, 138_357_544),
    ("19", False, 143_667_240), ("16", True, 138_365_992)])
def test_vgg_has_the_papers_parameter_counts_at_224(config: str, batch_norm: bool,
                                                    params: int) -> None:
    with torch.device("meta"):
        model = vgg((3, 224, 224), 1000, config=config, batch_norm=batch_norm, hidden=4096)
    assert count(model) == params
    first_linear = next(m for m in model if isinstance(m, nn.Linear))
    assert first_linear.in_features == 512 * 7 * 7
    assert isinstance(model, nn.Sequential)


def test_the_vgg16_preset_is_the_papers_network() -> None:
    model = build("vgg16", (3, 224, 224), 1000, device="meta")
    assert count(model) == 138_357_544
    _, options = preset("vgg16")
    assert options["sample_shape"] == [3, 224, 224] and options["classes"] == 1000


def test_vgg_skips_the_pools_an_8x8_input_has_no_room_for() -> None:
    model = vgg((1, 8, 8), 10, config="16", hidden=32)
    assert sum(isinstance(m, nn.MaxPool2d) for m in model) == 3  # 8 -> 4 -> 2 -> 1, then none
    assert next(m for m in model if isinstance(m, nn.Linear)).in_features == 512
    small = vgg((1, 8, 8), 10, config=[4, "M", 8, "m", 8], batch_norm=True)
    kinds = [type(m).__name__ for m in small]
    assert kinds[:8] == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Conv2d", "BatchNorm2d",
                         "ReLU", "MaxPool2d"]
    assert kinds[-8:] == ["Flatten", "Linear", "ReLU", "Dropout", "Linear", "ReLU", "Dropout",
                          "Linear"]
    assert small(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_the_resnet_module_tree() -> None:
    model = resnet((3, 32, 32), 10)
    assert [name for name, _ in model.named_children()] == [
        "stem", "layer1", "layer2", "layer3", "pool", "flatten", "fc"]
    block = model.layer2[0]  # type: ignore[index]
    assert [name for name, _ in block.named_children()] == [
        "conv1", "bn1", "relu1", "conv2", "bn2", "shortcut", "relu2"]
    assert isinstance(block.relu1, nn.ReLU) and block.relu1 is not block.relu2
    assert [type(m) for m in block.shortcut] == [nn.Conv2d, nn.BatchNorm2d]
    assert model.layer1[0].shortcut is None  # type: ignore[index]
    plain = resnet((3, 32, 32), 10, batch_norm=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert all(m.bias is not None for m in plain.modules() if isinstance(m, nn.Conv2d))
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Conv2d))


def test_resnet_projects_its_shortcut_exactly_where_channels_or_stride_change() -> None:
    # 8x8 digits through four stages of equal width: stages 2 and 3 halve the map (8 -> 4 -> 2),
    # stage 4 finds it 2x2 and keeps stride 1 and so, with equal channels, the identity
    model = resnet((1, 8, 8), 10, widths=[8, 8, 8, 16], blocks=[1, 2, 1, 2])
    sizes: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        if isinstance(module, BasicBlock):
            module.register_forward_hook(
                lambda m, i, o, name=name: sizes.__setitem__(name, tuple(o.shape[2:])))
    model(torch.randn(2, 1, 8, 8))
    assert sizes == {"layer1.0": (8, 8), "layer2.0": (4, 4), "layer2.1": (4, 4),
                     "layer3.0": (2, 2), "layer4.0": (2, 2), "layer4.1": (2, 2)}
    projected = {name for name, m in model.named_modules()
                 if isinstance(m, BasicBlock) and m.shortcut is not None}
    assert projected == {"layer2.0", "layer3.0", "layer4.0"}  # stride, stride, channels
    for block in blocks_of(model):
        changes = (block.conv1.stride != (1, 1)
                   or block.conv1.in_channels != block.conv1.out_channels)
        assert (block.shortcut is not None) == changes
    assert model.layer4[0].conv1.stride == (1, 1)  # type: ignore[index]
    # the ImageNet stem on digits: 8 -> 4 (conv 7x7/2) -> 2 (max-pool); no stage strides
    tiny = resnet((1, 8, 8), 10, stem="imagenet")
    assert all(b.conv1.stride == (1, 1) for b in blocks_of(tiny))
    assert tiny(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("batch_norm", [True, False])
def test_resnet_traces_with_torch_fx(batch_norm: bool) -> None:
    torch.manual_seed(0)
    model = resnet((3, 16, 16), 5, widths=[4, 8], blocks=[2, 1], batch_norm=batch_norm).eval()
    traced = torch.fx.symbolic_trace(model)
    adds = [n for n in traced.graph.nodes if n.op == "call_function" and n.target is operator.add]
    assert len(adds) == len(blocks_of(model)) == 3
    called = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    stem = ["stem.0", "stem.1", "stem.2"] if batch_norm else ["stem.0", "stem.1"]
    assert called[:len(stem)] == stem
    assert "layer2.0.shortcut.0" in called and called[-3:] == ["pool", "flatten", "fc"]
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(traced(x), model(x))


def test_bad_model_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"model\.widths and model\.blocks"):
        resnet((3, 32, 32), 10, widths=[8, 16], blocks=[1])
    with pytest.raises(ValueError, match=r">= 1"):
        resnet((3, 32, 32), 10, widths=[8, 0], blocks=[1, 1])
    with pytest.raises(ValueError, match=r"model\.stem"):
        resnet((3, 32, 32), 10, stem="mnist")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="image inputs"):
        resnet((64,), 10)
    with pytest.raises(ValueError, match=r"model\.config=17"):
        vgg((3, 32, 32), 10, config=17)
    with pytest.raises(ValueError, match="'X'"):
        vgg((3, 32, 32), 10, config=[8, "X"])
    problem = precheck(["model=resnet", "model.stem=mnist", "model.widths=[8,a]"])
    assert problem is not None and "model.stem=mnist" in problem and "model.widths" in problem


# ---------------------------------------------------------------------------------------------
# CIFAR-10


def write_batch(path: Path, labels: list[int], images: np.ndarray | None = None,
                seed: int = 0) -> np.ndarray:
    """A file of CIFAR-10 records: each a label byte, then 3072 pixel bytes (R, G, B planes)."""
    if images is None:
        images = np.random.default_rng(seed).integers(0, 256, (len(labels), 3, 32, 32),
                                                      dtype=np.uint8)
    records = np.concatenate([np.array(labels, dtype=np.uint8)[:, None],
                              images.reshape(len(labels), -1)], axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    records.tofile(path)
    return images


@pytest.fixture
def cifar_dir(tmp_path: Path) -> Path:
    """Two training files of 20 records and a test file of 10; record 0 of data_batch_1 is all
    red, record 1 a ramp over the red plane in row-major order."""
    root = tmp_path / "cifar"
    images = np.random.default_rng(1).integers(0, 256, (20, 3, 32, 32), dtype=np.uint8)
    images[0] = 0
    images[0, 0] = 255
    images[1] = 0
    images[1, 0] = (np.arange(1024) % 256).reshape(32, 32)
    write_batch(root / "data_batch_1.bin", [i % 10 for i in range(20)], images)
    write_batch(root / "data_batch_2.bin", [9 - i % 10 for i in range(20)], seed=2)
    write_batch(root / "test_batch.bin", [3] * 10, seed=3)
    return root


def test_cifar10_reads_the_binary_format(cifar_dir: Path) -> None:
    load_plugins()
    assert DATASETS.get("cifar10") is Cifar10
    dataset = Cifar10(root=str(cifar_dir), train_batches=[1, 2], normalize=False)
    spec = dataset.spec()
    assert (spec.input_shape, spec.num_classes, spec.train_size, spec.val_size) == (
        (3, 32, 32), 10, 40, 10)
    data = dataset.load()
    assert data.train_x.shape == (40, 3, 32, 32) and data.val_x.shape == (10, 3, 32, 32)
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.long
    assert data.train_y.tolist() == [i % 10 for i in range(20)] + [9 - i % 10 for i in range(20)]
    assert data.val_y.tolist() == [3] * 10
    red = data.train_x[0]
    assert torch.all(red[0] == 1.0) and torch.all(red[1:] == 0.0)
    ramp = data.train_x[1, 0] * 255
    assert ramp[0, 1] == 1 and ramp[1, 0] == 32 and ramp[7, 31] == 255  # row-major planes
    second = np.fromfile(cifar_dir / "data_batch_2.bin", dtype=np.uint8).reshape(20, -1)
    expected = torch.from_numpy(second[:, 1:].reshape(20, 3, 32, 32).astype(np.float32)) / 255
    torch.testing.assert_close(data.train_x[20:], expected)
    # normalised: the published per-channel mean and standard deviation; red is the top channel
    normal = Cifar10(root=str(cifar_dir), train_batches=[1, 2]).load()
    top = normal.train_x[0].amax(dim=(1, 2))
    assert int(top.argmax()) == 0 and torch.all(top[1:] < 0)
    torch.testing.assert_close(normal.train_x[0, 0, 0, 0], torch.tensor((1 - 0.4914) / 0.2470))


def test_cifar10_limit_and_the_tarballs_directory(cifar_dir: Path, tmp_path: Path) -> None:
    nested = tmp_path / "unpacked"
    nested.mkdir()
    cifar_dir.rename(nested / "cifar-10-batches-bin")
    dataset = Cifar10(root=str(nested), train_batches=[2, 1], limit=25, normalize=False)
    assert dataset.spec().train_size == 25
    data = dataset.load()  # all of batch 2, then the first 5 of batch 1
    assert data.train_y.tolist() == [9 - i % 10 for i in range(20)] + [0, 1, 2, 3, 4]
    assert torch.all(data.train_x[20, 0] == 1.0)


def test_cifar10_refuses_missing_and_damaged_files_by_name(cifar_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"dataset\.root is required"):
        Cifar10()
    with pytest.raises(ValueError, match="no such directory"):
        Cifar10(root=str(cifar_dir / "nowhere")).spec()
    with pytest.raises(ValueError, match=r"data_batch_3\.bin is missing"):
        Cifar10(root=str(cifar_dir)).spec()  # the default: all five training files
    with pytest.raises(ValueError, match=r"dataset\.train_batches"):
        Cifar10(root=str(cifar_dir), train_batches=[0, 6])
    short = cifar_dir / "data_batch_2.bin"
    short.write_bytes(short.read_bytes()[:-100])
    damaged = f"{re.escape(str(short))} has {20 * CIFAR10_RECORD - 100} bytes, not a whole"
    with pytest.raises(ValueError, match=damaged):
        Cifar10(root=str(cifar_dir), train_batches=[1, 2]).spec()
    write_batch(short, [10] * 20)  # a label beyond the ten classes
    with pytest.raises(ValueError, match=r"data_batch_2\.bin has label 10"):
        Cifar10(root=str(cifar_dir), train_batches=[1, 2]).load()
    assert len(CIFAR10_CLASSES) == 10


def test_the_head_refuses_a_bad_cifar10_root_in_one_line(cifar_dir: Path) -> None:
    problem = precheck(["dataset=cifar10", f"dataset.root={cifar_dir / 'nowhere'}"])
    assert problem is not None and f"dataset.root={cifar_dir / 'nowhere'}: no such" in problem
    assert "\n" not in problem
    problem = precheck(["dataset=cifar10"])
    assert problem is not None and "dataset.root is required" in problem
    problem = precheck(["dataset=cifar10", f"dataset.root={cifar_dir}"])
    assert problem is not None and "data_batch_3.bin is missing" in problem


def test_resnet_trains_on_cifar10_end_to_end(cifar_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli("dataset=cifar10", f"dataset.root={cifar_dir}",
                     "dataset.train_batches=[1,2]", "model=resnet", "model.widths=[4,8]",
                     "model.blocks=[1,1]", "strategy=data", "grid.pr=1", "grid.pc=1",
                     "trainer.steps=3", "trainer.batch_size=8", f"hydra.run.dir={run_dir}")
    assert_ok(result)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert 0.0 <= summary["val_accuracy"] <= 1.0
