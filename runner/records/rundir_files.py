"""Reading a run directory's files as data that may come from anyone, within bounds.

A run directory can be copied from anywhere, so its files are read by rules no file can break:
at most so many bytes a file (`LIMITS`), so many bytes a line, so many levels of nesting and so
many digits an integer; a file that is no regular file (a FIFO, a device) is not opened for
reading. Beyond a bound the file is refused: `RunFileError`, whose message names the file, the
line where one is known, and why, in one line. Text within the bounds that is no valid JSON,
YAML or CSV is the caller's to judge (the parsers' own errors); no parser here ever recurses
past Python's limit or raises on a number's size.

Values are returned as written: a non-finite or absurd number is the caller's to leave out.

YAML is data too, whatever reads it next: `parse_yaml` refuses a tag (`!!python/object/...`,
`!custom`: the one place a YAML loader constructs more than plain values) and, unless the caller
only shows the values, an OmegaConf interpolation (`${oc.env:NAME}`: resolved later, it would
copy this machine's environment or run a resolver). gridrun writes its config.yaml resolved, so
a file of its own holds neither. Text that is no YAML is refused as well (`NotYaml`), in one line.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml

from runner.records import safe_paths

MIB = 2**20
MAX_FILE_BYTES = 4 * MIB  # config.yaml, summary.json, overrides.yaml: a few kB as gridrun writes
LIMITS = {"metrics.jsonl": 256 * MIB, "sweep_summary.csv": 32 * MIB}
MAX_LINE_BYTES = MIB  # a metrics line gridrun writes is under 1 kB
MAX_DEPTH = 32  # gridrun's own files nest a few levels, a user's model arguments a few more
MAX_VALUES = 100_000  # values of one YAML document, an alias counted each time it is used
MAX_INT_DIGITS = 100  # int() refuses past 4300 digits; no count gridrun writes has 20


class RunFileError(ValueError):
    """A run file beyond the bounds it is read within; the message is the one line shown."""

    def __init__(self, path: Path, why: str, line: int | None = None) -> None:
        self.path, self.why, self.line = path, why, line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {why}: refused")


def limit_of(path: Path) -> int:
    """The most bytes read from a file of this name."""
    return LIMITS.get(path.name, MAX_FILE_BYTES)


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n:,} bytes"


def _too_large(path: Path, size: int, limit: int) -> RunFileError:
    return RunFileError(path, f"{_size(size)}, more than the {_size(limit)} read from a "
                              f"{path.name}")


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[IO[bytes]]:
    """The file open for reading, once it is known to be a regular file no larger than its
    limit, reached without following a link (`safe_paths`: from its run directory where one
    is registered, else its own name). Opened without blocking: a FIFO in the run's place
    would wait for a writer."""
    try:  # from the run directory, no link followed: its files are read from inside it
        fd = safe_paths.open_file(*safe_paths.locate(path), os.O_RDONLY)
    except safe_paths.LinkRefused as exc:
        how = ("a symbolic link" if exc.filename == str(Path(os.path.abspath(path)))
               else f"reached through the symbolic link {exc.filename}")
        raise RunFileError(path, f"{how} (a run's files are read only from inside it)") from None
    except safe_paths.NotRegularRefused:
        raise RunFileError(path, "not a regular file") from None
    except OSError as exc:
        raise RunFileError(path, f"cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if info.st_size > limit_of(path):
            raise _too_large(path, info.st_size, limit_of(path))
        yield f


def read_text(path: Path, errors: str = "replace") -> str:
    """The whole file as UTF-8 (`errors` as for `bytes.decode`), within its size limit."""
    limit = limit_of(path)
    with _open_regular(path) as f:
        data = f.read(limit + 1)  # the file may have grown since it was measured
    if len(data) > limit:
        raise _too_large(path, len(data), limit)
    return data.decode("utf-8", errors=errors)


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, each within `MAX_LINE_BYTES` and all within the
    file's limit; read one at a time, so memory holds one line, not the file."""
    limit, total = limit_of(path), 0
    with _open_regular(path) as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            total += len(raw)
            if total > limit:  # grown since it was measured
                raise _too_large(path, total, limit)
            if len(raw) > MAX_LINE_BYTES:
                raise RunFileError(path, f"a line of more than {_size(MAX_LINE_BYTES)}", number)
            yield number, raw.decode("utf-8", errors="replace")


