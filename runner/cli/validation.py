"""Everything about a config that can be checked before any process starts, once per run.

`validate()` parses the composed config (`runner.config.schema.parse`: unknown keys, wrong types)
and then checks what the schema alone cannot: values in range, the grid against the MPI job, the
plugins (known names, their options typed by their signatures, what each says of the others), and
the model against the dataset on shapes alone. Every problem is named; the caller prints them on
one line. The ranks do not repeat any of this: they trust the `config.yaml` the head wrote.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig

from runner.config.options import option_problems, with_defaults
from runner.config.schema import (
    COMM_BACKENDS,
    CUDA_AWARE,
    DEVICES,
    DTYPES,
    FAILURE_MODES,
    LOGGERS,
    OBJECTIVES,
    PRECISIONS,
    ConfigError,
    Plugin,
    RunConfig,
    parse_with_problems,
)
from runner.core.registry import UnknownPluginError

MIN_COMM_TIMEOUT_S = 1.0
MAX_COMM_TIMEOUT_S = 365 * 86400.0
MAX_SLOW_SECONDS = 86400.0


def device_problems(run: RunConfig) -> list[str]:
    """trainer.device, trainer.precision and comm.cuda_aware; a GPU asked for where torch sees
    none is refused here, before any rank starts (the head runs where the ranks do)."""
    trainer, problems = run.trainer, []
    if trainer.device not in DEVICES:
        problems.append(f"trainer.device={trainer.device}: must be one of {', '.join(DEVICES)}")
    elif trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if not torch.backends.cuda.is_built()
                   else "torch sees no GPU here")
            problems.append(f"trainer.device=cuda: {why} (torch {torch.__version__}); use "
                            f"trainer.device=cpu, or auto")
    if trainer.precision not in PRECISIONS:
        problems.append(f"trainer.precision={trainer.precision}: must be one of "
                        f"{', '.join(PRECISIONS)}")
    elif trainer.precision != "fp32" and trainer.dtype != "float32":
        problems.append(f"trainer.precision={trainer.precision} with trainer.dtype="
                        f"{trainer.dtype}: mixed precision keeps float32 parameters; use "
                        f"trainer.dtype=float32")
    if str(run.comm.cuda_aware).lower() not in CUDA_AWARE:
        problems.append(f"comm.cuda_aware={run.comm.cuda_aware}: must be one of "
                        f"{', '.join(CUDA_AWARE)}")
    return problems


MAX_THREADS = 4096


def _lr_problems(run: RunConfig) -> list[str]:
    """A learning rate the parameters' float type cannot hold: the first update overflows."""
    import torch

    lr = run.optimizer.options.get("lr")
    if run.trainer.dtype not in DTYPES or not isinstance(lr, (int, float)) or isinstance(
            lr, bool) or not math.isfinite(lr):
        return []
    largest = torch.finfo(getattr(torch, run.trainer.dtype)).max
    if abs(lr) > largest:
        return [f"optimizer.lr={lr:g}: larger than a {run.trainer.dtype} step can hold "
                f"({largest:.3g})"]
    return []


