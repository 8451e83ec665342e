"""`dataset=token_file`: flat binary files of token ids, read window by window.

The layout nanoGPT's `train.bin`, litgpt's and torchtitan's token streams use: token ids back to
back, little-endian `uint16` (a vocabulary up to 65,536) or `uint32`, no header. Several files
are one stream in the order given. A sample is a window of `seq_len + 1` tokens: its first
`seq_len` are the inputs and its last `seq_len` the targets (each position's next token). Window
`i` starts at token `i * stride` (`stride` = `seq_len`: neighbours share one token, Megatron's
convention; `seq_len + 1`: documents of that length laid end to end share none).

Validation reads `val_path` or, without one, the stream's last `val_fraction` of windows.
`python -m runner.data tokenize` writes such files from text.

A rank reads only its rows of each batch, with `pread` into fresh buffers: its resident memory
is what the read-ahead holds, not the file (a memory map would count every page a run has
touched). What the head checks before any rank starts: every file exists, is not empty and is a
whole number of tokens, the stream has a window for training and one for validation, and a
sample of windows holds ids below the vocabulary; a rank checks every window it reads, and an id
outside the vocabulary ends the job in one line naming the file and the token's offset.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from runner.config.registry import register_dataset
from runner.data.rows import DataFileError, RowSource, source_data
from runner.zoo.datasets import ClassificationData, DatasetSpec

TOKEN_DTYPES = {"uint16": 2, "uint32": 4}
SAMPLED_WINDOWS = 16  # windows of each split the head reads and checks


@dataclass(frozen=True)
class _Piece:
    path: Path
    first: int  # the stream offset of its first token
    tokens: int


class TokenStream:
    """Files of token ids as one stream; reads any span of it, across files, thread-safe
    (`pread` moves no file offset; each file is opened once per process, on first read)."""

    def __init__(self, paths: Sequence[Path], dtype: str) -> None:
        self.dtype, self.itemsize = dtype, TOKEN_DTYPES[dtype]
        self.pieces: list[_Piece] = []
        first = 0
        for path in paths:
            size = path.stat().st_size
            self.pieces.append(_Piece(path, first, size // self.itemsize))
            first += size // self.itemsize
        self.tokens = first
        self._starts = [p.first for p in self.pieces]
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def _fd(self, piece: int) -> int:
        fd = self._fds.get(piece)
        if fd is None:
            with self._lock:
                fd = self._fds.get(piece)
                if fd is None:
                    fd = os.open(self.pieces[piece].path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    self._fds[piece] = fd
        return fd

    def span(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start + length) of the stream, int64."""
        import numpy as np

        out = np.empty(length, dtype=np.int64)
        done = 0
        piece = bisect.bisect_right(self._starts, start) - 1
        while done < length:
            p = self.pieces[piece]
            offset = start + done - p.first
            take = min(length - done, p.tokens - offset)
            data = os.pread(self._fd(piece), take * self.itemsize, offset * self.itemsize)
            if len(data) != take * self.itemsize:  # the file shrank under the run
                raise DataFileError(f"{p.path}: ends at byte {offset * self.itemsize + len(data)}"
                                    f", before token {offset + take} (the file changed during "
                                    f"the run)")
            out[done:done + take] = np.frombuffer(data, dtype=f"<u{self.itemsize}")
            done += take
            piece += 1
        return torch.from_numpy(out)

    def where(self, offset: int) -> tuple[Path, int]:
        """The file holding stream token `offset`, and the token's offset in it."""
        piece = self.pieces[bisect.bisect_right(self._starts, offset) - 1]
        return piece.path, offset - piece.first

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class TokenWindows(RowSource):
    """Windows `first` .. `first + count - 1` of a stream as next-token samples: inputs the
    window's first `seq_len` ids, targets its last `seq_len`; every id read is checked against
    the vocabulary."""

    def __init__(self, stream: TokenStream, seq_len: int, stride: int, first: int, count: int,
                 vocab_size: int) -> None:
        self.stream, self.seq_len, self.stride = stream, seq_len, stride
        self.first, self.count, self.vocab_size = first, count, vocab_size

    def __len__(self) -> int:
        return self.count

    def input_is_floating(self) -> bool:
        return False

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        """(N, seq_len + 1) token ids of windows `indices`, checked."""
        length = self.seq_len + 1
        rows = [self.stream.span((self.first + int(i)) * self.stride, length)
                for i in indices.tolist()]
        block = torch.stack(rows) if rows else torch.empty(0, length, dtype=torch.long)
        outside = block >= self.vocab_size
        if bool(outside.any()):
            row, column = (int(v) for v in outside.nonzero()[0])
            offset = (self.first + int(indices[row])) * self.stride + column
            path, at = self.stream.where(offset)
            raise DataFileError(f"{path}: token {int(block[row, column])} at token offset {at} "
                                f"(byte {at * self.stream.itemsize}) is outside the vocabulary "
                                f"[0, {self.vocab_size})")
        return block

    def read(self, indices: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.windows(indices)
        return block[:, :-1], block[:, 1:]


def listed_paths(value: str | Sequence[str] | None) -> list[Path]:
    """A dataset's `path`-like option (one path or a list of them) as paths."""
    if value is None:
        return []
    items = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    return [Path(str(item)).expanduser() for item in items]


def _vocabulary_of(tokenizer: str) -> int:
    """The vocabulary size of a local `tokenizer.json` (its largest id + 1)."""
    from runner.data.tokenize import TokenizeError, load_tokenizer

    try:
        return load_tokenizer(tokenizer, eos=False, dtype="uint32").vocab_size
    except TokenizeError as exc:
        raise ValueError(f"dataset.tokenizer: {exc}") from None


@register_dataset("token_file")
class TokenFile:
    """Token ids in flat binary files (module docstring): next-token windows of `seq_len`."""

    def __init__(self, path: str | Sequence[str] | None = None,
                 val_path: str | Sequence[str] | None = None, dtype: str = "uint16",
                 seq_len: int = 256, stride: int | None = None, vocab_size: int | None = None,
                 tokenizer: str | None = None, val_fraction: float = 0.01) -> None:
        problems = []
        self.paths, self.val_paths = listed_paths(path), listed_paths(val_path)
        if not self.paths:
            problems.append("dataset.path is required: a file of token ids (or a list of "
                            "them), as `python -m runner.data tokenize` writes it")
        if dtype not in TOKEN_DTYPES:
            problems.append(f"dataset.dtype must be one of {', '.join(TOKEN_DTYPES)}, got "
                            f"{dtype}")
        if seq_len < 1:
            problems.append(f"dataset.seq_len must be >= 1, got {seq_len}")
        if stride is not None and stride < 1:
            problems.append(f"dataset.stride must be >= 1 (null: seq_len), got {stride}")
        if vocab_size is None and tokenizer is None:
            problems.append("dataset.vocab_size is required (or dataset.tokenizer, a "
                            "tokenizer.json whose vocabulary it is)")
        if vocab_size is not None and not 2 <= vocab_size <= 2 ** (8 * TOKEN_DTYPES.get(
                dtype, 4)):
            problems.append(f"dataset.vocab_size={vocab_size}: must be >= 2 and fit "
                            f"dataset.dtype={dtype}")
        if not self.val_paths and not 0.0 < val_fraction < 1.0:
            problems.append(f"dataset.val_fraction must be in (0, 1) without "
                            f"dataset.val_path, got {val_fraction}")
        if problems:
            raise ValueError("; ".join(problems))
        self.dtype, self.seq_len = dtype, seq_len
        self.stride = stride if stride is not None else seq_len
        self.vocab_size = vocab_size if vocab_size is not None else _vocabulary_of(
            str(tokenizer))
        self.val_fraction = val_fraction
        self._streams: tuple[TokenStream, TokenStream | None] | None = None

    def _checked_stream(self, paths: list[Path], key: str) -> TokenStream:
        itemsize = TOKEN_DTYPES[self.dtype]
        for path in paths:
            if not path.is_file():
                raise DataFileError(f"dataset.{key}: {path}: no such file")
            size = path.stat().st_size
            if size == 0:
                raise DataFileError(f"dataset.{key}: {path} is empty")
            if size % itemsize:
                raise DataFileError(f"dataset.{key}: {path} has {size} bytes, not a whole "
                                    f"number of {itemsize}-byte tokens (dataset.dtype="
                                    f"{self.dtype})")
        return TokenStream(paths, self.dtype)

    def streams(self) -> tuple[TokenStream, TokenStream | None]:
        """The training stream and the validation one (None: the training stream's tail)."""
        if self._streams is None:
            train = self._checked_stream(self.paths, "path")
            val = self._checked_stream(self.val_paths, "val_path") if self.val_paths else None
            self._streams = (train, val)
        return self._streams

    def _windows_in(self, stream: TokenStream) -> int:
        return max(0, (stream.tokens - self.seq_len - 1) // self.stride + 1)

    def sources(self) -> tuple[TokenWindows, TokenWindows]:
        train, val = self.streams()
        windows = self._windows_in(train)
        need = f"{self.seq_len + 1} tokens (dataset.seq_len + 1)"
        if val is None:
            held = max(1, round(windows * self.val_fraction))
            if windows - held < 1:
                raise DataFileError(f"dataset.path: {train.tokens} tokens make {windows} "
                                    f"window(s) of {need}: too few to hold out "
                                    f"dataset.val_fraction={self.val_fraction} and train")
            return (TokenWindows(train, self.seq_len, self.stride, 0, windows - held,
                                 self.vocab_size),
                    TokenWindows(train, self.seq_len, self.stride, windows - held, held,
                                 self.vocab_size))
        if windows < 1:
            raise DataFileError(f"dataset.path: {train.tokens} tokens, fewer than {need}")
        val_windows = self._windows_in(val)
        if val_windows < 1:
            raise DataFileError(f"dataset.val_path: {val.tokens} tokens, fewer than {need}")
        return (TokenWindows(train, self.seq_len, self.stride, 0, windows, self.vocab_size),
                TokenWindows(val, self.seq_len, self.stride, 0, val_windows, self.vocab_size))

    def spec(self) -> DatasetSpec:
        train, val = self.sources()
        return DatasetSpec((self.seq_len,), self.vocab_size, len(train), len(val),
                           vocab_size=self.vocab_size, target_shape=(self.seq_len,))

    def check(self) -> None:
        """The head's look before any rank starts: the files (`spec`), and a sample of each
        split's windows read and checked."""
        from runner.zoo.userdata import sampled_rows

        for source in self.sources():
            source.windows(torch.tensor(sampled_rows(len(source)), dtype=torch.long))

    def load(self) -> ClassificationData:
        return source_data(*self.sources())

    def next_token(self) -> TokenFile:
        """A token file is next-token samples already."""
        return self
