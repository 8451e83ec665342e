"""gridrun on one GPU against a plain PyTorch loop, and four ranks sharing that GPU.

    python bench/gpu.py [--device cuda|cpu] [--precisions fp32 bf16] [--steps 300] [--warmup 30]
                        [--rounds 2] [--ranks 4] [--small] [--out FILE] [--keep DIR]

The workload: an MLP 1024→4096→4096→4096→10 (ReLU), global batch 512, SGD (lr
0.01, momentum 0.9) on seeded synthetic data (`dataset=synthetic`, 1024 features, 10 classes).
`--small` (or `--inputs/--hidden/--classes/--batch/--samples`) makes it tiny, so that
`--device cpu --small` checks the whole script in seconds on a machine without a GPU.

1. One device, per precision (fp32; bf16 under autocast): in alternating rounds (a drift of the
   machine hits both alike), each side a fresh process,
   a. `plain`: the loop a user writes for one GPU (`--plain-worker`, this file): the same layer
      sizes built under the same seed, the train tensors moved to the device once, per step: a
      batch indexed from a seeded per-epoch permutation (gridrun's sample order), zero_grad,
      forward and cross-entropy (under `torch.autocast(device, bfloat16)` in bf16, no autocast in
      fp32), backward, `torch.optim.SGD.step`, `loss.item()`. Each step is timed with
      `time.perf_counter` between two `torch.cuda.synchronize()` (on the CPU without them);
   b. `gridrun`: `python -m runner strategy=data grid.pr=1 grid.pc=1 trainer.device=D
      trainer.precision=P ...` on the same data, sizes, seed, optimizer and steps; its step times
      are `metrics.jsonl`'s `step_time_s` (gridrun times each whole step, batch included, with
      `time.perf_counter`; the loss it logs is read with `.item()` every step).
   The first `--warmup` steps of every process are run but not timed. samples/s = batch / median
   step time over all timed steps of all rounds; `ratio = gridrun / plain`, target >= 0.95. Both
   sides start from the same weights and see the same batches: the largest per-step loss gap is
   reported, to show they do the same work (equal to float rounding in fp32; bf16 rounds more).
2. `--ranks P` (default 4; 0 skips): gridrun `strategy=data` on 1 × P ranks sharing the one
   device, under `comm.backend=mpi` (`comm.cuda_aware=false` on cuda: GPU tensors staged through
   pinned host buffers) and under `comm.backend=torch` (ranks that share a GPU: gloo on host
   copies), per precision: samples/s, communication share of the step, bytes per step measured
   and predicted, and `ratio = torch / mpi`; and a 1-rank `comm.backend=torch` run (NCCL on one
   rank on cuda) with its loss gap to the 1-rank mpi run.
Prints one JSON document (also written to `--out`): the machine, the exact sizes, each command
line, and each measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95  # gridrun's samples/s on one GPU at least this share of the plain loop's
FULL = {"inputs": 1024, "hidden": [4096, 4096, 4096], "classes": 10, "batch": 512,
        "samples": 16384}
SMALL = {"inputs": 32, "hidden": [64, 64, 64], "classes": 10, "batch": 64, "samples": 2048}
LR, MOMENTUM, SEED = 0.01, 0.9, 0
# The runner's defaults for the keys the GPU work adds: with --device cpu in fp32 they may be
# left off the command line, for a runner that does not know them yet (see `Runner`).
DEVICE_DEFAULTS = {"trainer.device": "cpu", "trainer.precision": "fp32"}


# --- the plain loop (its own process, like each gridrun run) -------------------------------

def plain_worker(spec: dict[str, Any]) -> None:
    """What a user writes to train this MLP on one device; prints its step times and losses."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from runner.zoo.datasets import Synthetic

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    data = Synthetic(shape=(spec["inputs"],), classes=spec["classes"], samples=spec["samples"],
                     seed=spec["seed"]).load()  # gridrun's dataset=synthetic, same seed
    x, y = data.train_x.to(device), data.train_y.to(device)

    torch.manual_seed(spec["seed"])
    layers: list[nn.Module] = [nn.Flatten()]
    width = spec["inputs"]
    for h in spec["hidden"]:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, spec["classes"]))
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])

    def autocast() -> Any:
        if spec["precision"] == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    batch, n = spec["batch"], len(x)
    order_generator = torch.Generator().manual_seed(spec["seed"])
    order, position = torch.randperm(n, generator=order_generator).to(device), 0
    times, losses = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if position + batch > n:  # a new epoch: a new permutation, the last partial batch dropped
            order, position = torch.randperm(n, generator=order_generator).to(device), 0
        rows = order[position:position + batch]
        position += batch
        optimizer.zero_grad()
        with autocast():
            loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    machine = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if cuda:
        machine |= {"cuda_device": torch.cuda.get_device_name(device),
                    "cuda": torch.version.cuda,
                    "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    print(json.dumps({"step_times_s": times[spec["warmup"]:], "losses": losses,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "machine": machine}))


# --- the head: processes, run directories, the report ---------------------------------------

def _run(command: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return result, time.perf_counter() - start


def _fail(command: list[str], result: subprocess.CompletedProcess[str]) -> None:
    raise SystemExit(f"bench/gpu.py: `{shlex.join(command)}` exited {result.returncode}\n"
                     f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def _median_rate(batch: int, times: list[float]) -> dict[str, float]:
    median = statistics.median(times)
    return {"median_step_time_s": median, "samples_per_s": batch / median}


def _loss_gap(a: list[float], b: list[float]) -> dict[str, float]:
    """The largest per-step difference of two loss sequences (absolute, and relative to the
    first)."""
    pairs = list(zip(a, b, strict=True))
    return {"max_abs_loss_gap": max(abs(p - q) for p, q in pairs),
            "max_rel_loss_gap": max(abs(p - q) / max(abs(p), 1e-30) for p, q in pairs)}


class Runner:
    """Starts `python -m runner` runs of the benchmark's workload and reads their directories."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args, self.root, self.count = args, root, 0
        self.omitted: list[str] = []  # device keys left off (a runner that lacks them)

    def overrides(self, precision: str, ranks: int, backend: str) -> list[str]:
        a = self.args
        device_keys = {"trainer.device": a.device, "trainer.precision": precision}
        staging = ["comm.cuda_aware=false"] if backend == "mpi" and a.device == "cuda" else []
        return [
            "strategy=data", "grid.pr=1", f"grid.pc={ranks}", f"comm.backend={backend}",
            *staging,
            *(f"{k}={v}" for k, v in device_keys.items() if k not in self.omitted),
            "model=mlp", f"model.hidden=[{','.join(map(str, a.hidden))}]", "model.activation=relu",
            "dataset=synthetic", f"dataset.shape=[{a.inputs}]", f"dataset.classes={a.classes}",
            f"dataset.samples={a.samples}",
            "optimizer=sgd", f"optimizer.lr={LR}", f"optimizer.momentum={MOMENTUM}",
            f"trainer.steps={a.warmup + a.steps}", f"trainer.batch_size={a.batch}",
            "trainer.eval_every=null", "trainer.log_every=1", f"seed={SEED}",
        ]

    def gridrun(self, precision: str, ranks: int, backend: str) -> dict[str, Any]:
        self.count += 1
        run_dir = self.root / f"{self.count:02d}_{precision}_p{ranks}_{backend}"
        command = [sys.executable, "-m", "runner", *self.overrides(precision, ranks, backend),
                   f"hydra.run.dir={run_dir}"]
        result, wall = _run(command)
        rejected = [k for k in DEVICE_DEFAULTS if k in result.stderr and k not in self.omitted]
        if (result.returncode == 2 and rejected and "unknown key" in result.stderr
                and self.args.device == "cpu" and precision == "fp32"):
            # A runner without the GPU keys: they equal its defaults here, so leave them off.
            self.omitted += rejected
            self.count -= 1
            return self.gridrun(precision, ranks, backend)
        if result.returncode != 0:
            _fail(command, result)
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in lines if "split" not in m]
        timed = [m for m in train if m["step"] > self.args.warmup]
        step_s = sum(m["step_time_s"] for m in timed)
        bytes_per_step = summary.get("comm_bytes_per_step")
        predicted = summary.get("predicted_comm_bytes_per_step")
        return {
            "command": shlex.join(command),
            "ranks": summary.get("world_size"),
            "comm_backend": summary.get("comm_backend"),
            "devices": summary.get("devices"),
            "precision": summary.get("precision"),
            **_median_rate(self.args.batch, [m["step_time_s"] for m in timed]),
            # the summary's own, over every step, warm-up included
            "summary_samples_per_s": summary.get("samples_per_s"),
            "comm_time_share": sum(m["comm_time_s"] for m in timed) / step_s,
            "comm_bytes_per_step": bytes_per_step,
            "predicted_comm_bytes_per_step": predicted,
            "comm_bytes_as_predicted": bytes_per_step == predicted,
            "final_loss": summary.get("final_loss"),
            "val_accuracy": summary.get("val_accuracy"),
            "process_wall_s": wall,
            "_step_times_s": [m["step_time_s"] for m in timed],
            "_losses": [m["loss"] for m in train],
            "device_buffers": summary.get("device_buffers"),  # how device tensors travelled
        }

    def plain(self, precision: str) -> dict[str, Any]:
        a = self.args
        spec = {"device": a.device, "precision": precision, "inputs": a.inputs,
                "hidden": a.hidden, "classes": a.classes, "batch": a.batch, "samples": a.samples,
                "steps": a.steps, "warmup": a.warmup, "lr": LR, "momentum": MOMENTUM,
                "seed": SEED}
        command = [sys.executable, str(Path(__file__).resolve()), "--plain-worker",
                   json.dumps(spec)]
        result, wall = _run(command)
        if result.returncode != 0:
            _fail(command, result)
        out = json.loads(result.stdout.strip().splitlines()[-1])
        return {"command": shlex.join(command), "process_wall_s": wall,
                "_step_times_s": out["step_times_s"], "_losses": out["losses"],
                "parameters": out["parameters"], "machine": out["machine"]}


def _public(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record without its per-step lists (kept out of the JSON)."""
    return {k: v for k, v in run.items()
            if not k.startswith("_") and k not in ("machine", "parameters")}


def _pooled(batch: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """samples/s over every timed step of every round, and each round's own."""
    return {**_median_rate(batch, [t for r in runs for t in r["_step_times_s"]]),
            "rounds": [_public(r) for r in runs]}


def one_device(runner: Runner, precision: str) -> dict[str, Any]:
    """The plain loop against gridrun at one rank, alternating, `--rounds` times each."""
    args = runner.args
    plains, grids = [], []
    for _ in range(args.rounds):
        plains.append(runner.plain(precision))
        grids.append(runner.gridrun(precision, 1, "mpi"))
    plain, ours = _pooled(args.batch, plains), _pooled(args.batch, grids)
    ratio = ours["samples_per_s"] / plain["samples_per_s"]
    return {"precision": precision, "plain": plain, "gridrun": ours,
            "ratio": ratio, "target": f">= {TARGET}", "meets_target": ratio >= TARGET,
            # same start, same batches: the same training, to rounding
            **_loss_gap(plains[0]["_losses"], grids[0]["_losses"]),
            "_machine": plains[0]["machine"], "_parameters": plains[0]["parameters"],
            "_gridrun_losses": grids[0]["_losses"]}


def shared_device(runner: Runner, precision: str, ranks: int,
                  one_rank_losses: list[float]) -> dict[str, Any]:
    """P ranks on the one device under each backend, and one rank under torch."""
    mpi = runner.gridrun(precision, ranks, "mpi")
    torch_ = runner.gridrun(precision, ranks, "torch")
    one = runner.gridrun(precision, 1, "torch")
    return {
        "precision": precision, "ranks": ranks,
        "mpi": {**_public(mpi), **_loss_gap(one_rank_losses, mpi["_losses"])},
        "torch": {**_public(torch_), **_loss_gap(one_rank_losses, torch_["_losses"])},
        "ratio_torch_over_mpi": torch_["samples_per_s"] / mpi["samples_per_s"],
        "torch_one_rank": {**_public(one), **_loss_gap(one_rank_losses, one["_losses"])},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"),
                        default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating plain / gridrun processes per precision")
    parser.add_argument("--ranks", type=int, default=4, help="ranks sharing the device; 0: skip")
    parser.add_argument("--small", action="store_true", help=f"tiny sizes: {SMALL}")
    parser.add_argument("--inputs", type=int)
    parser.add_argument("--hidden", type=int, nargs="+")
    parser.add_argument("--classes", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--samples", type=int, help="synthetic samples (train and val)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--keep", type=Path, help="keep the run directories under DIR")
    parser.add_argument("--plain-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in (SMALL if args.small else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.steps, args.rounds) < 1 or args.warmup < 0 or args.ranks < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup and --ranks >= 0")
    return args


def main() -> None:
    args = parse_args()
    if args.plain_worker:
        plain_worker(json.loads(args.plain_worker))
        return
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            root = args.keep
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gridrun-gpu-")))
        runner = Runner(args, root)
        single = [one_device(runner, p) for p in args.precisions]
        shared = ([shared_device(runner, s["precision"], args.ranks, s["_gridrun_losses"])
                   for s in single] if args.ranks else [])
    layers = [args.inputs, *args.hidden, args.classes]
    report = {
        "benchmark": "gpu",
        "machine": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), **single[0]["_machine"]},
        "device": args.device,
        "model": {"name": "mlp", "layers": layers, "activation": "relu",
                  "parameters": single[0]["_parameters"]},
        "dataset": {"name": "synthetic", "shape": [args.inputs], "classes": args.classes,
                    "samples": args.samples, "seed": SEED},
        "batch": args.batch, "steps_timed": args.steps, "warmup_steps": args.warmup,
        "rounds": args.rounds,
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "terms": {
            "plain": "one process, model and train tensors on the device, per step: batch "
                     "indexed from a seeded per-epoch permutation, zero_grad, forward and "
                     "cross_entropy (autocast bfloat16 in bf16, none in fp32), backward, "
                     "torch.optim.SGD.step, loss.item()",
            "gridrun": "python -m runner strategy=data at 1 rank, comm.backend=mpi: its "
                       "metrics.jsonl step_time_s (the whole step, batch included)",
            "loss_read_every_step": "both: plain calls loss.item() every step, gridrun reads "
                                    "the (all-reduced) loss every step",
            "timing": "time.perf_counter around each step; on cuda the plain loop synchronizes "
                      "before and after; the first warmup_steps of every process untimed",
            "samples_per_s": "batch / median timed step time, pooled over the rounds",
            "ratio": "gridrun samples/s / plain samples/s",
        },
        "runner_keys_omitted": runner.omitted,
        "one_device": [{k: v for k, v in s.items() if not k.startswith("_")} for s in single],
        "shared_device": shared,
        "bench_wall_s": time.perf_counter() - started,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
