"""Checkpoints of shards that split columns as well as rows, in one process (no MPI).

Four ranks are four threads, each with a world that gathers through a barrier, so that
`save_checkpoint` runs as it does on a 4 x 1 grid: every rank holds its block of every
parameter of a real model (`place_block` on slices of the real, placed parameters), takes an
SGD step with momentum and writes its shard. Each checkpoint, written as 2 x 2 blocks, row
shards, column stripes or column stripes with blocks nested inside them, must load bit for
bit into whole parameters, row shards, blocks and column stripes. Blocks that overlap or leave
a gap are refused in one line naming the tensor; a manifest of 6-field entries (every
checkpoint written before columns were split) loads as it always did.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from runner.checkpoint.format import Entry
from runner.checkpoint.layout import DamagedCheckpoint
from runner.checkpoint.read import Checkpoint
from runner.checkpoint.resume import parameter_shapes, verify_resume
from runner.checkpoint.write import TrainingProgress, save_checkpoint
from runner.core import ProcessGrid
from runner.core.partition import balanced_slice
from runner.core.placement import Placement, place_block, place_rows, place_whole, placement_of
from runner.optim.sync import SynchronousSGD
from runner.training import assembly
from runner.training.sampling import EpochSampler
from strategies import ParallelModel
from tests.test_checkpoint_integrity import (
    meta_model,
    refusal,
    rehash,
    rewrite_manifest,
    run_config,
)

RANKS = 4

# A layout: which rows and columns of a parameter of `shape` rank `rank` holds. Columns are
# split only in a tensor of two dims or more; a bias follows its weight's rows.
Layout = Callable[[int, tuple[int, ...]], tuple[slice, slice]]


def _half(total: int, index: int) -> slice:
    return balanced_slice(total, 2, index)


def _split_columns(shape: tuple[int, ...], parts: int, index: int) -> slice:
    """Piece `index` of `parts` of dim 1 (a vector has no columns to split: all of it)."""
    return balanced_slice(shape[1], parts, index) if len(shape) >= 2 else slice(None)


def whole(rank: int, shape: tuple[int, ...]) -> tuple[slice, slice]:
    return slice(None), slice(None)


def rows(rank: int, shape: tuple[int, ...]) -> tuple[slice, slice]:
    return balanced_slice(shape[0], RANKS, rank), slice(None)


def blocks(rank: int, shape: tuple[int, ...]) -> tuple[slice, slice]:
    """2 x 2: rank = 2 * row half + column half (ranks 0 and 1 hold the same bias rows)."""
    row_half, col_half = divmod(rank, 2)
    return _half(shape[0], row_half), _split_columns(shape, 2, col_half)


def columns(rank: int, shape: tuple[int, ...]) -> tuple[slice, slice]:
    """All rows, a quarter of the columns (a bias: every rank all of it)."""
    return slice(None), _split_columns(shape, RANKS, rank)


def nested(rank: int, shape: tuple[int, ...]) -> tuple[slice, slice]:
    """Rank 0 the left column stripe W[:, left]; ranks 1 and 2 the blocks of the right one;
    rank 3 the top block of the left stripe, inside rank 0's (a bias: rank 0 all of it, the
    others halves of it)."""
    left, right = _split_columns(shape, 2, 0), _split_columns(shape, 2, 1)
    top, bottom = _half(shape[0], 0), _half(shape[0], 1)
    return [(slice(None), left), (top, right), (bottom, right), (top, left)][rank]


LAYOUTS: dict[str, Layout] = {"whole": whole, "rows": rows, "blocks": blocks,
                              "columns": columns, "nested": nested}
WRITTEN = ["blocks", "rows", "columns", "nested"]


def cut(tensor: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    """Rank `rank`'s block of the global `tensor` (a view)."""
    row_part, col_part = layout(rank, tuple(tensor.shape))
    part = tensor.detach()[row_part]
    return part[:, col_part] if tensor.dim() >= 2 else part


