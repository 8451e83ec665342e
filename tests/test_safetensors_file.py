"""gridrun's own safetensors reader and streaming writer (`runner.weights.safetensors_file`):
bit for bit against the safetensors package both ways, a block read as the bytes of its rows
only, and every refusal one line naming the file and the tensor."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runner.weights.safetensors_file import (
    DTYPES,
    SafetensorsWriter,
    WeightsFileError,
    dtype_name,
    read_block,
    read_header,
    read_rows_into,
    write_file,
)

SHAPES: dict[str, tuple[int, ...]] = {
    "scalar": (), "vector": (7,), "matrix": (6, 5), "cube": (5, 4, 3), "empty": (0, 4)}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of `dtype` (NaNs and all: the bytes are what is compared)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=generator)
    return raw.view(dtype).reshape(shape)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.is_contiguous() and got.device.type == "cpu"
    assert torch.equal(got.reshape(-1).view(torch.uint8),
                       want.contiguous().reshape(-1).view(torch.uint8))


# -- reading what the safetensors package wrote ----------------------------------------------

@pytest.mark.parametrize("dtype_text", list(DTYPES))
def test_reads_every_dtype_the_safetensors_package_writes(tmp_path: Path,
                                                          dtype_text: str) -> None:
    from safetensors.torch import save_file

    dtype = DTYPES[dtype_text]
    assert dtype_name(dtype) == dtype_text
    tensors = {name: random_tensor(dtype, shape, seed)
               for seed, (name, shape) in enumerate(SHAPES.items())}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert set(header.tensors) == set(tensors)
    assert header.file_size == path.stat().st_size
    for name, want in tensors.items():
        stored = header.tensors[name]
        assert (stored.name, stored.dtype, stored.shape) == (name, dtype, tuple(want.shape))
        assert stored.nbytes == want.numel() * dtype.itemsize
        assert_same_bits(read_block(header, name), want)
    cube, matrix, vector = tensors["cube"], tensors["matrix"], tensors["vector"]
    assert_same_bits(read_block(header, "cube", rows=(1, 4)), cube[1:4])
    assert_same_bits(read_block(header, "cube", rows=(2, 5), cols=(1, 3)), cube[2:5, 1:3])
    assert_same_bits(read_block(header, "matrix", rows=(0, 6), cols=(4, 5)), matrix[:, 4:5])
    assert_same_bits(read_block(header, "matrix", rows=(3, 4), cols=(2, 2)), matrix[3:4, 2:2])
    assert_same_bits(read_block(header, "vector", rows=(6, 7)), vector[6:7])
    assert_same_bits(read_block(header, "vector", rows=(3, 3)), vector[3:3])


def test_dtypes_safetensors_cannot_hold_are_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"cannot hold torch\.complex64"):
        dtype_name(torch.complex64)


# -- writing what the safetensors package reads ----------------------------------------------

def test_files_the_writer_writes_whole_load_in_the_safetensors_package(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {f"{text.lower()}.{name}": random_tensor(dtype, shape, seed)
               for seed, (text, dtype, (name, shape)) in enumerate(
                   (text, dtype, item) for text, dtype in DTYPES.items()
                   for item in SHAPES.items())}
    tensors["transposed"] = random_tensor(torch.bfloat16, (5, 7), 99).t()  # not contiguous
    path = tmp_path / "export.safetensors"
    metadata = {"step": "1200", "note": "grün"}
    sha256 = write_file(path, tensors, metadata)
    assert sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert sorted(tmp_path.iterdir()) == [path]  # no partial file left beside it
    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, want in tensors.items():
        assert_same_bits(loaded[name], want)
    with safe_open(str(path), framework="pt") as opened:
        assert opened.metadata() == metadata
    header = read_header(path)
    assert list(header.tensors) == list(tensors)  # the layout's order
    assert header.data_start % 8 == 0 and header.metadata == metadata
    assert_same_bits(read_block(header, "transposed", rows=(2, 6), cols=(1, 4)),
                     tensors["transposed"][2:6, 1:4])


def test_the_writer_streams_tensors_in_pieces_of_rows(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    embedding = random_tensor(torch.bfloat16, (10, 6), 1)
    scale = random_tensor(torch.float32, (), 2)
    bias = random_tensor(torch.float8_e4m3fn, (4,), 3)
    path = tmp_path / "streamed.safetensors"
    layout = [("embedding", torch.bfloat16, (10, 6)), ("scale", torch.float32, ()),
              ("bias", torch.float8_e4m3fn, (4,))]
    with SafetensorsWriter(path, layout, metadata={"source": "shards"}) as writer:
        assert not path.exists()  # written aside, renamed into place once complete
        writer.write_rows("embedding", 0, embedding[0:3])
        writer.write_rows("embedding", 3, embedding[3:3])  # an empty piece does no harm
        writer.write_rows("embedding", 3, embedding[3:10])
        writer.write("scale", scale)
        writer.write_rows("bias", 0, bias[:1])
        writer.write_rows("bias", 1, bias[1:])
    assert writer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(str(path))
    for name, want in (("embedding", embedding), ("scale", scale), ("bias", bias)):
        assert_same_bits(loaded[name], want)
    with safe_open(str(path), framework="pt") as opened:
        assert opened.metadata() == {"source": "shards"}
    assert read_header(path) == writer.header  # the header it announced is the one written


# -- a block is the bytes of its rows only ---------------------------------------------------

def test_read_block_reads_only_the_bytes_of_its_rows(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    matrix = random_tensor(torch.float32, (64, 32), 5)  # 128 bytes a row
    path = tmp_path / "model.safetensors"
    write_file(path, {"before": random_tensor(torch.int16, (3,), 6), "matrix": matrix})
    header = read_header(path)
    begin = header.tensors["matrix"].begin
    reads: list[tuple[int, int]] = []
    real_preadv = os.preadv

    def recording_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        got = real_preadv(fd, buffers, offset)
        reads.append((offset, got))
        return got

    def refused(*args: object) -> None:
        raise AssertionError("a block is read by os.preadv alone")

    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", recording_preadv)
        patch.setattr(os, "pread", refused)
        patch.setattr(os, "read", refused)
        rows = read_block(header, "matrix", rows=(10, 30))
        assert reads == [(begin + 10 * 128, 20 * 128)]  # the whole tensor is 64 * 128 bytes
        reads.clear()
        block = read_block(header, "matrix", rows=(40, 41), cols=(5, 9))
        assert reads == [(begin + 40 * 128, 128)]  # whole rows, the columns cut from them
    assert_same_bits(rows, matrix[10:30])
    assert_same_bits(block, matrix[40:41, 5:9])


def test_read_block_finds_a_file_cut_or_changed_after_its_header_was_read(
        tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_file(path, {"embed": torch.zeros(4, 4), "lm_head.weight": torch.ones(8, 4)})
    header = read_header(path)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    message = one_line_refusal(lambda: read_block(header, "lm_head.weight", rows=(0, 1)), path)
    assert f"truncated: the tensor 'lm_head.weight' ends at byte {size} and the file has " \
           f"{size - 10} bytes" in message
    with path.open("ab") as grown:
        grown.write(bytes(20))
    message = one_line_refusal(lambda: read_block(header, "embed"), path)
    assert f"changed since its header was read (it had {size} bytes and has {size + 10})" \
        in message


def test_read_block_refuses_rows_and_columns_outside_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    write_file(path, {"w": torch.zeros(4, 3), "b": torch.zeros(3), "s": torch.tensor(1.0)})
    header = read_header(path)
    for name, rows, cols in (("w", (2, 5), None), ("w", (-1, 2), None), ("w", (3, 2), None),
                             ("w", (0, 4), (1, 4)), ("b", (0, 1), (0, 1)), ("s", (0, 1), None)):
        with pytest.raises(ValueError, match=f"'{name}'") as caught:
            read_block(header, name, rows=rows, cols=cols)
        assert not isinstance(caught.value, WeightsFileError)  # the caller's, not the file's
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    message = one_line_refusal(lambda: read_block(header, "lm_head"), path)
    assert "has no tensor 'lm_head'" in message


# -- refusals --------------------------------------------------------------------------------

def one_line_refusal(action: Callable[[], object], path: Path) -> str:
    with pytest.raises(WeightsFileError) as caught:
        action()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


def crafted(path: Path, header: object, data: bytes = b"", length: int | None = None) -> None:
    """A file of the given header (JSON, or raw bytes) and data, its length field as given."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def f32(offsets: list[int], shape: list[int] | None = None) -> dict[str, object]:
    return {"dtype": "F32", "shape": shape or [(offsets[1] - offsets[0]) // 4],
            "data_offsets": offsets}


def cut_short(path: Path) -> None:
    write_file(path, {"embed": torch.zeros(8, 4), "lm_head.weight": torch.ones(16, 4)})
    os.truncate(path, path.stat().st_size - 3)


def random_bytes(path: Path) -> None:
    data = random.Random(7).randbytes(4096)
    assert data[:1] not in (b"P", b"\x80")  # not taken for a torch.save file
    path.write_bytes(data)


DUPLICATED = b'{"w":' + json.dumps(f32([0, 4])).encode() + b',"w":' + \
    json.dumps(f32([4, 8])).encode() + b"}"

REFUSALS: dict[str, tuple[Callable[[Path], object], list[str]]] = {
    "truncated": (cut_short, ["truncated: the tensor 'lm_head.weight' ends at byte"]),
    "torch.save zip": (lambda p: torch.save({"w": torch.zeros(3)}, p),
                       ["a torch.save file, not safetensors"]),
    "torch.save pickle": (lambda p: torch.save({"w": torch.zeros(3)}, p,
                                               _use_new_zipfile_serialization=False),
                          ["a torch.save file, not safetensors"]),
    "random bytes": (random_bytes, ["not a safetensors file (its first 8 bytes do not give a "
                                    "header length"]),
    "header longer than the file": (lambda p: crafted(p, {}, length=1000),
                                    ["not a safetensors file (its first 8 bytes do not give a "
                                     "header length: they say 1000 bytes"]),
    "shorter than a length": (lambda p: p.write_bytes(b"\x02\x00"), ["fewer than the 8"]),
    "header not UTF-8": (lambda p: crafted(p, b'{"\xff":1}'),
                         ["not a safetensors file (its header is not UTF-8)"]),
    "header not JSON": (lambda p: crafted(p, b"{nope"),
                        ["not a safetensors file (its header is not JSON)"]),
    "JSON not an object": (lambda p: crafted(p, [1, 2]), ["JSON but not an object: [1, 2]"]),
    "unknown dtype": (lambda p: crafted(p, {"w": {"dtype": "F4", "shape": [2],
                                                  "data_offsets": [0, 1]}}, bytes(1)),
                      ["the tensor 'w' has an unknown dtype 'F4'"]),
    "size mismatch": (lambda p: crafted(p, {"w": f32([0, 20], [2, 3])}, bytes(24)),
                      ["the tensor 'w' (F32 of shape [2, 3]) takes 24 bytes", "hold 20"]),
    "overlapping offsets": (lambda p: crafted(p, {"a": f32([0, 16]), "b": f32([8, 24])},
                                              bytes(24)),
                            ["the tensors 'a' and 'b' overlap"]),
    "duplicate names": (lambda p: crafted(p, DUPLICATED, bytes(8)),
                        ["the header names 'w' twice"]),
    "no data_offsets": (lambda p: crafted(p, {"w": {"dtype": "F32", "shape": [1]}}),
                        ["the tensor 'w' has no data_offsets"]),
    "negative shape": (lambda p: crafted(p, {"w": f32([0, 4], [-1])}, bytes(4)),
                       ["the tensor 'w' has the shape [-1], not a list of non-negative"]),
    "entry not an object": (lambda p: crafted(p, {"w": [1]}), ["the tensor 'w' is described"]),
    "metadata not strings": (lambda p: crafted(p, {"__metadata__": {"step": 3}}),
                             ["__metadata__ gives 'step' the value 3, not a string"]),
    "a directory": (lambda p: p.mkdir(), ["not a regular file (a directory)"]),
    "no file": (lambda p: None, ["no such file"]),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_every_refusal_is_one_line_naming_the_file_and_the_tensor(tmp_path: Path,
                                                                   case: str) -> None:
    make, fragments = REFUSALS[case]
    path = tmp_path / "model.safetensors"
    make(path)
    message = one_line_refusal(lambda: read_header(path), path)
    for fragment in fragments:
        assert fragment in message


def test_gaps_between_tensors_are_allowed(tmp_path: Path) -> None:
    path = tmp_path / "gapped.safetensors"
    crafted(path, {"a": f32([0, 8]), "b": f32([16, 24])},
            struct.pack("<2f", 1, 2) + bytes(8) + struct.pack("<2f", 3, 4))
    header = read_header(path)
    assert read_block(header, "b").tolist() == [3.0, 4.0]


# -- the writer's refusals -------------------------------------------------------------------

LAYOUT = [("a", torch.float32, (4, 2)), ("b", torch.int8, (3,))]


def test_the_writer_refuses_another_tensor_shape_or_dtype_than_its_layout(tmp_path: Path) -> None:
    path = tmp_path / "out.safetensors"
    writer = SafetensorsWriter(path, LAYOUT)
    attempts: list[tuple[Callable[[], object], str]] = [
        (lambda: writer.write("b", torch.zeros(3, dtype=torch.int8)),
         "the tensor 'b' out of order: the layout's order wants the tensor 'a' next"),
        (lambda: writer.write("c", torch.zeros(1)), "the layout has no tensor 'c'"),
        (lambda: writer.write("a", torch.zeros(2, 4)), "has the shape [2, 4]; the layout says"),
        (lambda: writer.write("a", torch.zeros(4, 2, dtype=torch.float64)),
         "is torch.float64; the layout says torch.float32"),
        (lambda: writer.write_rows("a", 1, torch.zeros(1, 2)), "the next is row 0, not 1"),
        (lambda: writer.write_rows("a", 0, torch.zeros(5, 2)), "go past them"),
        (lambda: writer.write_rows("a", 0, torch.zeros(1, 3)),
         "has rows of shape [2]; a piece of shape [1, 3]"),
    ]
    for attempt, fragment in attempts:
        with pytest.raises(ValueError, match=r"^\S") as caught:
            attempt()
        assert fragment in str(caught.value) and str(caught.value).startswith(f"{path}: ")
        assert "\n" not in str(caught.value)
    writer.write_rows("a", 0, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="partly written; continue it with write_rows from row 1"):
        writer.write("a", torch.zeros(4, 2))
    with pytest.raises(ValueError, match="known once the file is closed"):
        _ = writer.sha256
    with pytest.raises(ValueError, match="the tensor 'a' has 1 of its 4 rows, and 1 tensors"):
        writer.close()
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy


def test_an_incomplete_or_failed_writer_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "out.safetensors"
    complete_a_only = f"^{re.escape(str(path))}: not written: the tensor 'b' has 0 of its 3"
    with pytest.raises(ValueError, match=complete_a_only), \
            SafetensorsWriter(path, LAYOUT) as writer:
        writer.write("a", torch.zeros(4, 2))
    with pytest.raises(KeyboardInterrupt), SafetensorsWriter(path, LAYOUT) as writer:
        writer.write("a", torch.zeros(4, 2))
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="'a' is named twice"):
        SafetensorsWriter(path, [LAYOUT[0], LAYOUT[0]])
    with pytest.raises(ValueError, match=r"cannot hold torch\.complex64"):
        SafetensorsWriter(path, [("z", torch.complex64, (2,))])
    with pytest.raises(ValueError, match="metadata must map strings to strings"):
        SafetensorsWriter(path, LAYOUT, metadata={"step": 3})


def test_rows_are_read_straight_into_a_tensor_of_their_dtype_and_shape(tmp_path: Path) -> None:
    """A rank's rows land in its parameter's own memory; another dtype, a strided tensor or
    another shape is declined (the caller reads a block and copies it)."""
    weight = torch.randn(6, 5, dtype=torch.bfloat16)
    write_file(tmp_path / "w.safetensors", {"w": weight, "s": torch.tensor(3.0)})
    header = read_header(tmp_path / "w.safetensors")
    out = torch.empty(2, 5, dtype=torch.bfloat16)
    assert read_rows_into(header, "w", (2, 4), out)
    assert torch.equal(out, weight[2:4])
    scalar = torch.empty((), dtype=torch.float32)
    assert read_rows_into(header, "s", None, scalar) and scalar.item() == 3.0
    declined = [torch.zeros(2, 5),  # float32: a cast is the caller's
                torch.zeros(5, 2, dtype=torch.bfloat16).t(),  # not contiguous
                torch.zeros(3, 5, dtype=torch.bfloat16)]  # another shape
    for tensor in declined:
        assert not read_rows_into(header, "w", (2, 4), tensor)
        assert not tensor.any()  # untouched