def _range_problems(run: RunConfig, world_size: int | None) -> list[str]:
    problems: list[str] = []
    trainer, debug, grid = run.trainer, run.debug, run.grid

    def at_least(key: str, value: int | None, minimum: int) -> None:
        if value is not None and value < minimum:
            problems.append(f"{key}={value}: must be >= {minimum}")

    at_least("seed", run.seed, 0)
    at_least("grid.pr", grid.pr, 1)
    at_least("grid.pc", grid.pc, 1)
    at_least("trainer.steps", trainer.steps, 1)
    at_least("trainer.batch_size", trainer.batch_size, 1)
    at_least("trainer.log_every", trainer.log_every, 1)
    at_least("trainer.eval_every", trainer.eval_every, 1)
    at_least("trainer.eval_samples", trainer.eval_samples, 1)
    at_least("trainer.checkpoint_every", trainer.checkpoint_every, 1)
    at_least("trainer.keep_checkpoints", trainer.keep_checkpoints, 1)
    at_least("trainer.threads", trainer.threads, 1)
    at_least("debug.fail_at_step", debug.fail_at_step, 1)
    at_least("debug.fail_on_rank", debug.fail_on_rank, 0)
    at_least("debug.slow_rank", debug.slow_rank, 0)
    if trainer.dtype not in DTYPES:
        problems.append(f"trainer.dtype={trainer.dtype}: must be one of {', '.join(DTYPES)}")
    if trainer.threads is not None and trainer.threads > MAX_THREADS:
        problems.append(f"trainer.threads={trainer.threads}: more torch threads per rank than "
                        f"any node has cores (at most {MAX_THREADS}; null: the node's cores / "
                        f"its ranks)")
    problems += _lr_problems(run)
    problems += device_problems(run)
    if trainer.resume is not None and not trainer.resume:
        problems.append("trainer.resume='': must be null, auto or a checkpoint path")
    elif trainer.resume not in (None, "auto"):
        from runner.checkpoint.store import CheckpointError, resolve_resume

        try:  # a path names a checkpoint directory, or a run directory with checkpoints
            resolve_resume(trainer.resume, None)
        except CheckpointError as exc:
            problems.append(str(exc))
    timeout = trainer.comm_timeout_s
    if timeout is not None and not MIN_COMM_TIMEOUT_S <= timeout <= MAX_COMM_TIMEOUT_S:
        # Below a second, any collective waits longer than that now and then; past a year it
        # overflows the torch backend's own timeout: null is the way to wait for ever.
        problems.append(f"trainer.comm_timeout_s={timeout:g}: must be null (wait for ever) or "
                        f"from {MIN_COMM_TIMEOUT_S:g} to {MAX_COMM_TIMEOUT_S:.0f} seconds (a "
                        f"year)")
    if run.comm.backend not in COMM_BACKENDS:
        problems.append(f"comm.backend={run.comm.backend}: must be one of "
                        f"{', '.join(COMM_BACKENDS)}")
    if run.objective not in OBJECTIVES:
        problems.append(f"objective={run.objective}: must be one of {', '.join(OBJECTIVES)}")
    if run.logger not in LOGGERS:
        problems.append(f"logger={run.logger}: must be one of {', '.join(LOGGERS)}")
    elif run.logger == "tensorboard":
        from runner.records.board import tensorboard_missing

        problems += filter(None, [tensorboard_missing()])
    if debug.fail_mode not in FAILURE_MODES:
        problems.append(f"debug.fail_mode={debug.fail_mode}: must be one of "
                        f"{', '.join(FAILURE_MODES)}")
    if debug.slow_seconds < 0:
        problems.append(f"debug.slow_seconds must be a number >= 0, got {debug.slow_seconds}")
    elif debug.slow_seconds > MAX_SLOW_SECONDS:  # a sleep that long overflows, or never ends
        problems.append(f"debug.slow_seconds={debug.slow_seconds:g}: must be at most "
                        f"{MAX_SLOW_SECONDS:g} (a day)")
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


def _plugin_problems(run: RunConfig, grid_ok: bool) -> list[str]:
    """Known names, options that fit the plugins' signatures, and what each plugin can say
    about the others (the model on the dataset's shapes, the strategy on the model)."""
    from runner.config.registry import (
        DATASETS,
        UserCodeError,
        import_modules,
        load_plugins,
        resolve,
    )
    from runner.training import assembly
    from strategies import STRATEGIES, PricingContext, Strategy

    problems: list[str] = []
    try:
        import_modules(run.plugins)
    except UserCodeError as exc:
        problems.append(str(exc))
    load_plugins()

    def lookup(key: str, find: Callable[[Plugin], Any], plugin: Plugin) -> Any:
        try:
            return find(plugin)
        except UnknownPluginError as exc:
            problems.append(f"{plugin.shown(key)}: {exc}")
        except UserCodeError as exc:
            problems.append(f"{plugin.shown(key)}: {exc}")
        return None

    # the registered class, or the user's own function (what the options are arguments of)
    dataset_cls = lookup("dataset", lambda p: resolve(DATASETS, p.name, p.target), run.dataset)
    factory = lookup("model", assembly.model_factory, run.model)
    optimizer_cls = lookup("optimizer", assembly.optimizer_class, run.optimizer)
    strategy_cls = lookup("strategy", lambda p: STRATEGIES.get(p.name), run.strategy)

    spec = meta_model = None
    if dataset_cls is not None:
        found = _options_problems("dataset", run.dataset, dataset_cls)
        problems += found
        if not found:
            try:
                dataset = assembly.build_dataset(run.dataset, assembly.objective_of(run.model))
                spec = dataset.spec()
                check = getattr(dataset, "check", None)  # a user's data: checked here, once
                if check is not None:
                    check()
            except (TypeError, ValueError) as exc:
                spec = None
                problems.append(f"{run.dataset.shown('dataset')}: {exc}")
    if factory is not None:
        found = _options_problems("model", run.model, factory, assembly.MODEL_INPUTS)
        problems += found
        if not found and spec is not None:
            meta_model = _check_model_shapes(run.model, spec, problems)
    if optimizer_cls is not None:
        found = _options_problems("optimizer", run.optimizer, optimizer_cls,
                                  assembly.OPTIMIZER_INPUTS)
        if not found:
            options = with_defaults(optimizer_cls, run.optimizer.options,
                                    assembly.OPTIMIZER_INPUTS)
            found = optimizer_cls.check(**options)
            if not found and grid_ok:
                found = optimizer_cls.grid_problems(options, run.grid.pr, run.grid.pc)
        problems += found
    if strategy_cls is not None:
        found = option_problems("strategy", strategy_cls, run.strategy.options,
                                Strategy.CONTEXT_ARGUMENTS)
        problems += found
        if not found:
            strategy = assembly.build_strategy(
                run.strategy, PricingContext(global_batch=run.trainer.batch_size))
            batch = run.trainer.batch_size
            if grid_ok and batch >= 1:
                problems += strategy.check(run.grid, batch)
            if meta_model is not None and spec is not None and grid_ok:
                found = strategy.check_model(meta_model, spec.input_shape, run.grid)
                if not found and optimizer_cls is not None and optimizer_cls.syncs_gradients:
                    found = _random_draw_problems(run, strategy, meta_model, spec.input_shape)
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
                    f"grid.pr={run.grid.pr} ranks; use strategy=data (or grid.pr=1) or an "
                    f"element-wise optimizer (sgd, adam, adamw, torch.optim.RMSprop, ...)")
    if spec is not None and run.trainer.batch_size > spec.train_size:
        problems.append(f"trainer.batch_size={run.trainer.batch_size} is larger than the "
                        f"{spec.train_size} training samples of dataset={run.dataset.name}")
    return problems


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


