"""Real data at speed: training on files against training on tensors in memory, gridrun's reader
against torch's DataLoader, and a rank's memory against the size of its corpus.

    python bench/data.py [--dir DIR] [--gb 2.0] [--rounds 3] [--workers 2] [--skip-images]

1. Step time, the same model on a file and on tensors held in memory (what a user would
   otherwise pick), through the real command line, rounds alternating the two, each run's
   median step (`summary.json`), the median over rounds: a GPT on `dataset=token_file` against
   `dataset=tokens` of the same shapes; a ResNet on `dataset=image_folder` (192 x 192 JPEGs
   decoded, resized, randomly cropped and flipped on `--workers` reader threads; the step on one
   thread) against `dataset=synthetic` images of the same shape. Target: file <= 1.05 x memory.
2. Samples per second of reading alone, the same rows in the same order, `--workers` on both:
   gridrun's reader (`runner.data.readahead.ReadAhead` over the dataset's `RowSource`, the
   read-ahead a rank runs) against `torch.utils.data.DataLoader(num_workers=W)` over a
   map-style dataset reading the same files (a `numpy.memmap` of the token file; PIL with the
   same transforms for the images), as its documentation writes one. Target: >= 1.0 x.
3. Memory: a token file of `--gb` GB; a fresh process reads 2,000 batches of 16 random
   windows spread over the whole file, through gridrun's token reader and through a
   `numpy.memmap`, each in its own process, its peak resident memory (VmHWM) over its start
   reported, and the bytes of the rows it read. Target: gridrun's peak bounded by the rows in
   flight, not the file.

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, SEQ = 4096, 128
GPT = ["model=gpt", "model.width=128", "model.layers=2", "model.heads=4",
       "trainer.batch_size=32", "trainer.eval_every=null", "grid.pr=1", "grid.pc=1"]
IMAGE = 64  # the crop; the files are 192 x 192 JPEGs, resized to IMAGE + 8 first
# One thread for the step: on a 2-core machine the reader's decoding has the other core
# (with both, it takes its CPU from the step; README's numbers give both)
RESNET = ["model=resnet", "model.widths=[16,32]", "model.blocks=[1,1]", "model.stem=cifar",
          "trainer.batch_size=32", "trainer.eval_every=null", "grid.pr=1", "grid.pc=1",
          "trainer.threads=1"]


def run(args: list[str], run_dir: Path) -> dict[str, Any]:
    """`python -m runner ARGS` into `run_dir`; its summary."""
    subprocess.run([sys.executable, "-m", "runner", *args, f"hydra.run.dir={run_dir}"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def alternate(pairs: dict[str, list[str]], rounds: int, work: Path) -> dict[str, float]:
    """Each run's median step time, the runs alternating, round by round; the median over
    rounds of each."""
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for r in range(rounds):
        for name, args in pairs.items():
            summary = run(args, work / f"{name}-{r}")
            times[name].append(summary["median_step_time_s"])
    return {name: statistics.median(values) for name, values in times.items()}


def write_tokens(path: Path, tokens: int, seed: int = 0) -> None:
    """`tokens` ids below VOCAB, uniform, written in blocks (constant memory)."""
    import numpy as np

    generator = np.random.default_rng(seed)
    block = 1 << 24
    with path.open("wb") as out:
        left = tokens
        while left:
            take = min(block, left)
            ids = generator.integers(0, VOCAB, take, dtype=np.uint16)
            out.write(ids.tobytes())
            left -= take


def write_images(root: Path, classes: int, per_class: int, size: int) -> None:
    """JPEG images of class-dependent colour and noise, `size` x `size`, in ROOT/<class>/."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        base = generator.integers(0, 256, 3)
        for i in range(per_class):
            noise = generator.integers(-40, 40, (size, size, 3))
            pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:04d}.jpg", quality=90)


def step_times(work: Path, rounds: int, workers: int, images: bool) -> dict[str, Any]:
    tokens = work / "train.bin"
    write_tokens(tokens, 4_000_000)
    samples = (4_000_000 - 1) // SEQ
    common = [*GPT, "trainer.steps=40", f"data.workers={workers}"]
    medians = alternate({
        "token_file": [*common, "dataset=token_file", f"dataset.path={tokens}",
                       f"dataset.vocab_size={VOCAB}", f"dataset.seq_len={SEQ}"],
        "tokens_in_memory": [*common, "dataset=tokens", f"dataset.vocab_size={VOCAB}",
                             f"dataset.seq_len={SEQ}", f"dataset.samples={samples}",
                             "dataset.val_fraction=0.01"]}, rounds, work)
    result: dict[str, Any] = {"gpt": {
        "median_step_s": medians, "file_over_memory": medians["token_file"] /
        medians["tokens_in_memory"], "target": "<= 1.05"}}
    if images:
        folder = work / "images"
        write_images(folder, 10, 60, 192)
        common = [*RESNET, "trainer.steps=30", f"data.workers={workers}"]
        medians = alternate({
            "image_folder": [*common, "dataset=image_folder", f"dataset.root={folder}",
                             f"dataset.size={IMAGE}", f"dataset.resize={IMAGE + 8}"],
            "images_in_memory": [*common, "dataset=synthetic", f"dataset.shape=[3,{IMAGE},"
                                 f"{IMAGE}]", "dataset.classes=10", "dataset.samples=600"]},
            rounds, work)
        result["resnet"] = {"median_step_s": medians, "file_over_memory":
                            medians["image_folder"] / medians["images_in_memory"],
                            "target": "<= 1.05"}
    return result


