"""`python -m runner.export RUN_DIR [--step N] --to OUT`: a run's trained model handed back as
safetensors, for `from_pretrained`, an inference server or a colleague's notebook.

RUN_DIR is a run directory (its newest complete checkpoint, or that of `--step N`) or a
checkpoint directory itself. A transformers model becomes a directory `from_pretrained` loads
(`config.json` and `model.safetensors`, or numbered files with `model.safetensors.index.json`
above `--max-shard-size`); a model of another kind one `.safetensors` file (`--to
model.safetensors`) or `OUT/model.safetensors`. `--dtype` casts the floating-point tensors
(default: as the checkpoint holds them). An existing model at OUT is replaced only with
`--force`; anything else there is never touched. No MPI, no ranks: tensor by tensor, the memory
of about the largest one (`runner.weights.export`). Exit 0 when written and verified, 2 for bad
input (one line).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2
DTYPES = ("float32", "bfloat16", "float16", "float64")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30}


def size_bytes(text: str) -> int:
    """`5GB`, `500MiB`, `1000000` as bytes (argparse's type)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: not a size (5GB, 500MB, 2GiB, bytes)")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least one byte")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.export",
        description="Write a run's trained model as safetensors (a transformers directory, "
                    "or one file for a model of another kind), verified against the "
                    "checkpoint's hashes.")
    parser.add_argument("run_dir", type=Path, help="a run directory, or a checkpoint directory")
    parser.add_argument("--to", dest="out", type=Path, required=True,
                        help="where the model goes (a new directory, or FILE.safetensors)")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint of this step (default: the newest)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="the floating-point tensors' type (default: the checkpoint's)")
    parser.add_argument("--force", action="store_true",
                        help="replace a model already at --to")
    parser.add_argument("--max-shard-size", type=size_bytes, default="5GB",
                        help="the largest file of a transformers directory (default: 5GB)")
    args = parser.parse_args(argv)
    import torch

    from runner.records.console import print_error
    from runner.weights.export import ExportError, ExportRequest, export_checkpoint, find_checkpoint
    from runner.weights.safetensors_file import WeightsFileError

    try:
        checkpoint = find_checkpoint(args.run_dir, args.step)
        exported = export_checkpoint(ExportRequest(
            checkpoint, args.out, None if args.dtype is None else getattr(torch, args.dtype),
            args.force, args.max_shard_size))
    except (ExportError, WeightsFileError, OSError) as exc:
        print_error(str(exc) if not isinstance(exc, OSError) else f"{args.out}: {exc.strerror}")
        return EXIT_BAD_INPUT
    print(f"exported {exported.checkpoint} to {exported.path}: {exported.tensors} tensors, "
          f"{exported.total_bytes / (1 << 20):,.1f} MiB in {len(exported.files)} file(s), "
          f"verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
