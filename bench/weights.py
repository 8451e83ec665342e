"""Pretrained weights in and out at scale: a transformers Llama of more than 1 GB of float32
weights, written by `save_pretrained` (several files and an index), loaded under
`strategy=fsdp` 1 x 4 and exported back.

    python bench/weights.py [--dir DIR] [--hidden 2048] [--layers 4] [--vocab 32000] [--rounds 3]

Loading, on each of 4 ranks (one MPI job, one thread per rank): the rank builds the model and
splits it as a run does, then alternates, `--rounds` times, gridrun's load (`model.weights`:
each tensor's block of rows read alone, `runner.weights.load`) with the same blocks read by the
safetensors library directly (`safe_open(...).get_slice(name)[rows]`, copied into the same
parameters), what a user would otherwise write. Every rank reports the best of each, the bytes
it owns (its share), and the peak memory its load added (`VmHWM` reset before, read after:
all the memory the process touched, mapped files included). Targets: load time <= 1.5x the
direct read's, extra peak <= 1.2 x share + the largest tensor.

Export: rank 0 writes a checkpoint of the loaded model (every rank its shard), then a fresh
process exports it (`python -m runner.export`'s function) with its peak reset just before:
target <= 2 x the largest tensor. The exported files are compared with the originals, tensor by
tensor. Prints JSON. The machine's files stay in the page cache between rounds: both sides read
from memory, which is what a second start reads from too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from timing import run_worker

RANKS = 4


def _status(key: str) -> int:
    """A /proc/self/status value, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak() -> int:
    """Reset this process's peak resident memory to what it holds now; returns that."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def peak_since(base: int) -> int:
    return _status("VmHWM") - base


def make_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    """A Llama of random weights, written by save_pretrained in files of at most 400 MB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="400MB")


def run_config(weights: Path, vocab: int) -> dict[str, Any]:
    return {"seed": 0, "grid": {"pr": 1, "pc": RANKS},
            "trainer": {"steps": 1, "batch_size": 8, "threads": 1},
            "model": {"name": "pretrained", "weights": str(weights)},
            "dataset": {"name": "tokens", "vocab_size": vocab, "seq_len": 16, "classes": 4,
                        "samples": 64, "val_fraction": 0.25, "seed": 0},
            "strategy": {"name": "fsdp"}, "optimizer": {"name": "sgd", "lr": 0.01},
            "launcher": {"command": None, "args": []}}


def direct_read(files: dict[str, Any], source: Any, binding: Any, model: Any) -> None:
    """The rank's blocks read with the safetensors library, copied into its parameters."""
    import torch

    from runner.core.placement import placement_of

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            place = placement_of(tensor)
            if place is None or place.name not in binding.names:
                continue
            name = binding.names[place.name]
            part = files[str(source.tensors[name].file)].get_slice(name)
            block = part[place.start:place.stop] if len(place.shape) else part[:]
            if place.splits_columns:
                low, high = place.col_range
                block = block[:, low:high]
            tensor.copy_(block.reshape(tensor.shape))


def _rank_model(weights: Path, vocab: int, grid: Any) -> tuple[Any, Any, Any, Any, Any]:
    """The run's parts as a rank builds them, split by fsdp; the weights bound to them."""
    import torch
    from omegaconf import OmegaConf

    from runner.cli.validation import validate
    from runner.core.placement import place_whole
    from runner.training.assembly import assemble
    from runner.weights.load import open_bound

    run = validate(OmegaConf.create(run_config(weights, vocab)), world_size=RANKS)
    torch.manual_seed(run.seed)
    parts = assemble(run)
    place_whole(parts.model)
    source, binding = open_bound(weights, parts.model)
    model = parts.strategy.parallelize(parts.model, parts.spec.input_shape, grid)
    return run, parts, source, binding, model


def _timed_loads(source: Any, binding: Any, model: Any, comm: Any, rounds: int
                 ) -> dict[str, Any]:
    from safetensors import safe_open

    from runner.weights.load import load_weights

    files = {str(f): safe_open(str(f), framework="pt") for f in source.files}
    ours, direct, peaks = [], [], []
    for _ in range(rounds):
        comm.Barrier()
        base = reset_peak()
        started = time.perf_counter()
        read = load_weights(source, binding, model)
        ours.append(time.perf_counter() - started)
        peaks.append(peak_since(base))
        comm.Barrier()
        started = time.perf_counter()
        direct_read(files, source, binding, model)
        direct.append(time.perf_counter() - started)
    share = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"load_s": min(ours), "direct_s": min(direct), "extra_peak_bytes": min(peaks),
            "share_bytes": share, "read_bytes": read}


