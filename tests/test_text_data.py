"""`python -m runner.data tokenize` and `dataset=text`, with a word-level tokenizer built here by
the tokenizers library: the command's ids are those of tokenizing each document by hand, with
the end-of-text token after each; any number of workers writes the same bytes; every bad input
is one line and exit 2, naming the file (and line); dataset=text trains through the real
command line to exactly dataset=token_file's losses on the command's output, and a second run
reads its cache without tokenizing again."""

from __future__ import annotations

import gzip
import json
import random
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from runner.data.text import TextFiles
from runner.data.tokenize import TokenizeError, load_tokenizer
from tests.conftest import ROOT, assert_ok, run_cli_together, train_losses

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "and", "then", "slept",
         "under", "old", "red", "tree", "by", "river", "bank", "bird", "sang", "song", "all",
         "day", "long", "night", "came", "soon"]
EOS = "<|endoftext|>"
GPT = ["model=gpt", "model.width=16", "model.layers=1", "model.heads=2", "dataset.seq_len=8",
       "trainer.steps=4", "trainer.batch_size=8", "trainer.dtype=float64", "grid.pr=1",
       "grid.pc=2"]


def write_tokenizer(path: Path, specials: tuple[str, ...] = (EOS,),
                    extra_words: int = 0) -> Path:
    """A WordLevel tokenizer over WORDS (and `extra_words` made-up ones), `<unk>` id 0, the
    `specials` added as special tokens."""
    words = ["<unk>", *WORDS, *(f"w{i}" for i in range(extra_words)), *specials]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(path))
    return path


def documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    lines = [json.dumps({"id": i, field: t}) for i, t in enumerate(texts)]
    data = "\n".join(lines) + "\n"
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as file:
            file.write(data)
    else:
        path.write_text(data)
    return path


def by_hand(tokenizer: Path, texts: list[str], eos: bool = True) -> list[int]:
    """Each document's ids from the tokenizers library (a special token's text as plain
    text), the end-of-text id after each."""
    tok = Tokenizer.from_file(str(tokenizer))
    tok.encode_special_tokens = True
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for text in texts:
        ids += tok.encode(text, add_special_tokens=False).ids + ([eos_id] if eos else [])
    return ids


