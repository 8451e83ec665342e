"""What is checked on the machine before a run starts, after the config itself is valid: that
the launcher exists, that the run directory is a directory of its own (not the current one, not
one a pending or running Slurm job will write) and can be made and written, and that its disk has
room for the checkpoints the run will keep; under `launcher=slurm`, what Slurm would make of the
job (`runner.cli.slurm.submission_problems`). A problem is one line, before any MPI job exists
and before anything is submitted."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from runner.checkpoint.space import checkpoint_bytes, space_problem
from runner.cli.slurm import live_job_problem, submission_problems
from runner.config.schema import LauncherConfig, RunConfig
from runner.records.rundir import earlier_records, held_by_live_run, run_dir_problem, unwritable
from runner.training.mpienv import bundled_mpiexec
from runner.zoo.datasets import DatasetSpec

if TYPE_CHECKING:  # torch-heavy: imported when a run is checked
    from runner.optim.sync import ReplicaOptimizer
    from runner.training.assembly import CheckedParts
    from strategies import Strategy

MIN_FREE_BYTES = 16 << 20  # logs, metrics and the summary of any run


# The flag for the number of ranks that launchers gridrun knows take (others: any flag).
NPROC_FLAGS = {"mpiexec": ("-n", "-np"), "mpirun": ("-n", "-np", "-c"),
               "mpiexec.hydra": ("-n", "-np"), "srun": ("-n", "--ntasks")}


def launcher_problems(launcher: LauncherConfig) -> list[str]:
    argv = launcher.argv
    command = argv[0] if argv else bundled_mpiexec()
    if command is None:
        return ["no mpiexec found: install the bundled MPI (pip install mpich) or set "
                "launcher.command to your site's launcher"]
    if shutil.which(command) is None:
        return [f"launcher.command={command}: not found or not executable"]
    known = NPROC_FLAGS.get(Path(command).name, ())
    flag = launcher.nproc_flag
    if (known and flag not in known) or not flag.startswith("-"):
        valid = f"one of {', '.join(known)}" if known else "a flag"
        return [f"launcher.nproc_flag={flag}: {Path(command).name} takes the number of ranks "
                f"after {valid}"]
    return []


GIB = float(1 << 30)
RUNTIME_BYTES = 300 << 20  # a rank's interpreter, torch and MPI before any tensor (measured)


def available_memory() -> int | None:
    """Bytes this machine can give a new job now (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ranks_on_this_machine(run: RunConfig, inside_mpi_job: bool) -> int | None:
    """How many of the run's ranks this machine hosts (None: not known here, e.g. srun, or a
    Slurm batch job)."""
    import os

    if run.launcher.slurm is not None:
        return None
    if run.grid.size == 1:
        return 1
    if inside_mpi_job:
        for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"):
            if os.environ.get(name, "").isdigit():
                return int(os.environ[name])
        return None
    return run.grid.size if not run.launcher.argv else None


def memory_estimate(run: RunConfig, parts: CheckedParts) -> dict[str, int]:
    """Rank 0's bytes, by what holds them: the planner's parameter and activation counts for
    this strategy and grid, gradients (one copy), optimizer state, the dataset (every rank
    loads it whole) and the runtime. An estimate: allocator slack and temporaries are not in
    it."""
    import math

    from runner.training import assembly

    spec, model, strategy, optimizer = _built(parts)
    params = strategy.predict_param_bytes(model, spec.input_shape, run.grid)
    # momentum/velocity, Adam's moments: the optimizer's own count; a centre variable: its
    # flat copy and the differences
    copies = (optimizer.state_copies(run.optimizer.options)
              + (2 if optimizer.has_centre else 0))
    itemsize = 8 if spec.vocab_size is not None else assembly.dtype_of(run).itemsize
    return {
        "parameters": params, "gradients": params, "optimizer state": copies * params,
        # outputs kept for backward, and their gradients
        "activations": 2 * strategy.predict_activation_bytes(
            model, spec.input_shape, run.grid, run.trainer.batch_size),
        "dataset": (spec.train_size + spec.val_size) * math.prod(spec.input_shape) * itemsize,
        "runtime": RUNTIME_BYTES}


def memory_problem(run: RunConfig, parts: CheckedParts, inside_mpi_job: bool) -> str | None:
    """A run that cannot fit in this machine's memory, refused before its ranks allocate."""
    ranks, available = ranks_on_this_machine(run, inside_mpi_job), available_memory()
    if ranks is None or available is None:
        return None
    needs = memory_estimate(run, parts)
    per_rank = sum(needs.values())
    if per_rank * ranks <= available:
        return None
    detail = ", ".join(f"{what} {size / GIB:.1f}" for what, size in needs.items())
    largest = max(needs, key=lambda what: needs[what])
    return (f"the run needs about {per_rank * ranks / GIB:.1f} GiB on this machine ({ranks} "
            f"rank(s) x {per_rank / GIB:.1f} GiB: {detail}), {available / GIB:.1f} GiB are "
            f"available; the largest part is the {largest} (model={run.model.name}, "
            f"dataset={run.dataset.name}, trainer.batch_size={run.trainer.batch_size})")


def checkpoint_space_needed(run: RunConfig, parts: CheckedParts) -> tuple[int, str]:
    """Bytes the run directory needs, and what for."""
    if not run.checkpoints_at_end:
        return MIN_FREE_BYTES, "the run's logs"
    _, model, _, optimizer = _built(parts)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    one = checkpoint_bytes(param_bytes, run.grid.pc, optimizer.per_replica,
                           optimizer.has_centre, optimizer.state_copies(run.optimizer.options))
    every = run.trainer.checkpoint_every
    # the ones kept, and the next one being written (only the one at the end without `every`)
    kept = (run.trainer.keep_checkpoints or max(1, run.trainer.steps // every)) + 1 if every else 1
    exported = param_bytes if run.trainer.export else 0  # the model once more, as safetensors
    what = f"{kept} checkpoint{'s' if kept > 1 else ''} of {one / (1 << 20):,.1f} MiB"
    return (MIN_FREE_BYTES + one * kept + exported,
            what + (", the exported model" if exported else "") + " and the logs")


def resume_problems(run: RunConfig, run_dir: Path, model: nn.Module,
                    notes: list[str]) -> list[str]:
    """The checkpoint `trainer.resume` names (or, for `auto`, the newest one that verifies),
    verified whole against the model before any rank starts: hashes, names, file types, the
    model's parameter names and shapes. What `auto` skipped goes to `notes`."""
    if run.trainer.resume is None:
        return []
    from runner.checkpoint.layout import CheckpointError
    from runner.checkpoint.read import Checkpoint
    from runner.checkpoint.resume import verify_resume

    try:
        found, skipped = verify_resume(run.trainer.resume, Path(run_dir) / "checkpoints", model)
    except CheckpointError as exc:
        return [f"trainer.resume={run.trainer.resume}: {exc}"]
    notes += skipped
    step = Checkpoint(found).step if found is not None else 0
    if step >= run.trainer.steps:
        return [f"trainer.resume={run.trainer.resume}: nothing to train: {found} is at step "
                f"{step} and trainer.steps={run.trainer.steps} (raise trainer.steps to train on)"]
    return []


def machine_problems(run: RunConfig, parts: CheckedParts, run_dir: Path,
                     inside_mpi_job: bool = False, notes: list[str] | None = None) -> list[str]:
    """Every reason this machine cannot run `run` into `run_dir` (empty: go), from the parts
    validation built (`runner.cli.validation.validate_parts`: one plain model for every check
    below, its parameter names, shapes and bytes and the planner's counts); what is worth
    saying but no problem goes to `notes`."""
    notes = notes if notes is not None else []
    batch_job = run.launcher.slurm is not None
    if batch_job and inside_mpi_job:
        return ["launcher=slurm submits a batch job: start it from a shell, not inside an MPI "
                "job"]
    problems = ([] if inside_mpi_job or run.grid.size == 1 or batch_job
                else launcher_problems(run.launcher))
    memory = memory_problem(run, parts, inside_mpi_job)
    if memory:
        problems.append(memory)
    problems += resume_problems(run, run_dir, _built(parts)[1], notes)
    if batch_job:
        problems += submission_problems(run, run_dir, predicted_step_seconds(run, parts), notes)
    problem = (run_dir_problem(run_dir) or live_job_problem(run_dir)
               or owner_problem(run, run_dir) or unwritable(run_dir))
    if problem:
        return [*problems, problem]
    needed, what = checkpoint_space_needed(run, parts)
    problem = space_problem(run_dir, needed, what)
    return [*problems, problem] if problem else problems


def predicted_step_seconds(run: RunConfig, parts: CheckedParts) -> float | None:
    """The planner's step time for the run, at this machine's calibrated costs and rates: for
    the Slurm time limit against the checkpoint interval (None where that is not checked, or the
    planner prices no step: an optimizer that does not sum gradients)."""
    options = run.launcher.slurm
    if options is None or options.time is None or run.trainer.checkpoint_every is None:
        return None
    from runner.config.machine import load_compute_rates, load_machine_costs
    from runner.training import assembly
    from runner.training.precision import HALF_TYPES
    from strategies.base import PricingContext, predict_step

    spec, model, _, optimizer_cls = _built(parts)
    if not optimizer_cls.syncs_gradients:
        return None
    trainer = run.trainer
    pricing = PricingContext(
        costs=load_machine_costs(), rows_touched=assembly.rows_touched(parts.dataset),
        compute_dtype=HALF_TYPES.get(trainer.precision),
        rates=load_compute_rates(None, trainer.precision), global_batch=trainer.batch_size,
        optimizer=assembly.optimizer_kind(run.optimizer),
        accumulate_steps=trainer.accumulate_steps,
        activation_checkpointing=trainer.activation_checkpointing)
    strategy = assembly.build_strategy(run.strategy, pricing)
    try:
        return predict_step(strategy, model, spec.input_shape, run.grid,
                            run.trainer.batch_size).total_s
    except (RuntimeError, ValueError, NotImplementedError):  # no price: nothing to check
        return None


def _built(parts: CheckedParts) -> tuple[DatasetSpec, nn.Module, Strategy,
                                         type[ReplicaOptimizer]]:
    """The parts a valid config always builds (validation refused it otherwise)."""
    assert (parts.spec is not None and parts.model is not None and parts.strategy is not None
            and parts.optimizer_cls is not None), "machine checks of a config that is not valid"
    return parts.spec, parts.model, parts.strategy, parts.optimizer_cls


# What a resume of a run may change: how long it trains, where and on what grid (checkpoints
# reshard), how it communicates, checkpoints and the watch on it. Everything else (the model,
# the data, the optimizer, the seed, the batch, precision, what is logged) is the run itself.
RESUMABLE = ("trainer.steps", "trainer.resume", "trainer.checkpoint_every",
             "trainer.keep_checkpoints", "trainer.comm_timeout_s", "trainer.threads",
             "trainer.device", "grid.", "strategy.", "comm.", "launcher.", "debug.", "logger")


def owner_problem(run: RunConfig, run_dir: Path) -> str | None:
    """Why this run may not write into `run_dir` (None: it may). A directory that records an
    earlier run (metrics, an outcome, checkpoints) belongs to that run: only a resume of it
    from its own checkpoints, under the same config but for `RESUMABLE` keys, goes on there."""
    records = earlier_records(run_dir)
    if not records or held_by_live_run(run_dir):  # a live run: the lock says whose
        return None
    held = f"hydra.run.dir={run_dir} holds an earlier run ({', '.join(records)})"
    resume = run.trainer.resume
    if resume is None:
        return (f"{held}: continue it with trainer.resume=auto, or name a new hydra.run.dir "
                f"(trainer.resume={run_dir} there starts from its checkpoint)")
    if resume != "auto" and not _inside(Path(resume), Path(run_dir)):
        return (f"{held}, and trainer.resume={resume} is another run's checkpoint: resume it "
                f"into a new hydra.run.dir")
    from runner.checkpoint.layout import latest_checkpoint

    if resume == "auto" and latest_checkpoint(Path(run_dir) / "checkpoints") is None:
        return (f"{held} and no checkpoint to continue it from: name a new hydra.run.dir")
    changed = _config_changes(run, Path(run_dir) / "config.yaml")
    if changed:
        return (f"{held} under another config ({'; '.join(changed)}): a resume may change only "
                f"{', '.join(k.rstrip('.') for k in RESUMABLE)}; name a new hydra.run.dir with "
                f"trainer.resume={run_dir} to start a new run from its checkpoint")
    return None


def _inside(path: Path, run_dir: Path) -> bool:
    resolved, home = path.resolve(), run_dir.resolve()
    return resolved == home or home in resolved.parents


def _config_changes(run: RunConfig, recorded: Path, most: int = 4) -> list[str]:
    """`key: was → now` for each key outside `RESUMABLE` that differs from the config the
    earlier run recorded (at most `most`, then how many more)."""
    from runner.config.schema import parse_with_problems
    from runner.records.rundir_files import load_yaml

    try:
        loaded = load_yaml(recorded)  # within bounds: the directory may not be this user's
        earlier, problems = parse_with_problems(loaded if isinstance(loaded, Mapping) else {})
    except (OSError, ValueError) as exc:
        return [f"its config.yaml cannot be read: {str(exc).splitlines()[0][:200]}"]
    if problems or not isinstance(loaded, Mapping):
        return ["its config.yaml is not a run's config"]
    was, now = _flat(dataclasses.asdict(earlier)), _flat(dataclasses.asdict(run))
    changed = [f"{key}: {was.get(key, '(unset)')} → {now.get(key, '(unset)')}"
               for key in sorted(set(was) | set(now))
               if was.get(key) != now.get(key) and not key.startswith(RESUMABLE)]
    return changed[:most] + ([f"{len(changed) - most} more"] if len(changed) > most else [])


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested mappings (a plugin's `options` under its group's name)."""
    if not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = key if key != "options" else ""
        out.update(_flat(item, f"{prefix}.{name}".strip(".") if name else prefix))
    return out