def shard_of(source: torch.Tensor, layout: Layout, rank: int) -> nn.Parameter:
    """Rank `rank`'s block of the placed parameter `source`: a parameter of its own, placed."""
    shard = nn.Parameter(cut(source, layout, rank).clone())
    place_block(shard, source, *layout(rank, tuple(source.shape)))
    return shard


class ThreadWorld:
    """`allgather_object` for ranks that are threads of one process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)  # a failed rank fails the others

    def allgather_object(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return gathered


class RankComm:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.shared, self.rank, self.size = world, rank, world.size

    def allgather_object(self, obj: Any, label: str = "") -> list[Any]:
        return self.shared.allgather_object(self.rank, obj)


class RankGrid:
    """What `save_checkpoint` asks of a grid: one replica of 4 model-parallel ranks."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = RankComm(world, rank)
        self.rank, self.size, self.pr, self.pc = rank, world.size, world.size, 1
        self.batch_index, self.model_index = 0, rank


class BlockModel(ParallelModel):
    """A rank's blocks of the model's parameters, in the model's order."""

    def __init__(self, grid: Any, shards: list[nn.Parameter]) -> None:
        super().__init__(grid)
        self.shards = nn.ParameterList(shards)


@pytest.fixture(scope="module")
def sources() -> dict[str, nn.Parameter]:
    """The real model's parameters, placed as `build_training` places them."""
    torch.manual_seed(0)
    model = assembly.assemble(run_config()).model
    place_whole(model)
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def grads(sources: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {name: torch.randn_like(param) for name, param in sources.items()}


def one_step(sources: dict[str, nn.Parameter], grads: dict[str, torch.Tensor], layout: Layout,
             rank: int, grid: Any) -> tuple[BlockModel, SynchronousSGD]:
    """Rank `rank`'s blocks of the model after one SGD step with momentum on its blocks of the
    global gradients (elementwise: the same, bit for bit, as the whole model's step)."""
    shards = [shard_of(param, layout, rank) for param in sources.values()]
    model = BlockModel(grid, shards)
    optimizer = SynchronousSGD(model, grid=grid, total_steps=100, lr=0.1, momentum=0.9)
    for shard, grad in zip(shards, grads.values(), strict=True):
        shard.grad = cut(grad, layout, rank).clone()
    optimizer.step(0)
    return model, optimizer


@pytest.fixture(scope="module")
def truth(sources: dict[str, nn.Parameter],
          grads: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The global weights and momentum after the step, taken on the whole model."""
    model, optimizer = one_step(sources, grads, whole, 0, ProcessGrid(1, 1))
    momentum = optimizer.param_states()["momentum"]
    return {"model": {n: p.detach() for n, p in zip(sources, model.parameters(), strict=True)},
            "momentum": {n: m for n, m in zip(sources, momentum, strict=True)
                         if m is not None}}


def write(directory: Path, layout: Layout, sources: dict[str, nn.Parameter],
          grads: dict[str, torch.Tensor]) -> Path:
    """A checkpoint at step 1 written by 4 ranks (threads) holding `layout`'s blocks."""
    world = ThreadWorld(RANKS)
    written: list[Path] = []
    failures: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            grid = RankGrid(world, rank)
            model, optimizer = one_step(sources, grads, layout, rank, grid)
            progress = TrainingProgress(1, 0.1, EpochSampler(64, 8, seed=0).state())
            written.append(save_checkpoint(directory / "checkpoints", progress, model,
                                           optimizer, grid, {"config": {}}))
        except BaseException as exc:
            failures.append(exc)
            world.barrier.abort()  # the others stop waiting for this rank

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:  # the failure itself, not the broken barrier it left the others
        raise next((f for f in failures if not isinstance(f, threading.BrokenBarrierError)),
                   failures[0])
    assert len(set(written)) == 1
    return written[0]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, nn.Parameter],
            grads: dict[str, torch.Tensor]) -> dict[str, Path]:
    """One checkpoint per layout of the ranks that wrote it."""
    return {name: write(tmp_path_factory.mktemp(name), LAYOUTS[name], sources, grads)
            for name in WRITTEN}


def entries(checkpoint: Path) -> dict[str, list[list[Any]]]:
    files: dict[str, list[list[Any]]] = json.loads(
        (checkpoint / "manifest.json").read_text())["files"]
    return files


