"""Documents to token ids: what `python -m runner.data tokenize` and `dataset=text` run.

Input files hold documents: JSON lines (`.jsonl`, `.ndjson`, `.json`, each optionally `.gz`: an
object per line, the document's text in `field`; blank lines skipped), Parquet (`.parquet`: a
document per row, the string column `field`, read a record batch at a time) or plain text
(`.txt`: the whole file is ONE document, read whole). Each document is encoded with a local
`tokenizer.json` (the tokenizers library) as it stands: no template of the tokenizer's
post-processor (no BOS or CLS added), no truncation or padding, and a special token's text in a
document encoded as plain text, so that the only end-of-text tokens are the ones placed here:
one after every document unless `eos` is off. The ids go to a flat file (`dataset=token_file`'s
layout: little-endian uint16 when the vocabulary fits 65,536 ids, else uint32, no header) in
the input order, whatever the number of worker processes.

Memory does not grow with the corpus: documents are read in chunks (`CHUNK_DOCUMENTS`, at most
`CHUNK_CHARS` characters), a bounded number of chunks is in flight to the workers, and each
chunk's ids are written as it comes back. The output is written to a partial file, synced and
renamed at the end: an interrupted or failed run leaves nothing under the output's name.

Every problem with the inputs or the tokenizer is a `TokenizeError`: one line naming the file
(and the line or row). No torch here: a worker process imports only this module and the
tokenizers library.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import hashlib
import json
import multiprocessing
import os
import signal
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The end-of-text token: the first of these the tokenizer has as a special token, else the
# first in its vocabulary.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
DTYPE_BYTES = {"uint16": 2, "uint32": 4}  # dataset=token_file's TOKEN_DTYPES
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CHUNK_DOCUMENTS = 1000
CHUNK_CHARS = 4 << 20  # a chunk closes early at this many characters (long documents)
IN_FLIGHT_PER_WORKER = 2  # chunks handed to the workers ahead of the one being written
SMALL_INPUT_BYTES = 8 << 20  # below this, workers cost more to start than they save
MAX_DEFAULT_WORKERS = 8
_NAMES_SHOWN = 10  # fields or columns listed in one message, at most


class TokenizeError(ValueError):
    """An input file or the tokenizer is not what tokenizing needs: one line naming it."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _NAMES_SHOWN else "")


# -- the tokenizer -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedTokenizer:
    """A checked tokenizer file: what encoding needs, and what names the tokens it makes."""

    path: Path
    text: str  # the file's JSON, from which each worker builds its own tokenizer
    sha256: str
    vocab_size: int  # the largest id + 1
    eos_id: int | None  # None: no end-of-text token appended
    eos_name: str | None
    dtype: str


def _configured(tokenizer: Any) -> Any:
    """The tokenizer set to encode documents as they are (module docstring)."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    if hasattr(tokenizer, "encode_special_tokens"):  # tokenizers >= 0.19
        tokenizer.encode_special_tokens = True
    return tokenizer


def find_eos(tokenizer: Any) -> tuple[str, int] | None:
    """The end-of-text token (`EOS_NAMES`) of a `tokenizers.Tokenizer`, and its id."""
    added: dict[int, Any] = getattr(tokenizer, "get_added_tokens_decoder", dict)()
    special = {token.content: int(i) for i, token in added.items()
               if getattr(token, "special", False)}
    for name in EOS_NAMES:
        if name in special:
            return name, special[name]
    for name in EOS_NAMES:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return name, int(found)
    return None


def load_tokenizer(path: str | os.PathLike[str], eos: bool = True,
                   dtype: str = "auto") -> PreparedTokenizer:
    """Read and check a local tokenizer.json: it parses, has an end-of-text token where `eos`
    is wanted, and its ids fit `dtype` (`auto`: uint16 when they fit, else uint32)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizeError("tokenizing needs the tokenizers library: pip install tokenizers "
                            "(or pip install 'gridrun[data]')") from None
    file = Path(path).expanduser()
    if not file.exists():
        raise TokenizeError(f"{path}: no such tokenizer file")
    if not file.is_file():
        raise TokenizeError(f"{path}: not a file (a tokenizer.json is needed)")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # the library's parse error, or bytes that are not text
        raise TokenizeError(f"{path}: not a tokenizers file ({_first_line(exc)})") from None
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    vocab_size = max(max(ids, default=-1) + 1,
                     int(tokenizer.get_vocab_size(with_added_tokens=True)))
    if vocab_size < 2:
        raise TokenizeError(f"{path}: the tokenizer has {vocab_size} token(s)")
    eos_name = eos_id = None
    if eos:
        found = find_eos(tokenizer)
        if found is None:
            raise TokenizeError(f"{path}: no end-of-text token (none of "
                                f"{', '.join(EOS_NAMES)}): pass --no-eos (dataset.eos=false) "
                                f"to join documents without one, or add one to the tokenizer")
        eos_name, eos_id = found
    if dtype == "auto":
        dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"
    if dtype not in DTYPE_BYTES:
        raise TokenizeError(f"dtype must be auto, uint16 or uint32, got {dtype}")
    if vocab_size > 2 ** (8 * DTYPE_BYTES[dtype]):
        raise TokenizeError(f"{path}: {vocab_size} token ids do not fit {dtype}: use uint32 "
                            f"(or auto)")
    return PreparedTokenizer(file, text, hashlib.sha256(raw).hexdigest(), vocab_size, eos_id,
                             eos_name, dtype)


