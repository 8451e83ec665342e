"""`python -m runner.data tokenize`: documents on disk to a file of token ids that
`dataset=token_file` trains on (`runner.data.tokenize` does the work)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from runner.data.tokenize import (
    EOS_NAMES,
    Encoder,
    TokenizeError,
    default_workers,
    load_tokenizer,
    open_inputs,
)

EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

TOKENIZE_HELP = f"""\
Tokenize documents with a local tokenizer.json into a flat file of token ids (little-endian
uint16 or uint32, no header: dataset=token_file's layout), in the order the inputs give them.

Inputs, by name:
  .jsonl .ndjson .json   JSON lines (optionally .gz): an object per line, the document's text
                         in --field; blank lines are skipped
  .parquet               a document per row: the string column --field, read in batches
  .txt                   the whole file is ONE document (read whole: split a large text into
                         files, or use JSON lines)

Each document is encoded as it stands (no BOS/CLS of the tokenizer's template, no truncation,
a special token's text in a document encoded as plain text) and followed by the end-of-text
token: the first of {", ".join(EOS_NAMES)} the tokenizer has (--no-eos: none).
Every file, its first document and the tokenizer are checked before anything is written; the
output is written to OUT.partial and renamed to OUT at the end. The last lines printed are a
summary and the overrides that train on OUT.

example:
  python -m runner.data tokenize docs/*.jsonl --tokenizer tokenizer.json --out train.bin
"""


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m runner.data",
                                  description="gridrun's data tools.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tokenize = commands.add_parser(
        "tokenize", help="documents (JSONL, Parquet, text) to a file of token ids",
        description=TOKENIZE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    tokenize.add_argument("inputs", nargs="+", metavar="INPUT",
                          help="JSON-lines, Parquet or .txt files, tokenized in this order")
    tokenize.add_argument("--tokenizer", required=True, metavar="TOKENIZER_JSON",
                          help="a local tokenizer.json (the tokenizers library's format)")
    tokenize.add_argument("--out", required=True, metavar="OUT",
                          help="the token file to write (e.g. train.bin)")
    tokenize.add_argument("--field", default="text",
                          help="the JSON field or Parquet column holding the text "
                               "(default: text)")
    tokenize.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                          help="the ids' type; auto: uint16 when the vocabulary fits 65,536 "
                               "ids, else uint32 (default: auto)")
    tokenize.add_argument("--workers", type=_positive, default=None, metavar="N",
                          help="processes that encode (default: the CPU count, at most 8; 1 "
                               "for inputs under 8 MB); 1 encodes in this process; the output "
                               "is the same bytes whatever N")
    tokenize.add_argument("--no-eos", action="store_true",
                          help="join documents without an end-of-text token")
    tokenize.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return top


def _checked_output(out: Path, inputs: Sequence[Path], force: bool) -> None:
    if out.is_dir():
        raise TokenizeError(f"--out {out}: a directory, not a file")
    if out.exists() and not force:
        raise TokenizeError(f"--out {out} exists: pass --force to replace it")
    if not out.parent.is_dir():
        raise TokenizeError(f"--out {out}: no such directory {out.parent}")
    resolved = out.resolve()
    if any(path.resolve() == resolved for path in inputs):
        raise TokenizeError(f"--out {out} is one of the inputs")


def tokenize(args: argparse.Namespace) -> None:
    inputs = open_inputs(args.inputs, args.field)
    prepared = load_tokenizer(args.tokenizer, eos=not args.no_eos, dtype=args.dtype)
    out = Path(args.out).expanduser()
    _checked_output(out, [source.path for source in inputs], args.force)
    workers = args.workers if args.workers is not None else default_workers(inputs)
    with Encoder(prepared, workers) as encoder:
        tally = encoder.write(inputs, out)
    rate = tally.tokens / tally.seconds if tally.seconds > 0 else 0.0
    print(f"tokenized {tally.documents:,} documents: {tally.tokens:,} tokens, "
          f"{tally.bytes:,} bytes, {prepared.dtype}, vocabulary {prepared.vocab_size:,}, "
          f"{tally.seconds:.2f} s, {rate:,.0f} tokens/s -> {out}")
    overrides = ["dataset=token_file", f"dataset.path={out.resolve()}",
                 f"dataset.dtype={prepared.dtype}", f"dataset.vocab_size={prepared.vocab_size}"]
    print("train on it: " + " ".join(shlex.quote(o) for o in overrides))


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        tokenize(args)
    except TokenizeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # the output cannot be written (a full disk, permissions)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"error: interrupted; {args.out} not written", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