@pytest.fixture(scope="module")
def head_model() -> nn.Module:
    """The sequential model the head checks a checkpoint against (on the meta device)."""
    return meta_model()


@pytest.mark.parametrize("read", ["whole", "rows", "blocks", "columns", "nested"])
@pytest.mark.parametrize("wrote", WRITTEN)
def test_a_checkpoint_loads_bit_for_bit_into_any_layout(
        written: dict[str, Path], sources: dict[str, nn.Parameter],
        truth: dict[str, dict[str, torch.Tensor]], head_model: nn.Module, wrote: str,
        read: str) -> None:
    """Weights and momentum, each rank's block of them, whatever blocks wrote them."""
    path = written[wrote]
    # the head's check first: every shard hashed, every tensor tiled exactly once
    assert verify_resume(str(path), path.parent, head_model) == (path, [])
    checkpoint = Checkpoint(path)
    layout = LAYOUTS[read]
    for rank in range(RANKS):
        like = [shard_of(param, layout, rank) for param in sources.values()]
        for kind in ("model", "momentum"):
            values = checkpoint.read_states(kind, None, like, optional=False)
            for name, value in zip(sources, values, strict=True):
                want = cut(truth[kind][name], layout, rank)
                assert value is not None and value.dtype == want.dtype
                assert torch.equal(value, want), f"{kind} {name}, rank {rank}: {wrote} -> {read}"


def test_the_manifest_keeps_6_fields_for_whole_columns_and_8_for_blocks(
        written: dict[str, Path]) -> None:
    files = entries(written["blocks"])
    assert [e for e in files["rank-00003.pt"] if e[0] == "model" and e[2] == "1.weight"] == [
        ["model", None, "1.weight", [32, 64], 16, 32, 32, 64]]
    assert [e for e in files["rank-00000.pt"] if e[0] == "model" and e[2] == "1.bias"] == [
        ["model", None, "1.bias", [32], 0, 16]]
    # ranks 0 and 1 hold the same rows of the bias: the lower one writes them
    assert not [e for e in files["rank-00001.pt"] if e[2] == "1.bias"]
    shard = torch.load(written["blocks"] / "rank-00003.pt", weights_only=True)
    assert shard["model/-/1.weight/16:32,32:64"].shape == (16, 32)
    # row shards: the manifest and keys every checkpoint had before columns were split
    for items in entries(written["rows"]).values():
        assert items and all(len(item) == 6 for item in items)
    shard = torch.load(written["rows"] / "rank-00001.pt", weights_only=True)
    assert shard["model/-/1.weight/8:16"].shape == (8, 64)
    for name in WRITTEN:
        assert json.loads((written[name] / "manifest.json").read_text())["format"] == 2


def test_a_block_inside_a_stripe_that_is_written_is_not_written_again(
        written: dict[str, Path]) -> None:
    """Rank 3's block lies in rank 0's column stripe: written once, by rank 0."""
    files = entries(written["nested"])
    assert [e[4:] for e in files["rank-00000.pt"] if e[0] == "model" and e[2] == "1.weight"] \
        == [[0, 32, 0, 32]]
    assert not [e for e in files["rank-00003.pt"] if e[0] == "model"]
    # the bias: rank 0 holds it whole, the halves of ranks 1 and 2 are inside it
    assert [e[4:] for e in files["rank-00000.pt"] if e[0] == "model" and e[2] == "1.bias"] \
        == [[0, 32]]
    assert not [e for e in files["rank-00001.pt"] if e[2] == "1.bias"]


@pytest.fixture()
def blocks_copy(written: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(written["blocks"], tmp_path / "step"))


