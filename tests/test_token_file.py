"""`dataset=token_file`: token ids in flat binary files, read window by window, ahead of the
step; the same losses as the same tokens held as tensors, under every strategy; a run killed
mid-epoch resumes to exactly the uninterrupted losses, on its grid or another; bad files are one
line naming the file, from the head before any rank starts, or from the rank that meets them."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.data.readahead import ReadAhead
from runner.data.rows import DataFileError
from runner.data.token_file import TokenFile, TokenStream, TokenWindows
from runner.zoo.datasets import ZipfTokens
from runner.zoo.userdata import sampled_rows
from tests.conftest import (
    assert_ok,
    read_metrics,
    read_summary,
    run_cli,
    run_cli_together,
    train_losses,
)

VOCAB, SEQ = 64, 8
GPT = ["model=gpt", "model.width=16", "model.layers=1", "model.heads=2",
       "trainer.dtype=float64", "trainer.batch_size=16", "trainer.eval_every=null"]
# dataset=tokens' own documents of SEQ + 1 ids (its train and val split) as the held tensors
TENSORS = ["dataset=tokens", f"dataset.vocab_size={VOCAB}", f"dataset.seq_len={SEQ}",
           "dataset.samples=256"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """dataset=tokens' next-token documents written back to back: with stride SEQ + 1 the
    file's windows are those documents, in that order."""
    root = tmp_path_factory.mktemp("token_file")
    documents = ZipfTokens(vocab_size=VOCAB, seq_len=SEQ + 1, samples=256).load()
    paths = {"train": root / "train.bin", "val": root / "val.bin"}
    np.asarray(documents.train_x, dtype=np.uint16).tofile(paths["train"])
    np.asarray(documents.val_x, dtype=np.uint16).tofile(paths["val"])
    return paths


def by_step(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "split" not in m}


def token_file(paths: dict[str, Path]) -> list[str]:
    return ["dataset=token_file", f"dataset.path={paths['train']}",
            f"dataset.val_path={paths['val']}", f"dataset.vocab_size={VOCAB}",
            f"dataset.seq_len={SEQ}", f"dataset.stride={SEQ + 1}"]