def encode(tokenizer: Any, documents: Sequence[str], eos_id: int | None, dtype: str) -> bytes:
    """The ids of `documents`, each followed by `eos_id` (None: nothing), as `dtype` bytes
    (little-endian)."""
    import numpy as np

    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
    ids: list[int] = []
    for encoding in batch(list(documents), add_special_tokens=False):
        ids.extend(encoding.ids)
        if eos_id is not None:
            ids.append(eos_id)
    return np.asarray(ids, dtype=f"<u{DTYPE_BYTES[dtype]}").tobytes()


# -- the inputs ----------------------------------------------------------------------------------


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _text_type(arrow_type: Any) -> bool:
    """Whether a Parquet column of this Arrow type holds strings."""
    import pyarrow as pa  # type: ignore[import-untyped]

    if pa.types.is_dictionary(arrow_type):
        return _text_type(arrow_type.value_type)
    return bool(pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)
                or getattr(pa.types, "is_string_view", lambda _: False)(arrow_type))


@dataclass(frozen=True)
class InputFile:
    """One input file and how its documents are read (`kind`: jsonl, parquet or txt)."""

    path: Path
    kind: str
    field: str

    def size(self) -> int:
        return self.path.stat().st_size

    def documents(self) -> Iterator[str]:
        """Every document's text, in the file's order; a bad one raises `TokenizeError`
        naming the file and its line (JSONL) or row (Parquet, counted from 1)."""
        if self.kind == "txt":
            yield self._whole_text()
        elif self.kind == "parquet":
            for batch in self._parquet_batches():
                yield from batch
        else:
            with self._open_lines() as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        yield self._jsonl_text(number, line)

    def check_first(self) -> None:
        """The file holds a document, and its first one is readable (the up-front look)."""
        if self.kind == "txt":
            if self.size() == 0:
                raise TokenizeError(f"{self.path}: empty (a .txt file is one document)")
            with open(self.path, "rb") as file:
                head = file.read(64 << 10)
            try:  # a character cut at the end of the look is no error
                codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < 64 << 10)
            except UnicodeDecodeError as exc:
                raise TokenizeError(f"{self.path}: not UTF-8 text (byte {exc.start})") from None
            return
        if self.kind == "parquet":
            file = self._parquet_file()
            if file.metadata.num_rows == 0:
                raise TokenizeError(f"{self.path}: no rows (no documents)")
            for _ in self._parquet_batches(batch_size=1, rows=1):
                return
            return
        with self._open_lines() as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    self._jsonl_text(number, line)
                    return
        raise TokenizeError(f"{self.path}: empty (no JSON lines, no documents)")

    # JSON lines

    @contextlib.contextmanager
    def _open_lines(self) -> Iterator[Iterable[bytes]]:
        compressed = self.path.name.lower().endswith(".gz")
        try:
            with (gzip.open(self.path, "rb") if compressed else open(self.path, "rb")) as opened:
                yield opened
        except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a corrupt .gz
            reason = getattr(exc, "strerror", None) or _first_line(exc)
            raise TokenizeError(f"{self.path}: cannot be read ({reason})") from None

    def _jsonl_text(self, number: int, line: bytes) -> str:
        where = f"{self.path}:{number}"
        try:
            row = json.loads(line)
        except UnicodeDecodeError:
            raise TokenizeError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise TokenizeError(f"{where}: not JSON ({exc.msg} at column {exc.colno})"
                                ) from None
        if not isinstance(row, dict):
            raise TokenizeError(f"{where}: a JSON {_json_type(row)}, not an object with a "
                                f"\"{self.field}\" field")
        if self.field not in row:
            raise TokenizeError(f"{where}: no \"{self.field}\" field (the line has: "
                                f"{_listed(list(row)) or 'no fields'})")
        text = row[self.field]
        if not isinstance(text, str):
            raise TokenizeError(f"{where}: \"{self.field}\" is a JSON {_json_type(text)}, "
                                f"not a string")
        return text

    # Parquet

    def _parquet_file(self) -> Any:
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]
        except ImportError:
            raise TokenizeError(f"{self.path}: reading Parquet needs pyarrow: pip install "
                                f"pyarrow (or pip install 'gridrun[data]')") from None
        try:
            file = pq.ParquetFile(self.path)
        except Exception as exc:  # pyarrow's ArrowInvalid and friends: not a Parquet file
            raise TokenizeError(f"{self.path}: not a Parquet file ({_first_line(exc)})"
                                ) from None
        schema = file.schema_arrow
        if self.field not in schema.names:
            raise TokenizeError(f"{self.path}: no column \"{self.field}\" (its columns: "
                                f"{_listed(schema.names) or 'none'})")
        kind = schema.field(self.field).type
        if not _text_type(kind):
            raise TokenizeError(f"{self.path}: column \"{self.field}\" holds {kind}, not "
                                f"strings")
        return file

    def _parquet_batches(self, batch_size: int = CHUNK_DOCUMENTS,
                         rows: int | None = None) -> Iterator[list[str]]:
        file = self._parquet_file()
        row = 0
        try:
            for batch in file.iter_batches(batch_size=batch_size, columns=[self.field],
                                           use_threads=False):
                texts = batch.column(0).to_pylist()
                for offset, text in enumerate(texts):
                    if not isinstance(text, str):
                        raise TokenizeError(f"{self.path}: row {row + offset + 1}: "
                                            f"\"{self.field}\" is {_json_type(text)}, not a "
                                            f"string")
                yield texts
                row += len(texts)
                if rows is not None and row >= rows:
                    return
        except TokenizeError:
            raise
        except Exception as exc:  # a corrupt page met while reading
            raise TokenizeError(f"{self.path}: row {row + 1} onwards cannot be read "
                                f"({_first_line(exc)})") from None

    # plain text

    def _whole_text(self) -> str:
        raw = self.path.read_bytes()
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TokenizeError(f"{self.path}: not UTF-8 text (byte {exc.start})") from None