# a JSON string (no raw newline inside one), a bracket or a newline: what the depth scan counts
_JSON_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[\[\]{}\n]')


def _json_too_deep(text: str) -> int | None:
    """The line (of `text`, from 1) where its JSON nests deeper than `MAX_DEPTH`; None when it
    does not. Brackets inside strings do not count."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # the common case, at C speed
        return None
    depth, line = 0, 1
    for token in _JSON_TOKEN.finditer(text):
        char = token.group()[0]
        if char == "\n":
            line += 1
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return line
        elif char in "]}":
            depth -= 1
    return None


# a JSON string, a number (fraction, exponent) or a newline: what the integer search reads
_JSON_NUMBER = re.compile(r'"(?:[^"\\\n]|\\.)*"|-?(\d+)(\.\d+)?([eE][-+]?\d+)?|\n')


def _long_integer_line(text: str) -> int | None:
    """The line (of `text`, from 1) of its first integer of more than `MAX_INT_DIGITS`
    digits outside strings."""
    line = 1
    for token in _JSON_NUMBER.finditer(text):
        digits, fraction, exponent = token.groups()
        if token.group() == "\n":
            line += 1
        elif digits and not fraction and not exponent and len(digits) > MAX_INT_DIGITS:
            return line
    return None


class _LongInteger(ValueError):
    def __init__(self, digits: int) -> None:
        super().__init__(f"an integer of {digits:,} digits (at most {MAX_INT_DIGITS} are read)")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _LongInteger(len(text.lstrip("-")))
    return int(text)


def parse_json(text: str, path: Path, line: int | None = None) -> Any:
    """JSON text as Python values; `RunFileError` beyond the bounds (naming `line`, or the
    line of `text` where it goes beyond them), `json.JSONDecodeError` for text that is no
    JSON."""
    deep = _json_too_deep(text)
    if deep is not None:
        raise RunFileError(path, f"nested deeper than {MAX_DEPTH} levels", line or deep)
    try:
        return json.loads(text, parse_int=_integer)
    except _LongInteger as exc:
        raise RunFileError(path, str(exc), line or _long_integer_line(text)) from None


def load_json(path: Path) -> Any:
    """A JSON file (summary.json) within the bounds; see `parse_json`."""
    return parse_json(read_text(path), path)


class NotYaml(RunFileError):
    """Text within the bounds that is no YAML (or holds a value YAML's constructors refuse)."""


_YAML_TAGS = "tag:yaml.org,2002:"


def _shown(text: str, most: int = 60) -> str:
    return text if len(text) <= most else f"{text[:most - 3]}..."


def _scan_yaml(text: str, path: Path) -> None:
    """`RunFileError` for YAML text that nests deeper than `MAX_DEPTH` as written or carries a
    tag, naming its line: from the parser's events, which come without recursion (composing a
    document recurses once per level) and before any constructor runs."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        tag = getattr(event, "tag", None)  # an explicit tag only: plain values have none
        if tag is not None:
            written = f"!!{tag[len(_YAML_TAGS):]}" if tag.startswith(_YAML_TAGS) else tag
            raise RunFileError(path, f"a YAML tag {_shown(written)!r} (a run's files are data: "
                                     "no tag is constructed)", event.start_mark.line + 1)
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise RunFileError(path, f"nested deeper than {MAX_DEPTH} levels",
                                   event.start_mark.line + 1)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


# `${` opens an OmegaConf interpolation unless an odd number of backslashes escapes it
_INTERPOLATION = re.compile(r"(?<!\\)(?:\\\\)*\$\{")


def interpolation(value: Any) -> tuple[str, str] | None:
    """The first key (dotted, `[i]` for a list item) whose text holds an OmegaConf
    interpolation, in file order, and that text; None when none does. `$` alone and an escaped
    `\\${` are text to OmegaConf too. YAML anchors, shared or recursive, are walked once."""
    stack: list[tuple[str, Any]] = [("", value)]
    seen: set[int] = set()
    while stack:
        key, item = stack.pop()
        if isinstance(item, str):
            if _INTERPOLATION.search(item):
                return key or "the whole file", item
        elif isinstance(item, (dict, list)) and id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, dict):
                children = [(f"{key}.{k}" if key else str(k), v) for k, v in item.items()]
            else:
                children = [(f"{key}[{i}]", v) for i, v in enumerate(item)]
            stack.extend(reversed(children))
    return None


def check_nesting(value: Any, path: Path) -> None:
    """`RunFileError` when a loaded value nests deeper than `MAX_DEPTH` or holds more than
    `MAX_VALUES` values, YAML aliases followed each time they are used (a recursive alias, or
    aliases of aliases that multiply, would stop a reader that walks them)."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    count = 0
    while stack:
        item, depth, key = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise RunFileError(path, f"more than {MAX_VALUES:,} values (an alias counted each "
                                     "time it is used)")
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            shown = key if len(key) <= 60 else f"{key[:57]}..."
            raise RunFileError(path, f"nested deeper than {MAX_DEPTH} levels through its "
                                     f"aliases (at {shown})")
        if isinstance(item, dict):
            children = [(v, f"{key}.{k}" if key else str(k)) for k, v in item.items()]
        else:
            children = [(v, f"{key}[{i}]") for i, v in enumerate(item)]
        stack.extend((child, depth + 1, name) for child, name in children)


def parse_yaml(text: str, path: Path, *, shown_only: bool = False) -> Any:
    """YAML text as plain values: nothing constructed but plain values, nothing resolved.
    `RunFileError` beyond the bounds, for a tag, and for an interpolation unless `shown_only`
    (a caller that only shows the values gets it as the text it is); `NotYaml` (a
    `RunFileError` too) for text that is no YAML or holds a value a constructor refuses, such
    as an integer past Python's digit limit."""
    try:
        _scan_yaml(text, path)
        loaded = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "no YAML"
        raise NotYaml(path, f"no YAML ({problem})",
                      mark.line + 1 if mark is not None else None) from None
    except (yaml.YAMLError, ValueError) as exc:
        if isinstance(exc, RunFileError):
            raise
        raise NotYaml(path, f"no YAML ({_shown(str(exc).splitlines()[0], 200)})") from None
    check_nesting(loaded, path)
    found = None if shown_only else interpolation(loaded)
    if found is not None:
        key, written = found
        raise RunFileError(path, f"{_shown(key)} holds an interpolation ({_shown(written)!r}); "
                                 "gridrun writes run files resolved, so this one is not as "
                                 "gridrun wrote it")
    return loaded


def load_yaml(path: Path, *, shown_only: bool = False) -> Any:
    """A YAML file (config.yaml, .hydra/overrides.yaml) within the bounds; see `parse_yaml`."""
    return parse_yaml(read_text(path), path, shown_only=shown_only)


def read_csv(path: Path) -> list[dict[str | Any, str | Any]]:
    """A CSV file with a header (sweep_summary.csv) as one dict a row. A field may be as large
    as the file (an error message is not cut short), not only csv's default 128 kB."""
    text = read_text(path)
    previous = csv.field_size_limit()
    csv.field_size_limit(max(previous, len(text)))  # csv has no per-reader limit
    try:  # csv's default dialect, not strict, raises only for a field over the limit
        return list(csv.DictReader(io.StringIO(text, newline="")))
    finally:
        csv.field_size_limit(previous)
