"""Everything about a config that can be checked before any process starts, once per run.

The config flows one way: `validate_parts()` parses the composed config
(`runner.config.schema.parse`: unknown keys, wrong types, values outside the choices and ranges
each key declares), checks how keys bear on each other and on the MPI job, builds the run's parts
as far as they build (`runner.training.assembly.check_parts`: known plugins, their options typed by
their signatures, the model on the dataset's shapes) and then what each part says of the others.
Every problem is named; the caller prints them on one line. The machine's checks
(`runner.cli.preflight`) read the same parts. The ranks do not repeat any of this: they trust the
`config.yaml` the head wrote.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from runner.config.schema import (
    ConfigError,
    RunConfig,
    parse_with_problems,
)

if TYPE_CHECKING:  # the assembly imports torch: loaded when a config is checked, not for --help
    from runner.training.assembly import CheckedParts


def device_problems(run: RunConfig) -> list[str]:
    """trainer.device, trainer.precision and comm.cuda_aware; a GPU asked for where torch sees
    none is refused here, before any rank starts (the head runs where the ranks do, but for a
    Slurm batch job's: they run on the nodes Slurm gives it)."""
    trainer = run.trainer
    problems: list[str] = []
    if trainer.device == "cuda" and run.launcher.slurm is None:
        import torch

        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if not torch.backends.cuda.is_built()
                   else "torch sees no GPU here")
            problems.append(f"trainer.device=cuda: {why} (torch {torch.__version__}); use "
                            f"trainer.device=cpu, or auto")
    if trainer.precision != "fp32" and trainer.dtype != "float32":
        problems.append(f"trainer.precision={trainer.precision} with trainer.dtype="
                        f"{trainer.dtype}: mixed precision keeps float32 parameters; use "
                        f"trainer.dtype=float32")
    return problems


def _lr_problems(run: RunConfig) -> list[str]:
    """A learning rate the parameters' float type cannot hold: the first update overflows."""
    import torch

    lr = run.optimizer.options.get("lr")
    if not isinstance(lr, (int, float)) or isinstance(
            lr, bool) or not math.isfinite(lr):
        return []
    largest = torch.finfo(getattr(torch, run.trainer.dtype)).max
    if abs(lr) > largest:
        return [f"optimizer.lr={lr:g}: larger than a {run.trainer.dtype} step can hold "
                f"({largest:.3g})"]
    return []


def _range_problems(run: RunConfig, world_size: int | None) -> list[str]:
    """What the schema's per-key declarations cannot say: how keys bear on each other and on
    this machine (a key outside its declared choices or range was named by the parse, and its
    default stands in here)."""
    problems: list[str] = []
    trainer, debug, grid = run.trainer, run.debug, run.grid
    problems += _lr_problems(run)
    problems += device_problems(run)
    if run.launcher.slurm is not None:
        from runner.cli.slurm import option_problems

        problems += option_problems(run)
    if trainer.resume is not None and not trainer.resume:
        problems.append("trainer.resume='': must be null, auto or a checkpoint path")
    elif trainer.resume not in (None, "auto"):
        from runner.checkpoint.layout import CheckpointError, resolve_resume

        try:  # a path names a checkpoint directory, or a run directory with checkpoints
            resolve_resume(trainer.resume, None)
        except CheckpointError as exc:
            problems.append(str(exc))
    if run.logger == "tensorboard":
        from runner.records.board import tensorboard_missing

        problems += filter(None, [tensorboard_missing()])
    if debug.fail_at_step is not None and debug.fail_at_step > trainer.steps >= 1:
        problems.append(f"debug.fail_at_step={debug.fail_at_step} is past trainer.steps="
                        f"{trainer.steps}: that failure would never happen")
    if grid.pr >= 1 and grid.pc >= 1:
        if world_size is not None and grid.size != world_size:
            problems.append(f"grid.pr*grid.pc={grid.size} but the MPI job has {world_size} "
                            f"ranks (set grid.pr and grid.pc so that their product is "
                            f"{world_size})")
        if debug.fail_at_step is not None and debug.fail_on_rank >= grid.size:
            problems.append(f"debug.fail_on_rank={debug.fail_on_rank} is not a rank of a "
                            f"{grid.size}-rank job")
        if debug.slow_rank is not None and debug.slow_rank >= grid.size:
            problems.append(f"debug.slow_rank={debug.slow_rank} is not a rank of a "
                            f"{grid.size}-rank job")
    return problems