class MemmapWindows:
    """A token file's windows as a map-style dataset over a `numpy.memmap`: what a user writes
    for a DataLoader (nanoGPT's reader)."""

    def __init__(self, path: Path, windows: int) -> None:
        self.path, self.windows = path, windows
        self._map: Any = None

    def __len__(self) -> int:
        return self.windows

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import numpy as np
        import torch

        if self._map is None:  # opened in the worker that reads
            self._map = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = torch.from_numpy(self._map[index * SEQ:index * SEQ + SEQ + 1].astype(np.int64))
        return window[:-1], window[1:]


def reading(work: Path, workers: int, batches: int, images: bool) -> dict[str, Any]:
    """Samples per second of reading alone: gridrun's reader against the DataLoader."""
    import torch
    from torch.utils.data import DataLoader

    from runner.data.readahead import ReadAhead
    from runner.data.token_file import TokenFile

    batch = 32
    result: dict[str, Any] = {}
    tokens = work / "train.bin"
    source = TokenFile(path=str(tokens), vocab_size=VOCAB, seq_len=SEQ).sources()[0]
    subjects: dict[str, tuple[Any, Any]] = {
        "tokens": (source, MemmapWindows(tokens, len(source)))}
    if images:
        from runner.data.image_folder import ImageFolder

        dataset = ImageFolder(root=str(work / "images"), size=IMAGE, resize=IMAGE + 8)
        image_source = dataset.sources()[0]
        subjects["images"] = (image_source, _PerItem(image_source))
    for name, (rows, per_item) in subjects.items():
        count = min(batches, len(rows) // batch)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
        plans = [order[i * batch:(i + 1) * batch] for i in range(count)]
        reader: ReadAhead[torch.Tensor, Any] = ReadAhead(
            lambda plan, rows=rows: rows.read(plan, 1), iter(plans), workers, depth=2 * workers)
        started = time.perf_counter()
        for _ in plans:
            reader.next()
        ours = time.perf_counter() - started
        reader.close()
        loader = DataLoader(per_item, batch_size=batch, sampler=order[:count * batch].tolist(),
                            num_workers=workers, prefetch_factor=2 if workers else None)
        started = time.perf_counter()
        for _ in loader:
            pass
        theirs = time.perf_counter() - started
        result[name] = {"gridrun_samples_per_s": count * batch / ours,
                        "dataloader_samples_per_s": count * batch / theirs,
                        "ratio": theirs / ours, "target": ">= 1.0", "batches": count}
    return result


class _PerItem:
    """A row source read one item at a time: the same decoding and transforms, as a map-style
    dataset for the DataLoader."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        x, y = self.source.read(torch.tensor([index]), 1)
        return x[0], y[0]


def memory_child(path: str, how: str, batches: int) -> None:
    """In a fresh process: read `batches` of 16 random windows spread over the file; print the
    peak resident memory over the process's own at the start, and the bytes of rows read."""
    import numpy as np
    import torch

    from runner.data.token_file import TokenFile

    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    size = Path(path).stat().st_size
    windows = (size // 2 - 1) // SEQ
    generator = torch.Generator().manual_seed(1)
    Path("/proc/self/clear_refs").write_text("5")
    start = status("VmRSS")
    read = 0
    if how == "gridrun":
        source = TokenFile(path=path, vocab_size=VOCAB, seq_len=SEQ, val_fraction=0.001)
        rows = source.sources()[0]
        for _ in range(batches):
            rows.read(torch.randint(0, len(rows), (16,), generator=generator), 0)
            read += 16 * (SEQ + 1) * 2
    else:
        mapped = np.memmap(path, dtype=np.uint16, mode="r")
        for _ in range(batches):
            for i in torch.randint(0, windows, (16,), generator=generator).tolist():
                np.array(mapped[i * SEQ:i * SEQ + SEQ + 1], dtype=np.int64)  # as a reader copies
                read += (SEQ + 1) * 2
    print(json.dumps({"peak_over_start_bytes": status("VmHWM") - start, "row_bytes": read}))


def memory(work: Path, gb: float, batches: int) -> dict[str, Any]:
    path = work / "large.bin"
    started = time.perf_counter()
    write_tokens(path, int(gb * 1e9) // 2, seed=1)
    written = time.perf_counter() - started
    result: dict[str, Any] = {"file_bytes": path.stat().st_size, "write_s": written}
    for how in ("gridrun", "memmap"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(path), how,
                              str(batches)], check=True, capture_output=True, text=True)
        result[how] = json.loads(out.stdout.strip().splitlines()[-1])
    path.unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--skip-images", action="store_true")
    parser.add_argument("--memory-child", nargs=3, metavar=("PATH", "HOW", "BATCHES"))
    args = parser.parse_args()
    if args.memory_child:
        path, how, batches = args.memory_child
        memory_child(path, how, int(batches))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        work = Path(folder)
        images = not args.skip_images
        result = {"machine": f"{os.cpu_count()} cores",
                  "step_time": step_times(work, args.rounds, args.workers, images),
                  "reading": reading(work, args.workers, args.batches, images),
                  "memory": memory(work, args.gb, 2000)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
