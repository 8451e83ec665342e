"""`dataset=text`: documents on disk (JSON lines, Parquet, .txt), tokenized once into a cache of
token files, then exactly `dataset=token_file` over them.

Each input file is tokenized by `runner.data.tokenize` (what `python -m runner.data tokenize`
runs: the same ids, the end-of-text token after every document) into its own cache file, named
by a hash of what determines its tokens: the file's absolute path, size and mtime_ns, the
tokenizer file's sha256 and the tokenizers library's version, `field`, `eos` and the ids' type.
A changed input or tokenizer is a new name, so a stale cache is never read; an unchanged one is
reused by every later run (and by every rank of this one). A cache file is written under a name
of its own process and renamed into place, so processes that tokenize the same file at once
write the same bytes and one rename wins.

Tokenizing happens where `spec()` is first called: the head checks every run (`spec`, `check`)
before any rank starts, so the ranks find the cache written and only hash the tokenizer and
look at the inputs' sizes and times. The cache must be a directory the ranks see too (like the
data): `cache_dir`, else `$GRIDRUN_CACHE/tokens`, else `~/.cache/gridrun/tokens`. Its files
can be deleted at any time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from runner.config.machine import cache_subdir
from runner.config.registry import register_dataset
from runner.data.rows import DataFileError
from runner.data.token_file import TokenFile, listed_paths
from runner.data.tokenize import (
    Encoder,
    InputFile,
    PreparedTokenizer,
    Tally,
    TokenizeError,
    default_workers,
    load_tokenizer,
    open_inputs,
)
from runner.zoo.datasets import ClassificationData, DatasetSpec

CACHE_FORMAT = 1  # in every cache name: a change to the tokens' layout is a new name
SAID_BYTES = 8 << 20  # inputs from this size on are announced on standard error as tokenized


def token_cache_dir(cache_dir: str | None = None) -> Path:
    """Where dataset=text keeps its token files (module docstring)."""
    return cache_subdir("tokens", cache_dir)


def _input_stat(path: Path, key: str) -> os.stat_result:
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise DataFileError(f"dataset.{key}: {path}: no such file") from None
    except OSError as exc:
        raise DataFileError(f"dataset.{key}: {path}: {exc.strerror}") from None
    if not path.is_file():
        raise DataFileError(f"dataset.{key}: {path}: not a file")
    return stat


def cache_name(path: Path, stat: os.stat_result, tokenizer: PreparedTokenizer, field: str,
               eos: bool) -> str:
    """The cache file of one input: its stem (for a person looking) and the hash."""
    import tokenizers

    what = {"format": CACHE_FORMAT, "input": str(path.resolve()), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "tokenizer_sha256": tokenizer.sha256,
            "tokenizers": tokenizers.__version__, "field": field, "eos": eos,
            "dtype": tokenizer.dtype}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)[:48]
    return f"{stem}-{digest}.{tokenizer.dtype}.bin"


@register_dataset("text")
class TextFiles:
    """Documents tokenized into a cache (module docstring), read as `dataset=token_file`:
    next-token windows of `seq_len` over the files' tokens, validation `val_path` or the last
    `val_fraction` of the windows."""

    def __init__(self, path: str | Sequence[str] | None = None, field: str = "text",
                 tokenizer: str | None = None, seq_len: int = 256, stride: int | None = None,
                 val_path: str | Sequence[str] | None = None, val_fraction: float = 0.01,
                 eos: bool = True, cache_dir: str | None = None) -> None:
        problems = []
        self.paths, self.val_paths = listed_paths(path), listed_paths(val_path)
        if not self.paths:
            problems.append("dataset.path is required: a JSON-lines, Parquet or .txt file (or "
                            "a list of them)")
        if not tokenizer:
            problems.append("dataset.tokenizer is required: a local tokenizer.json")
        if not field:
            problems.append("dataset.field must name the JSON field or Parquet column of the "
                            "text")
        if seq_len < 1:
            problems.append(f"dataset.seq_len must be >= 1, got {seq_len}")
        if stride is not None and stride < 1:
            problems.append(f"dataset.stride must be >= 1 (null: seq_len), got {stride}")
        if not self.val_paths and not 0.0 < val_fraction < 1.0:
            problems.append(f"dataset.val_fraction must be in (0, 1) without "
                            f"dataset.val_path, got {val_fraction}")
        if problems:
            raise ValueError("; ".join(problems))
        self.field, self.tokenizer, self.eos = field, str(tokenizer), eos
        self.seq_len, self.stride, self.val_fraction = seq_len, stride, val_fraction
        self.cache_dir = token_cache_dir(cache_dir)
        self._tokens: TokenFile | None = None

    def token_file(self) -> TokenFile:
        """`dataset=token_file` over the cache files, tokenizing the inputs not cached yet."""
        if self._tokens is None:
            try:
                prepared = load_tokenizer(self.tokenizer, eos=self.eos)
            except TokenizeError as exc:
                raise ValueError(f"dataset.tokenizer: {exc}") from None
            train = self._cached(self.paths, "path", prepared)
            val = self._cached(self.val_paths, "val_path", prepared) if self.val_paths else None
            self._tokens = TokenFile(path=[str(p) for p in train],
                                     val_path=[str(p) for p in val] if val else None,
                                     dtype=prepared.dtype, seq_len=self.seq_len,
                                     stride=self.stride, vocab_size=prepared.vocab_size,
                                     val_fraction=self.val_fraction)
        return self._tokens

    def _cached(self, paths: list[Path], key: str, prepared: PreparedTokenizer) -> list[Path]:
        """The cache file of each of `paths`, the missing ones tokenized (all of them checked
        first: a bad file is named before any is tokenized)."""
        stats = [_input_stat(path, key) for path in paths]
        cached = [self.cache_dir / cache_name(path, stat, prepared, self.field, self.eos)
                  for path, stat in zip(paths, stats, strict=True)]
        missing = [i for i, file in enumerate(cached) if not file.is_file()]
        if missing:
            try:
                inputs = open_inputs([paths[i] for i in missing], self.field)
                self._tokenize(inputs, [stats[i] for i in missing],
                               [cached[i] for i in missing], prepared)
            except TokenizeError as exc:
                raise DataFileError(f"dataset.{key}: {exc}") from None
        for path, file in zip(paths, cached, strict=True):
            if file.stat().st_size == 0:  # no eos and only empty documents
                raise DataFileError(f"dataset.{key}: {path}: its documents make no tokens")
        return cached

    def _tokenize(self, inputs: list[InputFile], stats: list[os.stat_result],
                  cached: list[Path], prepared: PreparedTokenizer) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataFileError(f"dataset.cache_dir={self.cache_dir}: cannot be made "
                                f"({exc.strerror})") from None
        size = sum(stat.st_size for stat in stats)
        said = size >= SAID_BYTES  # a wait worth a word; small inputs are quiet
        if said:
            print(f"dataset=text: tokenizing {len(inputs)} file(s), {size / 1e6:,.1f} MB, "
                  f"into {self.cache_dir} (once: later runs reuse it)", file=sys.stderr,
                  flush=True)
        total = Tally()
        with Encoder(prepared, default_workers(inputs)) as encoder:
            for source, stat, file in zip(inputs, stats, cached, strict=True):
                partial = file.with_name(f"{file.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                                         f".partial")
                total.add(encoder.write([source], file, partial))
                now = source.path.stat()
                if (now.st_size, now.st_mtime_ns) != (stat.st_size, stat.st_mtime_ns):
                    file.unlink(missing_ok=True)
                    raise TokenizeError(f"{source.path}: changed while it was tokenized")
        if said:
            rate = total.tokens / total.seconds if total.seconds > 0 else 0.0
            print(f"dataset=text: {total.documents:,} documents, {total.tokens:,} tokens "
                  f"({prepared.dtype}) in {total.seconds:.1f} s, {rate:,.0f} tokens/s",
                  file=sys.stderr, flush=True)

    def spec(self) -> DatasetSpec:
        return self.token_file().spec()

    def check(self) -> None:
        """The head's look: the inputs tokenized (`spec`), then TokenFile's check of a sample
        of windows."""
        self.token_file().check()

    def load(self) -> ClassificationData:
        return self.token_file().load()

    def next_token(self) -> TextFiles:
        """Text is next-token samples already (tokenized where `spec` is first called)."""
        return self