def kind_of(path: Path) -> str | None:
    """jsonl, parquet or txt by the file's name; None for a name of none of them."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
        return "jsonl" if name.endswith(JSONL_SUFFIXES) else None
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "txt"
    return None


def open_inputs(paths: Iterable[str | os.PathLike[str]], field: str = "text"
                ) -> list[InputFile]:
    """The input files, each checked before anything is tokenized: it exists, its kind is
    known by its name, it holds a document and its first document is readable."""
    inputs = []
    for given in paths:
        path = Path(given).expanduser()
        if not path.exists():
            raise TokenizeError(f"{given}: no such file")
        if not path.is_file():
            raise TokenizeError(f"{given}: not a file")
        kind = kind_of(path)
        if kind is None:
            raise TokenizeError(f"{given}: not a known kind of file: .jsonl, .ndjson or .json "
                                f"(JSON lines, optionally .gz), .parquet, or .txt (one "
                                f"document)")
        inputs.append(InputFile(path, kind, field))
    if not inputs:
        raise TokenizeError("no input files")
    for source in inputs:
        source.check_first()
    return inputs


def chunks(inputs: Iterable[InputFile]) -> Iterator[list[str]]:
    """The documents of every input, in order, in lists of at most `CHUNK_DOCUMENTS` (fewer
    where they reach `CHUNK_CHARS` characters)."""
    chunk: list[str] = []
    chars = 0
    for source in inputs:
        for text in source.documents():
            chunk.append(text)
            chars += len(text)
            if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
                yield chunk
                chunk, chars = [], 0
    if chunk:
        yield chunk


# -- encoding, in this process or in workers -----------------------------------------------------


def default_workers(inputs: Sequence[InputFile]) -> int:
    """The CPUs this process may use, at most `MAX_DEFAULT_WORKERS`; 1 (this process) for
    inputs under `SMALL_INPUT_BYTES`."""
    if sum(source.size() for source in inputs) < SMALL_INPUT_BYTES:
        return 1
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_DEFAULT_WORKERS))


@contextlib.contextmanager
def _serial_tokenizers() -> Iterator[None]:
    """The tokenizers library's thread pool off while this process encodes: a process that
    used it and then forks (a head starting its ranks) has the library warn in the child."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