def _cross_part_problems(run: RunConfig, parts: CheckedParts, grid_ok: bool) -> list[str]:
    """What each built part says of the others: the strategy on the grid and the model, the
    optimizer on the strategy, the batch on the data."""
    problems: list[str] = []
    strategy, optimizer_cls, spec = parts.strategy, parts.optimizer_cls, parts.spec
    if optimizer_cls is not None and grid_ok:
        problems += optimizer_cls.grid_problems(parts.optimizer_options, run.grid.pr,
                                                run.grid.pc)
    if strategy is not None:
        batch = run.trainer.batch_size
        if grid_ok and batch >= 1:
            problems += strategy.check(run.grid, batch)
        if parts.model is not None and spec is not None and grid_ok:
            found = strategy.check_model(parts.model, spec.input_shape, run.grid)
            if not found and optimizer_cls is not None and optimizer_cls.syncs_gradients:
                found = _random_draw_problems(run, strategy, parts.model, spec.input_shape)
            problems += found
        if (optimizer_cls is not None and strategy.synchronous_only
                and not optimizer_cls.syncs_gradients):
            problems.append(
                f"{run.optimizer.shown('optimizer')}: its replicas exchange by other means "
                f"than summed gradients, which strategy={run.strategy.name} needs (it lays "
                f"weights out over the whole grid); use a synchronous optimizer (sgd, adam, "
                f"...) or strategy=grid")
        if (optimizer_cls is not None and not optimizer_cls.elementwise and grid_ok
                and strategy.splits_parameters(run.grid)):
            problems.append(
                f"{run.optimizer.shown('optimizer')}: its update of a parameter depends on "
                f"the whole parameter, which strategy={run.strategy.name} splits over "
                f"{_splitting_ranks(run)}; use strategy=data (or grid.pr=1) or an "
                f"element-wise optimizer (sgd, adam, adamw, torch.optim.RMSprop, ...)")
    problems += _micro_batch_problems(run, parts, grid_ok)
    problems += _compile_problems(run, parts)
    problems += _gradient_problems(run, parts)
    if spec is not None and run.trainer.batch_size > spec.train_size:
        problems.append(f"trainer.batch_size={run.trainer.batch_size} is larger than the "
                        f"{spec.train_size} training samples of dataset={run.dataset.name}")
    return problems


def _micro_batch_problems(run: RunConfig, parts: CheckedParts, grid_ok: bool) -> list[str]:
    """trainer.accumulate_steps and trainer.activation_checkpointing against the model, the
    grid and the optimizer: where either would not compute what the step without it does,
    refused by name."""
    from strategies.probe import training_calls
    from strategies.recompute import checkpoint_targets

    trainer, model, spec, strategy = run.trainer, parts.model, parts.spec, parts.strategy
    count, problems = trainer.accumulate_steps, []
    batch, pc = trainer.batch_size, run.grid.pc
    if count > 1 and grid_ok and batch >= 1 and batch % (pc * count):
        problems.append(f"trainer.accumulate_steps={count}: trainer.batch_size={batch} does not "
                        f"split into {count} equal micro-batches on each of the {pc} batch "
                        f"groups (grid.pc); the batch must be a multiple of {pc * count}")
    if model is None or spec is None:
        return problems
    recomputed, problem = checkpoint_targets(model, trainer.activation_checkpointing)
    problems += [problem] if problem is not None else []
    refused = (strategy.recompute_problem(model, recomputed, run.grid)
               if recomputed and grid_ok and strategy else None)
    if refused is not None:
        problems.append(f"trainer.activation_checkpointing={trainer.activation_checkpointing}: "
                        f"{refused}")
    if count == 1 and not recomputed:
        return problems
    calls = training_calls(model, spec.input_shape)
    modules = dict(model.named_modules())
    norms = [f"{name or 'the model'} ({type(modules[name]).__name__})"
             for name in calls.batch_norms]
    if count > 1 and norms:
        problems.append(f"trainer.accumulate_steps={count}: {', '.join(norms[:3])} normalize "
                        f"by batch statistics, which each micro-batch would take over its own "
                        f"rows (and update the running statistics {count} times a step); use "
                        f"trainer.accumulate_steps=1")
    for name, shown in zip(calls.batch_norms, norms, strict=True):
        inside = [r for r in recomputed if name == r or name.startswith(f"{r}.")]
        if inside:
            problems.append(f"trainer.activation_checkpointing="
                            f"{trainer.activation_checkpointing}: {shown} normalizes by batch "
                            f"statistics inside {inside[0]}, whose recomputation would "
                            f"normalize (and update the running statistics) again")
            break
    if count > 1 and calls.draws and grid_ok and strategy is not None:
        optimizer_cls = parts.optimizer_cls
        drawn = "; ".join(calls.named(modules)[:3])
        if optimizer_cls is not None and not optimizer_cls.syncs_gradients:
            problems.append(f"trainer.accumulate_steps={count} with "
                            f"{run.optimizer.shown('optimizer')}: a replica draws its own masks "
                            f"per forward, which micro-batches would draw otherwise: {drawn}")
        elif not strategy.draws_rows_alike(model, spec.input_shape, run.grid):
            problems.append(f"trainer.accumulate_steps={count}: strategy={run.strategy.name} "
                            f"draws random numbers per forward, not by each row's place in the "
                            f"global batch, so micro-batches would draw other masks: {drawn}; "
                            f"strategy=data draws them by row")
    return problems