def _options_problems(key: str, plugin: Plugin, factory: Any,
                      reserved: tuple[str, ...] = ()) -> list[str]:
    """`option_problems`, also for a user's callable whose signature cannot be read."""
    label = plugin.shown(key) if plugin.target else key
    try:
        return option_problems(key, factory, plugin.options, reserved, label)
    except (TypeError, ValueError):
        return []  # no signature (a builtin): its own call will say what is wrong


def _options_shown(plugin: Plugin) -> str:
    return f"model options: {', '.join(f'{k}={v}' for k, v in plugin.options.items())}"


def _check_model_shapes(plugin: Plugin, spec: Any, problems: list[str]) -> Any:
    """Build the model (`assembly.probe_model`: on the CPU when small, on the meta device when
    large) and push two samples through it. Returns it (for the strategy's own checks), or None
    when it does not fit the dataset."""
    import torch

    from runner.training import assembly

    try:
        net = assembly.probe_model(plugin, spec)
    except ValueError as exc:  # the dataset's inputs are not what the model reads
        problems.append(f"{plugin.shown('model')}: {exc}")
        return None
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "negative dimension" in first:  # torch's words for a width below 0
            problems.append(f"{plugin.shown('model')}: every width and channel count must be "
                            f">= 1 ({_options_shown(plugin)})")
        else:
            problems.append(f"{plugin.shown('model')} cannot be built for the dataset's inputs "
                            f"of shape {tuple(spec.input_shape)}: {first}")
        return None
    empty = [(name, tuple(p.shape)) for name, p in net.named_parameters() if p.numel() == 0]
    if empty:
        name, shape = empty[0]
        layer = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
        problems.append(f"{plugin.shown('model')}: {name} ({type(layer).__name__}) would have "
                        f"shape {shape}: every width and channel count must be >= 1 "
                        f"({_options_shown(plugin)})")
        return None
    dtype = torch.long if spec.vocab_size is not None else torch.float32
    device = next((p.device for p in net.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *spec.input_shape, dtype=dtype, device=device))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problems.append(f"{plugin.shown('model')} does not fit the dataset's inputs of shape "
                        f"{tuple(spec.input_shape)}: {first}")
        return None
    from strategies.probe import logits_of

    try:
        out = logits_of(out)
    except TypeError as exc:
        problems.append(f"{plugin.shown('model')}: {exc}")
        return None
    expected = (2, *spec.target_shape, spec.num_classes)
    if tuple(out.shape) != expected:
        what = (f"the dataset has {spec.num_classes} classes" if not spec.target_shape else
                f"next-token targets need logits of shape {expected[1:]} (a score per "
                f"position and token id)")
        problems.append(f"{plugin.shown('model')} gives outputs of shape {tuple(out.shape[1:])}, "
                        f"{what}")
        return None
    return net


def validate(cfg: DictConfig | Mapping[str, Any], world_size: int | None = None) -> RunConfig:
    """The run `cfg` describes, or `ConfigError` naming every problem.

    `world_size` is the size of the MPI job the run will use when that is already fixed (the user
    started `mpiexec -n N python -m runner ...`): the grid must match it.
    """
    run, problems = parse_with_problems(cfg)
    problems += _range_problems(run, world_size)
    grid_ok = run.grid.pr >= 1 and run.grid.pc >= 1
    problems += _plugin_problems(run, grid_ok)
    if problems:
        raise ConfigError(problems)
    return run