def _move_rows(checkpoint: Path, shard: str, name: str, start: int, stop: int) -> None:
    """Say that `shard`'s model block of `name` sits at rows start:stop (as many rows), its
    tensor renamed to match and the manifest rehashed: a checkpoint consistent in every way
    but that its blocks do not tile."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    item = next(e for e in manifest["files"][shard] if e[0] == "model" and e[2] == name)
    old = Entry.from_json(item).key
    item[4:6] = [start, stop]
    payload = torch.load(checkpoint / shard, weights_only=True)
    payload[Entry.from_json(item).key] = payload.pop(old)
    torch.save(payload, checkpoint / shard)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    rehash(checkpoint, shard)


def _drop(checkpoint: Path, shard: str, name: str) -> None:
    """Leave `shard`'s model block of `name` out of the manifest (its tensor stays)."""
    rewrite_manifest(checkpoint, lambda m: m["files"].__setitem__(shard, [
        e for e in m["files"][shard] if not (e[0] == "model" and e[2] == name)]))


def test_overlapping_blocks_are_refused_naming_the_tensor(blocks_copy: Path,
                                                         head_model: nn.Module) -> None:
    _move_rows(blocks_copy, "rank-00003.pt", "1.weight", 8, 24)  # over rank 1's block
    assert refusal(verify_resume, str(blocks_copy), blocks_copy.parent, head_model) == (
        f"checkpoint {blocks_copy}: manifest.json: not a checkpoint of this model: its model "
        f"shards of 1.weight overlap: both hold rows 8:16, columns 32:64 (another model or "
        f"dataset?)")


def test_a_gap_between_blocks_is_refused_naming_the_tensor(
        blocks_copy: Path, sources: dict[str, nn.Parameter], head_model: nn.Module) -> None:
    _drop(blocks_copy, "rank-00003.pt", "3.weight")
    assert refusal(verify_resume, str(blocks_copy), blocks_copy.parent, head_model) == (
        f"checkpoint {blocks_copy}: manifest.json: not a checkpoint of this model: its model "
        f"shards of 3.weight leave a gap at row 8, column 16 (another model or dataset?)")
    # a rank that reads it is refused too, in one line: whole, and the missing block alone
    whole_weight = shard_of(sources["3.weight"], whole, 0)
    assert refusal(Checkpoint(blocks_copy).read_states, "model", None, [whole_weight], False) == (
        f"checkpoint {blocks_copy}: no model rows 0:16 of 3.weight (a different model?)")
    block = shard_of(sources["3.weight"], blocks, 3)
    assert refusal(Checkpoint(blocks_copy).read_states, "model", None, [block], False) == (
        f"checkpoint {blocks_copy}: no model rows 8:16, columns 16:32 of 3.weight (a different "
        f"model?)")


def test_row_shards_that_overlap_or_leave_a_gap_are_refused(
        written: dict[str, Path], head_model: nn.Module, tmp_path: Path) -> None:
    checkpoint = Path(shutil.copytree(written["rows"], tmp_path / "step"))
    _move_rows(checkpoint, "rank-00001.pt", "1.weight", 4, 12)
    assert Checkpoint(checkpoint).model_problem(parameter_shapes(head_model)) == (
        "its model shards of 1.weight overlap: both hold rows 4:8")
    _drop(checkpoint, "rank-00001.pt", "1.weight")
    assert Checkpoint(checkpoint).model_problem(parameter_shapes(head_model)) == (
        "its model shards of 1.weight leave a gap at row 8, column 0")
    _drop(checkpoint, "rank-00002.pt", "1.bias")
    _drop(checkpoint, "rank-00000.pt", "1.weight")
    assert Checkpoint(checkpoint).model_problem(parameter_shapes(head_model)) == (
        "its model shards of 1.bias leave a gap at row 16")


@pytest.mark.parametrize(("change", "reason"), [
    (lambda e: e.__setitem__(7, 99), "entry 1.weight: columns 32:99 outside its 64 columns"),
    (lambda e: e.__setitem__(6, True), "entry 1.weight: columns True:64 outside its 64 "
                                       "columns"),
    (lambda e: e.pop(), "entry ['model', None, '1.weight', [32, 64], 16, 32, 32] is not "
                        "[kind, replica, name, shape, start, stop] or [kind, replica, name, "
                        "shape, start, stop, col_start, col_stop]"),
])
def test_malformed_block_entries_are_refused(blocks_copy: Path, change: Any,
                                             reason: str) -> None:
    rewrite_manifest(blocks_copy, lambda m: change(m["files"]["rank-00003.pt"][0]))
    with pytest.raises(DamagedCheckpoint) as caught:
        Checkpoint(blocks_copy)
    assert caught.value.reason == f"rank-00003.pt: {reason}"