def _compile_problems(run: RunConfig, parts: CheckedParts) -> list[str]:
    """trainer.compile=blocks on a model without repeated blocks (fsdp compiles its own units
    instead); a compile cache that cannot be written."""
    from strategies.compiled import compile_cache_dir, no_blocks_problem
    from strategies.recompute import repeated_blocks

    trainer = run.trainer
    problems: list[str] = []
    if trainer.compile == "none":
        return problems
    if (trainer.compile == "blocks" and parts.model is not None and run.strategy.name != "fsdp"
            and not repeated_blocks(parts.model)):
        problems.append(no_blocks_problem(parts.model))
    directory = compile_cache_dir(trainer.compile_cache)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writable = os.access(directory, os.W_OK | os.X_OK)
    except OSError as exc:
        writable, why = False, exc.strerror or type(exc).__name__
    else:
        why = "not writable"
    if not writable:
        problems.append(f"trainer.compile_cache={trainer.compile_cache or directory}: the compile "
                        f"cache {directory} cannot be written ({why})")
    return problems


def _gradient_problems(run: RunConfig, parts: CheckedParts) -> list[str]:
    """A model with nothing to train, and an optimizer that takes only row-sparse gradients
    (torch.optim.SparseAdam) on a model with dense ones: every rank would start and then fail
    at its first step."""
    from runner.optim.sync import SPARSE_ONLY_TORCH_OPTIMIZERS
    from strategies.exchange.sparse_gradients import sparse_tables

    model = parts.model
    if model is None:
        return []
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        why = ("every one has requires_grad=False" if any(True for _ in model.parameters())
               else "it has none")
        return [f"{run.model.shown('model')}: {type(model).__name__} has no trainable "
                f"parameters ({why}): there is nothing to train"]
    torch_class = getattr(parts.optimizer_cls, "torch_class", None)
    if torch_class not in SPARSE_ONLY_TORCH_OPTIMIZERS:
        return []
    sparse = {id(module.weight) for _, module in sparse_tables(model)}
    dense = [name for name, p in trainable if id(p) not in sparse]
    if not dense:
        return []
    more = f" and {len(dense) - 1} more" if len(dense) > 1 else ""
    return [f"{run.optimizer.shown('optimizer')} takes only row-sparse gradients (an "
            f"embedding's with sparse=True), and the model's {dense[0]}{more} get dense ones: "
            f"choose an optimizer that takes dense gradients (torch.optim.Adam, ...)"]


def _splitting_ranks(run: RunConfig) -> str:
    """Which ranks split a parameter: the model group's, or (fsdp) every rank."""
    if run.strategy.name == "fsdp":
        return f"all {run.grid.pr * run.grid.pc} ranks"
    return f"grid.pr={run.grid.pr} ranks"


def _random_draw_problems(run: RunConfig, strategy: Any, model: Any,
                          sample_shape: tuple[int, ...]) -> list[str]:
    """A model that draws random numbers in training (dropout, stochastic depth) on a grid
    where the strategy draws per rank: not one process's masks, refused by module."""
    from strategies.probe import random_draws

    if strategy.reproduces_random_draws(model, sample_shape, run.grid):
        return []
    draws = random_draws(model, sample_shape)
    if not draws:
        return []
    shown = "; ".join(draws[:3]) + (f"; and {len(draws) - 3} more" if len(draws) > 3 else "")
    return [f"strategy={run.strategy.name} on {run.grid.pr}x{run.grid.pc} draws random numbers "
            f"per rank, not one process's: {shown}; strategy=data draws them as one process "
            f"does (or set these rates to 0)"]


def validate_parts(cfg: DictConfig | Mapping[str, Any], world_size: int | None = None
                   ) -> tuple[RunConfig, CheckedParts]:
    """The run `cfg` describes and its parts as validation built them (for the machine's
    checks, `runner.cli.preflight`, which then build nothing again), or `ConfigError` naming
    every problem.

    `world_size` is the size of the MPI job the run will use when that is already fixed (the user
    started `mpiexec -n N python -m runner ...`): the grid must match it.
    """
    from runner.training.assembly import check_parts

    run, problems = parse_with_problems(cfg)
    problems += _range_problems(run, world_size)
    parts = check_parts(run)
    problems += parts.problems
    problems += _cross_part_problems(run, parts, grid_ok=run.grid.pr >= 1 and run.grid.pc >= 1)
    if run.model.weights is not None and parts.model is not None:
        from runner.weights.load import weights_problems

        problems += weights_problems(run.model.weights, parts.model)
    if problems:
        raise ConfigError(problems)
    return run, parts


def validate(cfg: DictConfig | Mapping[str, Any], world_size: int | None = None) -> RunConfig:
    """The run `cfg` describes, or `ConfigError` naming every problem (`validate_parts`)."""
    return validate_parts(cfg, world_size)[0]