def tokenize_all(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """`python -m runner.data tokenize ARGS` for each of `commands`, all at once."""
    started = [subprocess.Popen([sys.executable, "-m", "runner.data", "tokenize", *args],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for args in commands]
    results = []
    for process, args in zip(started, commands, strict=True):
        out, err = process.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tokenizer and one input of each kind; `texts.json` lists every document in order."""
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = write_tokenizer(root / "tokenizer.json")
    first = documents(7, seed=1)
    first[2] = f"the cat {EOS} sat"  # a special token's text in a document: plain text
    jsonl = write_jsonl(root / "a.jsonl", first)
    jsonl.write_text(jsonl.read_text().replace("\n", "\n\n", 1))  # a blank line is skipped
    second = documents(5, seed=2)
    gz = write_jsonl(root / "b.jsonl.gz", second)
    third = documents(9, seed=3)
    parquet = root / "c.parquet"
    pq.write_table(pa.table({"id": list(range(9)), "text": third}), parquet, row_group_size=4)
    txt = root / "d.txt"
    txt.write_text("the dog ran\nfar and then\n\nslept\n")  # ONE document
    texts = [*first, *second, *third, txt.read_text()]
    (root / "texts.json").write_text(json.dumps(texts))
    return {"tokenizer": tokenizer, "jsonl": jsonl, "gz": gz, "parquet": parquet, "txt": txt,
            "texts": root / "texts.json", "root": root}


# -- the command ---------------------------------------------------------------------------------


def test_the_command_writes_each_documents_ids_as_tokenized_by_hand_then_eos(
        corpus: dict[str, Path], tmp_path: Path) -> None:
    out, plain = tmp_path / "out.bin", tmp_path / "plain.bin"
    inputs = [str(corpus[k]) for k in ("jsonl", "gz", "parquet", "txt")]
    tok = ["--tokenizer", str(corpus["tokenizer"])]
    done, no_eos = tokenize_all([*inputs, *tok, "--out", str(out)],
                                [*inputs, *tok, "--out", str(plain), "--no-eos",
                                 "--dtype", "uint32"])
    assert_ok(done)
    assert_ok(no_eos)
    texts = json.loads(corpus["texts"].read_text())
    expected = by_hand(corpus["tokenizer"], texts)
    vocab = len(WORDS) + 2
    eos_id = vocab - 1
    assert out.stat().st_size == 2 * len(expected)  # --dtype auto: uint16 for 32 ids
    assert np.fromfile(out, dtype="<u2").tolist() == expected
    # one end-of-text token per document, each document's last token (the text "<|endoftext|>"
    # in document 3 is three unknown words)
    assert expected.count(0) == 3
    ends = np.cumsum([len(by_hand(corpus["tokenizer"], [t])) for t in texts]) - 1
    assert [i for i, t in enumerate(expected) if t == eos_id] == ends.tolist()
    assert np.fromfile(plain, dtype="<u4").tolist() == by_hand(corpus["tokenizer"], texts,
                                                               eos=False)
    summary, overrides = done.stdout.strip().splitlines()
    assert summary.startswith(f"tokenized {len(texts)} documents: {len(expected)} tokens, "
                              f"{2 * len(expected)} bytes, uint16, vocabulary {vocab}, ")
    assert summary.endswith(f" tokens/s -> {out}")
    assert overrides == (f"train on it: dataset=token_file dataset.path={out.resolve()} "
                         f"dataset.dtype=uint16 dataset.vocab_size={vocab}")
    assert done.stderr == "" and not list(tmp_path.glob("*.partial"))


def test_one_worker_and_three_write_the_same_bytes(corpus: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """5,000 documents: 5 chunks of 1,000, in flight on 3 processes at once."""
    texts = documents(5000, seed=4)
    big = write_jsonl(tmp_path / "big.jsonl", texts)
    common = [str(big), str(corpus["txt"]), "--tokenizer", str(corpus["tokenizer"])]
    one, three = tokenize_all([*common, "--out", str(tmp_path / "1.bin"), "--workers", "1"],
                              [*common, "--out", str(tmp_path / "3.bin"), "--workers", "3"])
    assert_ok(one)
    assert_ok(three)
    written = (tmp_path / "1.bin").read_bytes()
    assert written == (tmp_path / "3.bin").read_bytes()
    expected = by_hand(corpus["tokenizer"], [*texts, corpus["txt"].read_text()])
    assert np.frombuffer(written, dtype="<u2").tolist() == expected


def test_dtype_auto_is_uint32_past_65536_ids_and_uint16_is_then_refused(tmp_path: Path) -> None:
    big = write_tokenizer(tmp_path / "big.json", extra_words=2 ** 16)
    assert load_tokenizer(big).dtype == "uint32"
    with pytest.raises(TokenizeError, match="do not fit uint16"):
        load_tokenizer(big, dtype="uint16")
    small = load_tokenizer(write_tokenizer(tmp_path / "small.json"))
    assert (small.dtype, small.vocab_size, small.eos_name) == ("uint16", len(WORDS) + 2, EOS)


def bad_inputs(root: Path, tokenizer: Path) -> dict[str, tuple[list[str], str]]:
    """Each bad case: (its arguments, what its one line says)."""
    def jsonl(name: str, *lines: str) -> str:
        (root / name).write_text("".join(line + "\n" for line in lines))
        return str(root / name)

    good = jsonl("good.jsonl", '{"text": "the cat"}')
    not_json = jsonl("not_json.jsonl", '{"text": "the cat"', '{"text": "sat"}')
    no_field = jsonl("no_field.jsonl", '{"body": "the cat", "id": 1}')
    number = jsonl("number.jsonl", '{"text": 7}')
    empty = jsonl("empty.jsonl", "", "  ")
    array = jsonl("array.jsonl", '["the cat"]')
    pq.write_table(pa.table({"text": [None, "the cat"]}), root / "null.parquet")
    pq.write_table(pa.table({"body": ["the cat"], "id": [1]}), root / "cols.parquet")
    (root / "broken.json").write_text('{"model": ')
    write_tokenizer(root / "no_eos.json", specials=())
    (root / "exists.bin").write_bytes(b"old")
    tok = ["--tokenizer", str(tokenizer)]
    out = ["--out", str(root / "out.bin")]
    return {
        "missing": ([str(root / "nope.jsonl"), *tok, *out], f"{root / 'nope.jsonl'}: no such "
                                                              f"file"),
        "empty": ([empty, *tok, *out], f"{empty}: empty"),
        "not_json": ([good, not_json, *tok, *out], f"{not_json}:1: not JSON"),
        "no_field": ([no_field, *tok, *out],
                     f'{no_field}:1: no "text" field (the line has: body, id)'),
        "not_a_string": ([number, *tok, *out], f'{number}:1: "text" is a JSON number, not a '
                                                 f'string'),
        "not_an_object": ([array, *tok, *out], f"{array}:1: a JSON array, not an object"),
        "parquet_null": ([str(root / "null.parquet"), *tok, *out],
                         f'{root / "null.parquet"}: row 1: "text" is null, not a string'),
        "parquet_column": ([str(root / "cols.parquet"), *tok, *out],
                           f'{root / "cols.parquet"}: no column "text" (its columns: body, id)'),
        "tokenizer": ([good, "--tokenizer", str(root / "broken.json"), *out],
                      f"{root / 'broken.json'}: not a tokenizers file"),
        "no_eos_token": ([good, "--tokenizer", str(root / "no_eos.json"), *out],
                         "no end-of-text token"),
        "out_exists": ([good, *tok, "--out", str(root / "exists.bin")],
                       f"--out {root / 'exists.bin'} exists: pass --force"),
        "unknown_kind": ([str(root / "exists.bin"), *tok, *out], "not a known kind of file"),
    }


@pytest.fixture(scope="module")
def refusals(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, tuple[subprocess.CompletedProcess[str], str, Path]]:
    """Every bad case of `bad_inputs` run at once, each in a folder of its own."""
    root = tmp_path_factory.mktemp("bad")
    cases = bad_inputs(root, corpus["tokenizer"])
    results = tokenize_all(*(args for args, _ in cases.values()))
    return {name: (result, said, root) for (name, (_, said)), result
            in zip(cases.items(), results, strict=True)}


@pytest.mark.parametrize("case", ["missing", "empty", "not_json", "no_field", "not_a_string",
                                  "not_an_object", "parquet_null", "parquet_column", "tokenizer",
                                  "no_eos_token", "out_exists", "unknown_kind"])
def test_a_bad_input_is_one_line_and_exit_2_before_anything_is_written(
        refusals: dict[str, tuple[subprocess.CompletedProcess[str], str, Path]],
        case: str) -> None:
    result, said, root = refusals[case]
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], lines
    assert result.stdout == ""
    assert not (root / "out.bin").exists() and not (root / "out.bin.partial").exists()
    assert (root / "exists.bin").read_bytes() == b"old"


def test_a_bad_line_met_later_names_it_and_leaves_no_file(corpus: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """Line 1,500 lacks the field: the up-front look passes, chunk 2 fails."""
    late = write_jsonl(tmp_path / "late.jsonl", documents(2000, seed=5))
    lines = late.read_text().splitlines()
    lines[1499] = '{"id": 1499, "body": "the cat"}'
    late.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.bin"
    (result,) = tokenize_all([str(late), "--tokenizer", str(corpus["tokenizer"]),
                              "--out", str(out), "--workers", "2"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f'error: {late}:1500: no "text" field (the line has: '
                                          f'id, body)']
    assert sorted(p.name for p in tmp_path.iterdir()) == ["late.jsonl"]


# -- dataset=text ----------------------------------------------------------------------------------


def test_options_are_checked_together() -> None:
    with pytest.raises(ValueError) as raised:
        TextFiles(seq_len=0)
    message = str(raised.value)
    assert "dataset.path is required" in message and "dataset.tokenizer is required" in message
    assert "dataset.seq_len must be >= 1" in message


def test_the_cache_is_named_by_the_inputs_and_tokenizer_and_reused(
        corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRIDRUN_CACHE", str(tmp_path / "gridrun"))
    source = write_jsonl(tmp_path / "s.jsonl", documents(40, seed=6))
    options = {"path": str(source), "tokenizer": str(corpus["tokenizer"]), "seq_len": 8}
    spec = TextFiles(**options).spec()
    cache = tmp_path / "gridrun" / "tokens"
    (first,) = cache.iterdir()
    assert np.fromfile(first, dtype="<u2").tolist() == by_hand(
        corpus["tokenizer"], [json.loads(line)["text"] for line in source.open()])
    assert spec.vocab_size == len(WORDS) + 2 and spec.input_shape == (8,)
    stamp = first.stat().st_mtime_ns
    TextFiles(**options).spec()
    assert list(cache.iterdir()) == [first] and first.stat().st_mtime_ns == stamp
    TextFiles(**options, eos=False).spec()  # another tokenization: another name
    with source.open("a") as file:
        file.write(json.dumps({"text": "the cat"}) + "\n")
    TextFiles(**options).spec()  # the input changed: another name
    assert len(list(cache.iterdir())) == 3 and not list(cache.glob("*.partial"))


def test_text_trains_to_token_files_losses_on_the_commands_output_and_reuses_its_cache(
        corpus: dict[str, Path], tmp_path: Path) -> None:
    """dataset=text and the command's file under dataset=token_file: the same losses; the
    second dataset=text run finds its cache. A bad line met while tokenizing refuses the run
    with one line naming the file and line."""
    source = write_jsonl(tmp_path / "train.jsonl", documents(120, seed=7))
    bad = write_jsonl(tmp_path / "bad.jsonl", documents(10, seed=8))
    bad.write_text(bad.read_text() + '{"id": 10, "body": "the"}\n')
    (tokenized,) = tokenize_all([str(source), "--tokenizer", str(corpus["tokenizer"]),
                                 "--out", str(tmp_path / "train.bin")])
    assert_ok(tokenized)
    token_file = shlex.split(tokenized.stdout.splitlines()[-1].removeprefix("train on it: "))
    cache = tmp_path / "cache"
    text = ["dataset=text", f"dataset.tokenizer={corpus['tokenizer']}",
            f"dataset.cache_dir={cache}"]
    first, refused = run_cli_together(
        [*GPT, *text, f"dataset.path={source}", f"hydra.run.dir={tmp_path / 'text'}"],
        [*GPT, *text, f"dataset.path={bad}", f"hydra.run.dir={tmp_path / 'bad'}"])
    assert_ok(first)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f'error: dataset=text: dataset.path: {bad}:11: no "text" field (the line has: id, '
        f'body)']
    (cached,) = cache.iterdir()  # the bad file left nothing
    assert cached.read_bytes() == (tmp_path / "train.bin").read_bytes()
    stamp = cached.stat().st_mtime_ns
    again, by_file = run_cli_together(
        [*GPT, *text, f"dataset.path={source}", f"hydra.run.dir={tmp_path / 'again'}"],
        [*GPT, *token_file, f"hydra.run.dir={tmp_path / 'file'}"])
    assert_ok(again)
    assert_ok(by_file)
    losses = train_losses(tmp_path / "text")
    assert len(losses) == 4
    assert train_losses(tmp_path / "file") == losses
    assert train_losses(tmp_path / "again") == losses
    assert list(cache.iterdir()) == [cached] and cached.stat().st_mtime_ns == stamp