_worker_state: tuple[Any, int | None, str] | None = None


def _start_worker(text: str, eos_id: int | None, dtype: str) -> None:
    """A worker process's start: its own tokenizer, one thread (the workers are the
    parallelism), Ctrl-C left to the parent, which stops the workers itself."""
    global _worker_state
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _worker_state = (_configured(Tokenizer.from_str(text)), eos_id, dtype)


def _encode_in_worker(documents: list[str]) -> bytes:
    assert _worker_state is not None
    tokenizer, eos_id, dtype = _worker_state
    return encode(tokenizer, documents, eos_id, dtype)


@dataclass
class Tally:
    """What a tokenization wrote."""

    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, other: Tally) -> None:
        self.documents += other.documents
        self.tokens += other.tokens
        self.bytes += other.bytes
        self.seconds += other.seconds


class Encoder:
    """Encodes documents with a prepared tokenizer in this process (`workers` 1) or in
    `workers` spawned processes; `write` may be called for several outputs (one pool).
    Use as a context manager: leaving it stops the workers."""

    def __init__(self, tokenizer: PreparedTokenizer, workers: int = 1) -> None:
        if workers < 1:
            raise TokenizeError(f"workers must be >= 1, got {workers}")
        self.tokenizer, self.workers = tokenizer, workers
        self._local: Any = None
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _encoded(self, documents: Iterable[list[str]]) -> Iterator[tuple[bytes, int]]:
        """Each chunk's bytes and document count, in the chunks' order."""
        prepared = self.tokenizer
        if self.workers == 1:
            if self._local is None:
                from tokenizers import Tokenizer

                self._local = _configured(Tokenizer.from_str(prepared.text))
            for chunk in documents:
                with _serial_tokenizers():
                    data = encode(self._local, chunk, prepared.eos_id, prepared.dtype)
                yield data, len(chunk)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(prepared.text, prepared.eos_id, prepared.dtype))
        # A bounded window of chunks in flight, taken back in order: the output is the input
        # order, and the reader stays only a few chunks ahead of the writer (Pool.imap's
        # feeder would read the whole corpus ahead into memory).
        pending: deque[tuple[Future[bytes], int]] = deque()
        try:
            for chunk in documents:
                pending.append((self._pool.submit(_encode_in_worker, chunk), len(chunk)))
                if len(pending) >= IN_FLIGHT_PER_WORKER * self.workers:
                    future, count = pending.popleft()
                    yield future.result(), count
            while pending:
                future, count = pending.popleft()
                yield future.result(), count
        except BrokenProcessPool:
            raise TokenizeError("a tokenizing worker process ended abruptly (out of memory? "
                                "try fewer workers)") from None
        finally:
            for future, _ in pending:
                future.cancel()

    def write(self, inputs: Sequence[InputFile], out: Path, partial: Path | None = None
              ) -> Tally:
        """Tokenize `inputs` into `out`: written to `partial` (default `OUT.partial`), synced
        and renamed to `out`; on any failure the partial file is removed and `out` left as it
        was."""
        partial = partial if partial is not None else out.with_name(out.name + ".partial")
        start = time.perf_counter()
        tally = Tally()
        try:
            with open(partial, "wb") as file:
                for data, count in self._encoded(chunks(inputs)):
                    file.write(data)
                    tally.documents += count
                    tally.bytes += len(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, out)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
        tally.tokens = tally.bytes // DTYPE_BYTES[self.tokenizer.dtype]
        tally.seconds = time.perf_counter() - start
        return tally