def test_windows_span_files_and_read_the_same_on_any_thread(tmp_path: Path) -> None:
    stream = np.arange(1000, dtype=np.uint32) % 997
    parts = [tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"]
    for part, piece in zip(parts, np.split(stream, [333, 334]), strict=True):  # b: 1 token
        piece.tofile(part)
    windows = TokenWindows(TokenStream(parts, "uint32"), seq_len=7, stride=7, first=0,
                           count=(1000 - 8) // 7 + 1, vocab_size=997)
    indices = torch.tensor([47, 0, 141, 47])  # window 47 crosses both file boundaries
    x, y = windows.read(indices, epoch=3)
    expected = torch.stack([torch.from_numpy(stream[i * 7:i * 7 + 8].astype(np.int64))
                            for i in indices.tolist()])
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
    results: list[torch.Tensor] = []
    threads = [threading.Thread(target=lambda: results.append(windows.read(indices, 0)[0]))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(r, x) for r in results) and len(results) == 4


def test_the_read_ahead_keeps_the_order_and_raises_at_the_step_that_needs_the_rows() -> None:
    def read(plan: int) -> int:
        if plan == 5:
            raise DataFileError("plan 5")
        return plan * plan

    reader: ReadAhead[int, int] = ReadAhead(read, iter(range(100)), workers=3, depth=4)
    assert [reader.next() for _ in range(5)] == [(p, p * p) for p in range(5)]
    with pytest.raises(DataFileError, match="plan 5"):  # read long before, raised now
        reader.next()
    assert reader.next() == (6, 36)
    reader.close()


def test_the_held_out_tail_and_the_tokenizer_s_vocabulary(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    (np.arange(1001) % 50).astype(np.uint16).tofile(path)
    dataset = TokenFile(path=str(path), vocab_size=50, seq_len=10, val_fraction=0.1)
    spec = dataset.spec()
    assert (spec.train_size, spec.val_size) == (90, 10)  # 100 windows of 11 tokens, stride 10
    val = dataset.sources()[1]
    assert torch.equal(val.windows(torch.tensor([0]))[0],
                       torch.arange(900, 911) % 50)  # the tail's first window
    assert spec.target_shape == (10,) and spec.vocab_size == 50
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = {f"w{i}": i for i in range(70)}
    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel(words, unk_token="w0")).save(str(tokenizer))
    assert TokenFile(path=str(path), tokenizer=str(tokenizer)).vocab_size == 70
    with pytest.raises(ValueError, match=r"dataset\.tokenizer: .*no such tokenizer file"):
        TokenFile(path=str(path), tokenizer=str(tmp_path / "none.json"))


def test_a_token_file_trains_as_the_same_tokens_held_as_tensors_under_every_strategy(
        files: dict[str, Path], tmp_path: Path) -> None:
    """dataset=tokens on one process against its documents in files, under data 1 x 2,
    grid 2 x 2 and fsdp 1 x 2, read ahead by two threads and by none."""
    runs = {"tensors": [*TENSORS, "grid.pr=1", "grid.pc=1"],
            "data": [*token_file(files), "strategy=data", "grid.pr=1", "grid.pc=2",
                     "data.workers=2"],
            "grid": [*token_file(files), "strategy=grid", "grid.pr=2", "grid.pc=2"],
            "fsdp": [*token_file(files), "strategy=fsdp", "grid.pr=1", "grid.pc=2",
                     "data.workers=0"]}
    results = run_cli_together(*[[*GPT, "trainer.steps=6", *overrides,
                                  f"hydra.run.dir={tmp_path / name}"]
                                 for name, overrides in runs.items()])
    for result in results:
        assert_ok(result)
    expected = train_losses(tmp_path / "tensors")
    assert len(expected) == 6
    for name in ("data", "grid", "fsdp"):
        assert train_losses(tmp_path / name) == pytest.approx(expected, rel=1e-9), name


def test_a_run_killed_mid_epoch_resumes_exactly_on_its_grid_and_on_others(
        files: dict[str, Path], tmp_path: Path) -> None:
    """12 windows of 16 make an epoch of 12 steps; killed at step 8 of 16 after its step-5
    checkpoint, the run resumes from it on data 1 x 2 (its own), grid 2 x 2 and fsdp 1 x 2,
    each through the epoch's end to the uninterrupted losses."""
    common = [*GPT, *token_file(files), "trainer.steps=16"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    results = run_cli_together(
        [*common, "strategy=data", "grid.pr=1", "grid.pc=2", f"hydra.run.dir={reference}"],
        [*common, "strategy=data", "grid.pr=1", "grid.pc=2", "trainer.checkpoint_every=5",
         "debug.fail_at_step=8", "debug.fail_on_rank=1", "debug.fail_mode=kill",
         f"hydra.run.dir={killed}"])
    assert_ok(results[0])
    assert results[1].returncode not in (0, 2), results[1].stderr
    checkpoint = killed / "checkpoints" / "step-00000005"
    assert checkpoint.is_dir()
    targets = {"grid": ["strategy=grid", "grid.pr=2", "grid.pc=2"],
               "fsdp": ["strategy=fsdp", "grid.pr=1", "grid.pc=2"]}
    results = run_cli_together(
        [*common, "strategy=data", "grid.pr=1", "grid.pc=2", "trainer.resume=auto",
         f"hydra.run.dir={killed}"],
        *[[*common, *grid, f"trainer.resume={checkpoint}", f"hydra.run.dir={tmp_path / name}"]
          for name, grid in targets.items()])
    for result in results:
        assert_ok(result)
    expected = by_step(reference)
    assert sorted(expected) == list(range(1, 17))
    assert by_step(killed) == pytest.approx(expected, rel=1e-9)  # its metrics continue
    for name in targets:
        got = by_step(tmp_path / name)
        assert sorted(got) == list(range(6, 17))
        assert got == pytest.approx({s: expected[s] for s in got}, rel=1e-9), name
    assert read_summary(killed)["status"] == "completed"


@pytest.mark.parametrize("problem", ["odd_size", "empty", "missing", "outside_vocab",
                                     "too_short", "no_vocab"])
def test_a_bad_token_file_is_one_line_naming_it_before_any_rank_starts(
        tmp_path: Path, problem: str) -> None:
    path = tmp_path / "bad.bin"
    tokens = (np.arange(400) % VOCAB).astype(np.uint16)
    overrides = [f"dataset.vocab_size={VOCAB}"]
    expected = str(path)
    if problem == "odd_size":
        path.write_bytes(tokens.tobytes() + b"\0")
        expected = f"{path} has 801 bytes, not a whole number of 2-byte tokens"
    elif problem == "empty":
        path.write_bytes(b"")
        expected = f"{path} is empty"
    elif problem == "missing":
        expected = f"{path}: no such file"
    elif problem == "outside_vocab":
        tokens[3] = VOCAB + 5  # in window 0, which the head reads
        tokens.tofile(path)
        expected = (f"{path}: token {VOCAB + 5} at token offset 3 (byte 6) is outside the "
                    f"vocabulary [0, {VOCAB})")
    elif problem == "too_short":
        tokens[:5].tofile(path)
        expected = "5 tokens make 0 window(s) of 9 tokens"
    else:
        tokens.tofile(path)
        overrides = []
        expected = "dataset.vocab_size is required"
    result = run_cli(*GPT, "dataset=token_file", f"dataset.path={path}", f"dataset.seq_len={SEQ}",
                     *overrides, "grid.pr=1", "grid.pc=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("error: dataset=token_file: "), last
    assert expected in last[0], last[0]
    assert not (tmp_path / "run").exists() or not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_token_outside_the_vocabulary_met_by_a_rank_ends_the_job_naming_its_offset(
        files: dict[str, Path], tmp_path: Path) -> None:
    """Window 1 is not among those the head reads: rank 1 meets it in the first epoch."""
    windows = (files["train"].stat().st_size // 2) // (SEQ + 1)
    assert 1 not in sampled_rows(windows)
    tokens = np.fromfile(files["train"], dtype=np.uint16)
    tokens[(SEQ + 1) + 4] = 999
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    result = run_cli(*GPT, *token_file({**files, "train": path}), "strategy=data", "grid.pr=1",
                     "grid.pc=2", f"trainer.steps={windows // 16}",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode not in (0, 2), result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert f"{path}: token 999 at token offset {SEQ + 5} (byte {2 * (SEQ + 5)}) is outside " \
           f"the vocabulary [0, {VOCAB})" in last, result.stderr
    assert "Traceback" not in result.stderr