def test_a_vector_has_no_columns_to_split(blocks_copy: Path,
                                          sources: dict[str, nn.Parameter]) -> None:
    def split_bias(manifest: dict[str, Any]) -> None:
        next(e for e in manifest["files"]["rank-00000.pt"] if e[2] == "1.bias").extend([0, 1])

    rewrite_manifest(blocks_copy, split_bias)
    assert refusal(Checkpoint, blocks_copy) == (
        f"checkpoint {blocks_copy}: manifest.json: rank-00000.pt: entry 1.bias: columns 0:1 "
        f"of a tensor of shape [32], which has no columns to split")
    with pytest.raises(ValueError, match=r"1.bias has shape \[32\]: no columns to split"):
        place_block(torch.zeros(16), sources["1.bias"], slice(0, 16), slice(0, 16))


def test_an_old_6_field_manifest_loads_and_the_same_entries_with_8_fields_read_the_same(
        written: dict[str, Path], sources: dict[str, nn.Parameter],
        truth: dict[str, dict[str, torch.Tensor]], head_model: nn.Module,
        tmp_path: Path) -> None:
    """The row-shard checkpoint's manifest is what every checkpoint before blocks was (the
    load test reads it into blocks); its entries spelled out with all their columns are the
    same entries, with the same keys."""
    checkpoint = Path(shutil.copytree(written["rows"], tmp_path / "step"))

    def spell_out(manifest: dict[str, Any]) -> None:
        for items in manifest["files"].values():
            for item in items:
                if len(item[3]) >= 2:
                    item.extend([0, item[3][1]])

    rewrite_manifest(checkpoint, spell_out)
    assert entries(checkpoint)["rank-00000.pt"][0] == ["model", None, "1.weight", [32, 64], 0,
                                                        8, 0, 64]
    assert verify_resume(str(checkpoint), checkpoint.parent, head_model) == (checkpoint, [])
    block = shard_of(sources["1.weight"], blocks, 3)
    [got] = Checkpoint(checkpoint).read_states("model", None, [block], optional=False)
    assert torch.equal(got, truth["model"]["1.weight"][16:32, 32:64])


def test_place_block_composes_with_the_source_placement(
        sources: dict[str, nn.Parameter]) -> None:
    weight = sources["1.weight"]  # [32, 64], placed whole
    stripe, block, stripe_rows = torch.zeros(32, 16), torch.zeros(4, 8), torch.zeros(8, 16)
    place_block(stripe, weight, slice(None), slice(48, 64))
    place_block(block, stripe, slice(8, 12), slice(0, 8))
    place_rows(stripe_rows, stripe, slice(24, 32))
    assert placement_of(stripe) == Placement("1.weight", (32, 64), 0, 32, 48, 64)
    assert placement_of(block) == Placement("1.weight", (32, 64), 8, 12, 48, 56)
    assert placement_of(stripe_rows) == Placement("1.weight", (32, 64), 24, 32, 48, 64)
    # every column, however it is spelled, is the placement of whole columns
    every = torch.zeros(8, 64)
    place_block(every, weight, slice(0, 8), slice(0, 64))
    assert placement_of(every) == Placement("1.weight", (32, 64), 0, 8)
    assert not Placement("1.weight", (32, 64), 0, 8, 0, 64).splits_columns
    with pytest.raises(ValueError, match=r"^columns 0:17 are not a contiguous range of the 16 "
                                         r"columns of the source$"):
        place_block(torch.zeros(1), stripe, slice(0, 1), slice(0, 17))
    with pytest.raises(ValueError, match=r"^rows 4:2 are not"):
        place_rows(torch.zeros(1), stripe, slice(4, 2))
    untagged = torch.zeros(3)
    place_block(untagged, torch.zeros(6), slice(0, 3), slice(None))
    assert placement_of(untagged) is None  # an untagged source: nothing to record