def worker(weights: Path, checkpoints: Path, vocab: int, rounds: int) -> None:
    from mpi4py import MPI

    from runner.checkpoint.write import TrainingProgress, save_checkpoint
    from runner.core import ProcessGrid
    from runner.training.sampling import EpochSampler
    from runner.weights.model_card import (
        MODEL_CONFIG,
        STATE_NAMES,
        kept_tensors,
        transformers_config,
    )

    comm = MPI.COMM_WORLD
    grid = ProcessGrid(1, RANKS, comm)
    run, parts, source, binding, model = _rank_model(weights, vocab, grid)
    mine = _timed_loads(source, binding, model, comm, rounds)
    largest = max(_nbytes(t) for t in source.tensors.values())
    run_info = {STATE_NAMES: list(kept_tensors(parts.model).tensors),
                MODEL_CONFIG: transformers_config(parts.model)}
    optimizer = parts.optimizer_cls(model, grid=grid, total_steps=1, **run.optimizer.options)
    sampler = EpochSampler(parts.spec.train_size, run.trainer.batch_size, run.seed)
    written = save_checkpoint(checkpoints, TrainingProgress(0, 0.0, sampler.state()), model,
                              optimizer, grid, run_info, None)
    ranks = comm.gather(mine)
    if comm.Get_rank() == 0:
        print(json.dumps({"ranks": ranks, "largest_tensor_bytes": largest,
                          "checkpoint": str(written)}))


def _nbytes(stored: Any) -> int:
    count = 1
    for size in stored.shape:
        count *= size
    return count * stored.dtype.itemsize


def export_peak(checkpoint: str, out: str) -> None:
    """In a fresh process: export with the peak reset just before; prints JSON."""
    from runner.weights.export import ExportRequest, export_checkpoint

    base = reset_peak()
    started = time.perf_counter()
    exported = export_checkpoint(ExportRequest(Path(checkpoint), Path(out), force=True,
                                               max_shard_bytes=400 * 10**6))
    print(json.dumps({"export_s": time.perf_counter() - started,
                      "export_extra_peak_bytes": peak_since(base),
                      "exported_bytes": exported.total_bytes, "files": len(exported.files)}))


def same_tensors(original: Path, exported: Path) -> bool:
    """Every tensor of the export is the original's, bit for bit (file by file, one tensor at
    a time)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if not index.exists():
            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                return {name: folder / "model.safetensors" for name in f.keys()}  # noqa: SIM118
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}

    want, got = tensors(original), tensors(exported)
    if want.keys() != got.keys():
        return False
    for name in want:
        with safe_open(str(want[name]), "pt") as a, safe_open(str(got[name]), "pt") as b:
            if not torch.equal(a.get_tensor(name), b.get_tensor(name)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/gridrun-bench-weights"))
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--export", nargs=2, metavar=("CHECKPOINT", "OUT"))
    args = parser.parse_args()
    weights = args.dir / f"llama-{args.hidden}x{args.layers}-{args.vocab}"
    if args.worker:
        worker(weights, args.dir / "checkpoints", args.vocab, args.rounds)
        return
    if args.export:
        export_peak(*args.export)
        return
    if not (weights / "config.json").exists():
        make_model(weights, args.hidden, args.layers, args.vocab)
    common = ["--dir", str(args.dir), "--hidden", str(args.hidden), "--layers",
              str(args.layers), "--vocab", str(args.vocab), "--rounds", str(args.rounds)]
    loaded = run_worker(__file__, RANKS, *common)
    out = args.dir / "exported"
    exported = json.loads(subprocess.run(
        [sys.executable, __file__, *common, "--export", loaded["checkpoint"], str(out)],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    print(json.dumps(summary(weights, loaded, exported, same_tensors(weights, out)), indent=2))


def summary(weights: Path, loaded: dict[str, Any], exported: dict[str, Any],
            identical: bool) -> dict[str, Any]:
    largest = loaded["largest_tensor_bytes"]
    model_bytes = sum(f.stat().st_size for f in weights.glob("*.safetensors"))
    ranks = loaded["ranks"]
    return {
        "model_bytes": model_bytes, "largest_tensor_bytes": largest, "ranks": ranks,
        "load_over_direct_read": [r["load_s"] / r["direct_s"] for r in ranks],
        "extra_peak_over_share_plus_largest": [
            r["extra_peak_bytes"] / (1.2 * r["share_bytes"] + largest) for r in ranks],
        **exported,
        "export_peak_over_largest": exported["export_extra_peak_bytes"] / largest,
        "export_identical": identical,
        "targets": {"load_over_direct_read": "<= 1.5",
                    "extra_peak_over_share_plus_largest": "<= 1.0",
                    "export_peak_over_largest": "<= 2.0"},
    }


if __name__ == "__main__":
    main()
