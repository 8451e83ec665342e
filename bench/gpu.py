"""gridrun on one GPU against a plain PyTorch loop, and on one rank per GPU.

    python bench/gpu.py [--device cuda|cpu] [--models resnet18 gpt] [--precisions fp32 bf16]
                        [--compile none blocks] [--steps 100] [--warmup 10] [--rounds 2]
                        [--ranks N] [--small] [--compile-cache DIR] [--out FILE] [--keep DIR]

Two workloads, both as `python -m runner` trains them (`strategy=data`, SGD lr 0.01, momentum
0.9, seed 0, the loss read every step on both sides):
- `resnet18`: the CIFAR ResNet-18 (`model=resnet18`, 11.2M weights) on seeded synthetic
  3×32×32 images of 10 classes (`dataset=synthetic`), global batch 256;
- `gpt`: a GPT-2-small-sized decoder (`model=gpt`: width 768, 12 layers, 12 heads, 124M weights
  with its tied 50,257-token vocabulary) on next tokens of synthetic documents of 1,024 tokens
  (`dataset=tokens`), global batch 8 (8,192 tokens).
`--small` makes both tiny, so that `--device cpu --small` checks the whole script on a machine
without a GPU (a minute eager; the compiled runs add inductor's compiles, tens of seconds each on
a CPU when the cache is cold); its numbers are the CPU's, and the JSON says that no GPU was
measured.

Each comparison runs eager and compiled (`--compile`, default both):
- `none`: no `torch.compile` on either side (`trainer.compile=none`);
- `blocks`: gridrun `trainer.compile=blocks` (`strategies.compiled`: the children of the model's
  largest `nn.ModuleList`, each through `torch.compile(fullgraph=True)`), against the plain loop
  with `blocks[i] = torch.compile(blocks[i], fullgraph=True)` for each child of the same
  `nn.ModuleList` (the first of the largest, as gridrun picks it), as torchtitan compiles a
  transformer's blocks. The GPT's are its 12 (`--small`: 2) transformer blocks. The ResNet has
  no `nn.ModuleList` (its stages are `nn.Sequential`), so gridrun refuses `blocks` for it: its
  compiled comparison is `model` on both sides (`BLOCKS_MODE`), recorded as such in the JSON;
- `model`: gridrun `trainer.compile=model` against `torch.compile(model, fullgraph=True)`.
  Compiling happens in the warmup steps (the first training step traces and compiles forward
  and backward), outside the timed ones; gridrun's summary (`compile`) names what it compiled,
  compiled around and left eager, and its compile seconds. Both sides compile into one private
  cache (`--compile-cache`, default a folder of the benchmark's run directory): a later round,
  and the side that compiles second, may read graphs from it, which changes no timed step.
Both sides update with torch's SGD as torch picks its implementation: gridrun's `optimizer=sgd`
calls `torch.optim.sgd.sgd(..., foreach=None)` without `fused` (runner/optim/sync.py), the plain
loop `torch.optim.SGD(..., foreach=None, fused=None)`: the multi-tensor (foreach) kernels on CUDA,
the per-parameter loop on the CPU, neither fused; the plain worker records the one torch chose.

1. One device, per workload, precision (fp32; bf16 under autocast) and compile mode, in
   alternating rounds (a drift of the machine hits both alike), each side a fresh process:
   a. `plain`: the loop a user writes for one GPU (`--plain-worker`, this file): the same model
      and data (built by gridrun's own model zoo from the same config, under the same seed),
      the train tensors moved to the device once, per step: a batch indexed from a seeded
      per-epoch permutation (gridrun's sample order), zero_grad, forward and cross-entropy
      (under `torch.autocast(device, bfloat16)` in bf16), backward, `torch.optim.SGD.step`,
      `loss.item()`; its blocks or whole model compiled as above under `blocks` and `model`;
   b. `gridrun`: `python -m runner strategy=data grid.pr=1 grid.pc=1 trainer.device=D
      trainer.precision=P trainer.compile=C ...` in this file's `--gridrun-worker`, which runs
      the runner's own command line in its process after wrapping its per-step record
      (`Training.log_step`) to mark the end of two steps.
   Both sides are timed alike: the `--steps` steps after the first `--warmup`, between a mark at
   the end of step `warmup` (its loss read) and one at the end of the last step; on cuda the
   marks are CUDA events recorded on the current stream and the time is the events' elapsed
   time once the last has completed (on the CPU, `time.perf_counter`). No synchronisation is
   added inside the timed steps on either side: each reads its loss with `.item()`, as a user
   does. samples/s = batch · steps / seconds; the median over the rounds; `ratio = gridrun /
   plain`, target >= 0.95, for each compile mode. Both sides start from the same weights and
   see the same batches: the largest per-step loss gap shows they do the same work (float
   rounding in fp32; bf16, and compiled kernels, round more). gridrun's summary gives its
   TFLOP/s per GPU, MFU (model FLOPs of a step over its median step time, every step counted,
   the compiling first one too, against the GPU's dense peak) and peak device memory; `mfu` is
   the median over the rounds, `mfu_timed` the same FLOPs over the CUDA-event timing. For the
   GPT in bf16 compiled: target MFU >= 0.35 (with the ratio >= 0.95).
2. `--ranks P` (default: every GPU torch sees, when it sees 2 or more; on the CPU 2; 0 skips):
   gridrun `strategy=data` on 1 × P ranks, one per GPU, under `comm.backend=torch` (NCCL on
   cuda), per compile mode: samples/s, the share of the step spent communicating and the
   bytes per step, measured against predicted, from its `metrics.jsonl` (each step timed by the
   runner with `time.perf_counter`) and `summary.json` (with what it compiled).
Prints one JSON document (also written to `--out`): the machine, the exact sizes, each command
line, and each measurement. A compiled comparison whose process fails (gridrun refusing or
failing to compile) is recorded in its place and under `failed`, with the end of its output, the
others still run, and the script exits 1 once the JSON is out; a failing eager one ends it.
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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, cast

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.95  # gridrun's samples/s on one GPU at least this share of the plain loop's
MFU_TARGET = 0.35  # the GPT's MFU in bf16 compiled, from gridrun's summary
MFU_TARGET_CASE = ("gpt", "bf16")  # the workload and precision MFU_TARGET holds for, compiled
COMPILE_MODES = ("none", "blocks", "model")  # --compile: trainer.compile on gridrun's side
# What `--compile blocks` is per workload: trainer.compile=blocks compiles the children of the
# model's largest nn.ModuleList, and the ResNet has none (its stages are nn.Sequential: gridrun
# refuses `blocks` for it), so its compiled comparison compiles the whole model on both sides.
BLOCKS_MODE = {"resnet18": "model", "gpt": "blocks"}
LR, MOMENTUM, SEED = 0.01, 0.9, 0
EVAL_SAMPLES = 64  # the one evaluation at the end (after the timed steps): kept short
# Each workload: its overrides and global batch, full size and --small.
WORKLOADS: dict[str, dict[str, dict[str, Any]]] = {
    "resnet18": {
        "full": {"batch": 256, "overrides": [
            "model=resnet18", "dataset=synthetic", "dataset.shape=[3,32,32]",
            "dataset.classes=10", "dataset.samples=4096"]},
        "small": {"batch": 32, "overrides": [
            "model=resnet18", "model.widths=[8,16]", "model.blocks=[1,1]", "dataset=synthetic",
            "dataset.shape=[3,16,16]", "dataset.classes=10", "dataset.samples=512"]},
    },
    "gpt": {
        "full": {"batch": 8, "overrides": [
            "model=gpt", "model.width=768", "model.layers=12", "model.heads=12",
            "dataset=tokens", "dataset.vocab_size=50257", "dataset.seq_len=1024",
            "dataset.samples=1024"]},
        "small": {"batch": 8, "overrides": [
            "model=gpt", "model.width=32", "model.layers=2", "model.heads=2", "dataset=tokens",
            "dataset.vocab_size=128", "dataset.seq_len=32", "dataset.samples=256"]},
    },
}


def _workload(args: argparse.Namespace, name: str) -> dict[str, Any]:
    return WORKLOADS[name]["small" if args.small else "full"]


def common_overrides(workload: dict[str, Any], device: str, precision: str, ranks: int,
                     steps: int, compile_mode: str = "none",
                     compile_cache: Path | None = None) -> list[str]:
    """The run both sides train (the plain loop builds its model and data from it too, and
    compiles as its `trainer.compile` says)."""
    cache = ([f"trainer.compile_cache={compile_cache}"]
             if compile_mode != "none" and compile_cache is not None else [])
    return [*workload["overrides"], "strategy=data", "grid.pr=1", f"grid.pc={ranks}",
            f"trainer.device={device}", f"trainer.precision={precision}",
            "optimizer=sgd", f"optimizer.lr={LR}", f"optimizer.momentum={MOMENTUM}",
            f"trainer.steps={steps}", f"trainer.batch_size={workload['batch']}",
            "trainer.eval_every=null", f"trainer.eval_samples={EVAL_SAMPLES}", f"seed={SEED}",
            f"trainer.compile={compile_mode}", *cache]


def compile_mode(name: str, asked: str) -> str:
    """gridrun's trainer.compile for workload `name` when `--compile asked`: `blocks` is the
    whole model for a model without an nn.ModuleList (BLOCKS_MODE)."""
    return BLOCKS_MODE[name] if asked == "blocks" else asked


# --- the marks both sides time between --------------------------------------------------------

def _mark(device: Any) -> Any:
    """A point in time on `device`'s work: a CUDA event recorded on the current stream, or
    (CPU) the host's clock."""
    import torch

    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(start: Any, end: Any) -> float:
    """Seconds between two marks, once the later one has completed."""
    if isinstance(start, float):
        return float(end - start)
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


# --- the plain loop (its own process, like each gridrun run) -------------------------------

def _compile_plain(model: Any, mode: str) -> tuple[Any, list[str]]:
    """The plain loop's model compiled as a user compiles it for `trainer.compile=mode` (the
    module doc): the module to call, and the names of those compiled."""
    import torch
    from torch import nn

    if mode == "none":
        return model, []
    if mode == "model":
        return torch.compile(model, fullgraph=True), ["(model)"]
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module)]
    if not lists:
        raise SystemExit(f"--compile blocks: {type(model).__name__} has no nn.ModuleList")
    name, blocks = max(lists, key=lambda item: len(item[1]))  # the first of the largest
    for i, block in enumerate(blocks):  # torch.compile of a module is a module (its wrapper)
        blocks[i] = cast(nn.Module, torch.compile(block, fullgraph=True))
    return model, [f"{name}.{i}" if name else str(i) for i in range(len(blocks))]


def _optimizer_path(params: list[Any]) -> str:
    """The SGD implementation torch picks for `params` when told neither foreach nor fused
    (gridrun's `sgd` and the plain loop both leave it to torch)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False,
                                                      use_fused=False)
    except (ImportError, TypeError):  # a private helper: another torch may lack it
        return "unknown"
    return "fused" if fused else "foreach" if foreach else "for-loop"


def plain_worker(spec: dict[str, Any]) -> None:
    """What a user writes to train this model on one device; prints its timing and losses."""
    if spec.get("compile_cache"):  # the private cache gridrun's side compiles into too
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = spec["compile_cache"]
    import torch
    import torch.nn.functional as F

    from runner.cli.compose import compose
    from runner.cli.validation import validate
    from runner.training.assembly import assemble

    run = validate(compose(spec["overrides"]), world_size=1)
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    torch.manual_seed(run.seed)  # as gridrun builds its model: the same initial weights
    parts = assemble(run)
    data = parts.dataset.load()
    x, y = data.train_x.to(device), data.train_y.to(device)
    model = parts.model.to(device)
    params = list(model.parameters())
    # torch's default implementation, as gridrun's `sgd` (foreach=None, no fused): foreach
    # kernels on CUDA, the per-parameter loop on the CPU
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, foreach=None, fused=None)
    model, compiled = _compile_plain(model, run.trainer.compile)

    def autocast() -> Any:
        if spec["precision"] == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    batch, n = run.trainer.batch_size, len(x)
    warmup, steps = spec["warmup"], spec["steps"]
    order_generator = torch.Generator().manual_seed(run.seed)
    order, position = torch.randperm(n, generator=order_generator).to(device), 0
    losses, start, end = [], None, None
    for step in range(1, warmup + steps + 1):
        if position + batch > n:  # a new epoch: a new permutation, the last partial batch dropped
            order, position = torch.randperm(n, generator=order_generator).to(device), 0
        rows = order[position:position + batch]
        position += batch
        optimizer.zero_grad()
        with autocast():
            out = model(x[rows])
            loss = F.cross_entropy(out.flatten(0, -2), y[rows].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == warmup:
            start = _mark(device)
        if step == warmup + steps:
            end = _mark(device)
    machine = {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if cuda:
        machine |= {"cuda_device": torch.cuda.get_device_name(device),
                    "cuda": torch.version.cuda,
                    "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    print(json.dumps({"seconds": _seconds(start, end), "losses": losses,
                      "parameters": sum(p.numel() for p in params), "compiled": compiled,
                      "optimizer_path": _optimizer_path(params), "machine": machine}))


# --- gridrun's side, timed at the same points ---------------------------------------------------

def gridrun_worker(spec: dict[str, Any]) -> None:
    """`python -m runner OVERRIDES` in this process (one rank: the runner trains in the process
    it was started in), its per-step record wrapped to mark the end of step `warmup` and of the
    last step; writes the seconds between them to `spec["timing"]`."""
    import runpy

    from runner.training import loop

    warmup, last = spec["warmup"], spec["warmup"] + spec["steps"]
    marks: dict[int, Any] = {}
    record = loop.Training.log_step

    def log_step(self: Any, step: int, *args: Any, **kwargs: Any) -> None:
        record(self, step, *args, **kwargs)
        if step in (warmup, last):
            marks[step] = _mark(self.device)
        if step == last:
            Path(spec["timing"]).write_text(json.dumps(
                {"seconds": _seconds(marks[warmup], marks[last])}))

    loop.Training.log_step = log_step  # type: ignore[method-assign]
    sys.argv = ["gridrun", *spec["overrides"]]
    runpy.run_module("runner", run_name="__main__")


# --- the head: processes, run directories, the report ---------------------------------------

def _run(command: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    return result, time.perf_counter() - start


class RunFailed(Exception):
    """A benchmark process that exited with an error: its command and the end of its output."""


def _fail(command: list[str], result: subprocess.CompletedProcess[str]) -> NoReturn:
    raise RunFailed(f"`{shlex.join(command)}` exited {result.returncode}\n"
                     f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def _loss_gap(a: list[float], b: list[float]) -> dict[str, float]:
    """The largest per-step difference of two loss sequences (absolute, and relative to the
    first)."""
    pairs = list(zip(a, b, strict=True))
    return {"max_abs_loss_gap": max(abs(p - q) for p, q in pairs),
            "max_rel_loss_gap": max(abs(p - q) / max(abs(p), 1e-30) for p, q in pairs)}


# summary.json's keys a benchmark reports beside its own timing
SUMMARY_KEYS = ("median_step_time_s", "predicted_step_time_s", "tflops_per_gpu", "mfu",
                "gpu_peak", "device_memory_peak_bytes", "model_flops_per_step", "devices",
                "device_buffers", "compile")


class Runner:
    """Starts the two sides' processes for the benchmark's workloads and reads what they
    leave."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args, self.root, self.count = args, root, 0

    def _dir(self, label: str) -> Path:
        self.count += 1
        return self.root / f"{self.count:02d}_{label}"

    def overrides(self, name: str, precision: str, ranks: int, mode: str) -> list[str]:
        a = self.args
        return common_overrides(_workload(a, name), a.device, precision, ranks,
                                a.warmup + a.steps, mode, a.compile_cache)

    def plain(self, name: str, precision: str, mode: str) -> dict[str, Any]:
        a = self.args
        spec = {"device": a.device, "precision": precision, "warmup": a.warmup,
                "steps": a.steps, "overrides": self.overrides(name, precision, 1, mode),
                "compile_cache": str(a.compile_cache) if mode != "none" else None}
        command = [sys.executable, str(Path(__file__).resolve()), "--plain-worker",
                   json.dumps(spec)]
        result, wall = _run(command)
        if result.returncode != 0:
            _fail(command, result)
        out = json.loads(result.stdout.strip().splitlines()[-1])
        batch = _workload(a, name)["batch"]
        return {"command": shlex.join(command), "process_wall_s": wall,
                "seconds": out["seconds"], "samples_per_s": batch * a.steps / out["seconds"],
                "compiled": out["compiled"], "_optimizer_path": out["optimizer_path"],
                "_losses": out["losses"], "_parameters": out["parameters"],
                "_machine": out["machine"]}

    def gridrun_one(self, name: str, precision: str, mode: str) -> dict[str, Any]:
        """gridrun at one rank, timed at the plain loop's points."""
        a = self.args
        run_dir = self._dir(f"{name}_{precision}_{mode}_p1")
        timing = run_dir.with_suffix(".timing.json")
        spec = {"warmup": a.warmup, "steps": a.steps, "timing": str(timing),
                "overrides": [*self.overrides(name, precision, 1, mode),
                              f"hydra.run.dir={run_dir}"]}
        command = [sys.executable, str(Path(__file__).resolve()), "--gridrun-worker",
                   json.dumps(spec)]
        result, wall = _run(command)
        if result.returncode != 0 or not timing.exists():
            _fail(command, result)
        seconds = json.loads(timing.read_text())["seconds"]
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        batch = _workload(a, name)["batch"]
        return {"command": shlex.join(command), "process_wall_s": wall, "seconds": seconds,
                "samples_per_s": batch * a.steps / seconds,
                "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
                "_losses": [m["loss"] for m in lines if "split" not in m]}

    def gridrun_ranks(self, name: str, precision: str, ranks: int, mode: str) -> dict[str, Any]:
        """gridrun on `ranks` ranks, one per GPU, under comm.backend=torch."""
        a = self.args
        run_dir = self._dir(f"{name}_{precision}_{mode}_p{ranks}_torch")
        command = [sys.executable, "-m", "runner", *self.overrides(name, precision, ranks, mode),
                   "comm.backend=torch", f"hydra.run.dir={run_dir}"]
        result, wall = _run(command)
        if result.returncode != 0:
            _fail(command, result)
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = [m for m in lines if "split" not in m and m["step"] > a.warmup]
        step_s = sum(m["step_time_s"] for m in timed)
        measured = summary.get("comm_bytes_per_step")
        predicted = summary.get("predicted_comm_bytes_per_step")
        batch = _workload(a, name)["batch"]
        return {
            "command": shlex.join(command), "process_wall_s": wall, "ranks": ranks,
            "compile": mode,
            "samples_per_s": batch / statistics.median(m["step_time_s"] for m in timed),
            "comm_time_share": sum(m["comm_time_s"] for m in timed) / step_s,
            "comm_bytes_per_step": measured, "predicted_comm_bytes_per_step": predicted,
            "comm_bytes_as_predicted": measured == predicted and all(
                m["comm_bytes"] == predicted for m in timed),
            "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        }


def _mfu(grids: list[dict[str, Any]], samples_per_s: float, batch: int) -> dict[str, Any]:
    """gridrun's MFU: its summaries' (median over the rounds), and the same FLOPs per step
    over the benchmark's own timing (None where no GPU was measured)."""
    summaries = [r["summary"] for r in grids]
    values = [s["mfu"] for s in summaries]
    mfu = statistics.median(values) if None not in values else None
    flops, peak = summaries[0]["model_flops_per_step"], summaries[0]["gpu_peak"]
    timed = (flops * samples_per_s / batch / (peak["tflops"] * 1e12)
             if flops and peak and peak.get("tflops") else None)
    return {"mfu": mfu, "mfu_rounds": values, "mfu_timed": timed}


def one_device(runner: Runner, name: str, precision: str, mode: str) -> dict[str, Any]:
    """The plain loop against gridrun at one rank, alternating, `--rounds` times each, both
    compiled as `mode` says."""
    plains, grids = [], []
    for _ in range(runner.args.rounds):
        plains.append(runner.plain(name, precision, mode))
        grids.append(runner.gridrun_one(name, precision, mode))
    plain = statistics.median(r["samples_per_s"] for r in plains)
    ours = statistics.median(r["samples_per_s"] for r in grids)
    ratio = ours / plain
    batch = _workload(runner.args, name)["batch"]
    mfu = _mfu(grids, ours, batch)
    if (name, precision) == MFU_TARGET_CASE and mode != "none":
        mfu |= {"mfu_target": f">= {MFU_TARGET}",
                "meets_mfu_target": None if mfu["mfu"] is None else mfu["mfu"] >= MFU_TARGET}
    compiled = grids[0]["summary"].get("compile") or {}
    return {"model": name, "precision": precision, "compile": mode, "batch": batch,
            "plain": {"samples_per_s": plain, "rounds": [_public(r) for r in plains]},
            "gridrun": {"samples_per_s": ours, "rounds": [_public(r) for r in grids]},
            "ratio": ratio, "target": f">= {TARGET}", "meets_target": ratio >= TARGET, **mfu,
            # what each side compiled: the same modules, or the reason gridrun did not
            "compiled": {"plain": plains[0]["compiled"],
                         "gridrun": compiled.get("compiled", []),
                         "gridrun_compiled_around": compiled.get("compiled_around", {}),
                         "gridrun_eager": compiled.get("eager", {})},
            "optimizer_path": plains[0]["_optimizer_path"],
            # same start, same batches: the same training, to rounding
            **_loss_gap(plains[0]["_losses"], grids[0]["_losses"]),
            "_machine": plains[0]["_machine"], "_parameters": plains[0]["_parameters"]}


def _attempt(label: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measure()`; a compiled comparison (`label["compile"]` not none) whose process fails is
    recorded as failed, under `label`, with the end of its output, and the benchmark goes on
    (an eager one ends it, as before)."""
    try:
        return measure()
    except RunFailed as exc:
        if label["compile"] == "none":
            raise SystemExit(f"bench/gpu.py: {exc}") from None
        lines = [line for line in str(exc).splitlines() if line.strip()]
        print(f"bench/gpu.py: {label} failed, recorded: {lines[-1] if lines else ''}",
              file=sys.stderr)
        return {**label, "failed": lines[-1] if lines else "failed",
                "command": lines[0] if lines else None, "output_tail": lines[-40:]}


def _public(run: dict[str, Any]) -> dict[str, Any]:
    """A run's record without its per-step lists and the worker's machine (kept out of the
    JSON)."""
    return {k: v for k, v in run.items() if not k.startswith("_")}


def default_ranks(device: str) -> int:
    """One rank per GPU where torch sees two or more (none with one); 2 on the CPU."""
    if device == "cpu":
        return 2
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus if gpus >= 2 else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--models", nargs="+", choices=tuple(WORKLOADS),
                        default=list(WORKLOADS))
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"),
                        default=["fp32", "bf16"])
    parser.add_argument("--compile", nargs="+", choices=COMPILE_MODES, default=["none", "blocks"],
                        help="trainer.compile of each comparison, the plain loop compiled alike "
                             "(blocks: the whole model for the ResNet, which has no "
                             "nn.ModuleList)")
    parser.add_argument("--compile-cache", type=Path,
                        help="the compile cache both sides use (default: a private folder of "
                             "the run directory)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (>= 1)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating plain / gridrun processes per workload and precision")
    parser.add_argument("--ranks", type=int,
                        help="ranks, one per GPU (default: every GPU when 2 or more; 2 on the "
                             "CPU); 0 skips")
    parser.add_argument("--small", action="store_true", help="tiny models and data")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--keep", type=Path, help="keep the run directories under DIR")
    parser.add_argument("--plain-worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--gridrun-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker or args.gridrun_worker:
        return args
    if min(args.steps, args.rounds, args.warmup) < 1 or (args.ranks or 0) < 0:
        parser.error("--steps, --rounds and --warmup must be >= 1, --ranks >= 0")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no GPU here (--device cpu for the smoke run)")
    args.ranks_given = args.ranks is not None
    if args.ranks is None:
        args.ranks = default_ranks(args.device)
    return args


def main() -> None:
    args = parse_args()
    if args.plain_worker:
        plain_worker(json.loads(args.plain_worker))
        return
    if args.gridrun_worker:
        gridrun_worker(json.loads(args.gridrun_worker))
        return
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            root = args.keep
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gridrun-gpu-")))
        if args.compile_cache is None:
            args.compile_cache = root / "compile-cache"
        args.compile_cache = args.compile_cache.resolve()
        runner = Runner(args, root)
        modes = {name: list(dict.fromkeys(compile_mode(name, c) for c in args.compile))
                 for name in args.models}
        cases = [(name, p, mode) for name in args.models for p in args.precisions
                 for mode in modes[name]]
        single = [_attempt({"model": name, "precision": p, "compile": mode},
                           partial(one_device, runner, name, p, mode))
                  for name, p, mode in cases]
        ranks = ([_attempt({"model": name, "precision": p, "compile": mode, "ranks": args.ranks},
                           partial(runner.gridrun_ranks, name, p, args.ranks, mode))
                  | {"model": name, "precision": p} for name, p, mode in cases]
                 if args.ranks else [])
    failed = [s for s in [*single, *ranks] if "failed" in s]
    machine: dict[str, Any] = next((s["_machine"] for s in single if "_machine" in s), {})
    gpu = machine.get("cuda_device")
    report = {
        "benchmark": "gpu",
        "machine": {"hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), **machine},
        "device": args.device,
        # what these numbers are: a GPU's only when one was measured
        "measured_on": gpu if gpu else "cpu: a smoke run, no GPU was measured",
        "gpu_figures_measured": bool(gpu),
        "models": {name: {"overrides": _workload(args, name)["overrides"],
                          "batch": _workload(args, name)["batch"],
                          "compile_modes": modes[name],
                          "parameters": next((s["_parameters"] for s in single
                                              if s["model"] == name and "_parameters" in s),
                                             None)}
                   for name in args.models},
        "steps_timed": args.steps, "warmup_steps": args.warmup, "rounds": args.rounds,
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM,
                      "implementation": "torch's default on both sides (foreach=None, fused "
                                        "not set): see each comparison's optimizer_path"},
        "seed": SEED, "compile_asked": args.compile, "compile_cache": str(args.compile_cache),
        "terms": {
            "plain": "one process, model and train tensors on the device, per step: batch "
                     "indexed from a seeded per-epoch permutation, zero_grad, forward and "
                     "cross_entropy (autocast bfloat16 in bf16, none in fp32), backward, "
                     "torch.optim.SGD.step, loss.item(); compiled per `compile`",
            "gridrun": "python -m runner strategy=data at 1 rank (comm.backend=mpi) "
                       "trainer.compile=<compile> in the benchmark's worker process, its "
                       "per-step record wrapped to mark steps",
            "compile": "none: eager on both sides; blocks: gridrun trainer.compile=blocks, the "
                       "plain loop torch.compile(block, fullgraph=True) for each child of the "
                       "model's largest nn.ModuleList; model: trainer.compile=model against "
                       "torch.compile(model, fullgraph=True) (the ResNet's `blocks`, as it "
                       "has no nn.ModuleList). Compiling falls in the warmup steps",
            "mfu": "gridrun summary's MFU (median step time, every step counted), median over "
                   "the rounds; mfu_timed: the same FLOPs over the timed steps",
            "timing": "both sides: from the end of step warmup_steps to the end of the last "
                      "step, CUDA events on cuda (perf_counter on the CPU), no synchronisation "
                      "added between; each reads its loss every step",
            "samples_per_s": "batch * steps_timed / seconds, the median over the rounds",
            "ratio": "gridrun samples/s / plain samples/s",
            "one_rank_per_gpu": "gridrun strategy=data on 1 x ranks, comm.backend=torch (NCCL "
                                "on cuda); samples/s from the median of its metrics' step times",
        },
        "one_device": [{k: v for k, v in s.items() if not k.startswith("_")} for s in single],
        "one_rank_per_gpu": ranks if ranks else {"skipped": (
            "--ranks 0" if args.ranks_given else "torch sees fewer than 2 GPUs here")},
        # compiled comparisons that failed (each also in its place above, with its output)
        "failed": [{k: s[k] for k in ("model", "precision", "compile", "ranks") if k in s}
                   for s in failed],
        "bench_wall_s": time.perf_counter() - started,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if failed:
        raise SystemExit(f"bench/gpu.py: {len(failed)} compiled comparison(s) failed: see "
                         f"`failed` in the JSON")


if __name__ == "__main__":
    main()
