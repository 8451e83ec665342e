"""The run configuration as typed values, validated before any process starts.

`validate()` takes the composed config (a DictConfig from Hydra, or the `config.yaml` a worker
reads) and returns a frozen `RunConfig`, or raises `ConfigError` naming *every* offending value.
Nothing here imports Hydra.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.core import GridShape
from runner.core.registry import UnknownPluginError, accepted_options, unknown_options

DTYPES = ("float32", "float64")  # float64: to check a strategy's mathematics beyond rounding


class ConfigError(ValueError):
    """A configuration that cannot run; `problems` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Plugin:
    """A config group selection: the registered `name` and the plugin's keyword options."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainerConfig:
    steps: int
    batch_size: int
    log_every: int = 1
    eval_every: int | None = None
    checkpoint_every: int | None = None
    resume: str | None = None  # None, "auto" or a checkpoint directory
    threads: int | None = None
    dtype: str = "float32"
    comm_timeout_s: float | None = None  # the watchdog: a collective that takes longer ends the job
    keep_checkpoints: int | None = 3  # the newest complete ones; None: keep all


FAILURE_MODES = ("raise", "kill", "hang", "nan")
LOGGERS = ("none", "tensorboard")


@dataclass(frozen=True)
class LauncherConfig:
    """How P > 1 ranks are started when the runner is not already inside an MPI job."""

    command: tuple[str, ...] = ()  # empty: the mpiexec of the bundled MPICH
    nproc_flag: str = "-n"
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class DebugConfig:
    """For tests and measurements: make one rank fail at one step; time collectives alone."""

    fail_at_step: int | None = None
    fail_on_rank: int = 0
    # raise: an exception; kill: SIGKILL itself; hang: sleep forever outside any collective;
    # nan: its loss becomes NaN (a diverged run)
    fail_mode: str = "raise"
    isolate_comm: bool = False  # time each collective alone (barrier first, no overlap)
    slow_rank: int | None = None  # this rank sleeps slow_seconds in every step (a straggler)
    slow_seconds: float = 0.0


@dataclass(frozen=True)
class RunConfig:
    seed: int
    grid: GridShape
    trainer: TrainerConfig
    model: Plugin
    dataset: Plugin
    strategy: Plugin
    optimizer: Plugin
    launcher: LauncherConfig
    debug: DebugConfig
    logger: str = "none"  # also write metrics to TensorBoard: "tensorboard"


def _plugin(cfg: DictConfig, key: str, problems: list[str]) -> Plugin:
    node = cfg.get(key)
    if not isinstance(node, Mapping) or "name" not in node:
        problems.append(f"{key}: missing (choose one with {key}=NAME)")
        return Plugin("")
    options = {k: v for k, v in node.items() if k != "name"}
    return Plugin(str(node["name"]), options)


def _int(cfg: DictConfig, key: str, problems: list[str], minimum: int | None = 1,
         optional: bool = False) -> int | None:
    value = OmegaConf.select(cfg, key)
    if value is None:
        if not optional:
            problems.append(f"{key}: required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{key}={value!r}: must be an integer")
        return None
    if minimum is not None and value < minimum:
        problems.append(f"{key}={value}: must be >= {minimum}")
        return None
    return value


def _strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(value.split())
    return tuple(str(v) for v in value)


def _check_options(key: str, factory: Any, options: Mapping[str, Any], reserved: tuple[str, ...],
                   problems: list[str]) -> None:
    bad = unknown_options(factory, options, reserved)
    if bad:
        valid = ", ".join(accepted_options(factory, reserved)) or "none"
        problems.append(f"{key}: unknown option(s) {', '.join(f'{key}.{b}' for b in bad)}; "
                        f"valid: {valid}")


def validate(cfg: DictConfig, world_size: int | None = None) -> RunConfig:
    """Check everything that can be checked without starting a process; raise `ConfigError`.

    `world_size` is the size of the MPI job the run will use when that is already fixed (the user
    started `mpiexec -n N python -m runner ...`): the grid must match it.
    """
    from runner.registry import DATASETS, MODELS, OPTIMIZERS, load_plugins
    from strategies import STRATEGIES

    load_plugins()
    cfg = copy.deepcopy(cfg)  # resolving below must not change the caller's config
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"missing required value: {', '.join(missing)}"])
    try:
        OmegaConf.resolve(cfg)
    except Exception as exc:  # interpolation errors name the key themselves
        raise ConfigError([f"cannot resolve config: {exc}".splitlines()[0]]) from None

    problems: list[str] = []
    seed = _int(cfg, "seed", problems, minimum=0)
    pr = _int(cfg, "grid.pr", problems)
    pc = _int(cfg, "grid.pc", problems)
    steps = _int(cfg, "trainer.steps", problems)
    batch = _int(cfg, "trainer.batch_size", problems)
    log_every = _int(cfg, "trainer.log_every", problems, optional=True) or 1
    eval_every = _int(cfg, "trainer.eval_every", problems, optional=True)
    checkpoint_every = _int(cfg, "trainer.checkpoint_every", problems, optional=True)
    threads = _int(cfg, "trainer.threads", problems, optional=True)
    dtype = str(OmegaConf.select(cfg, "trainer.dtype", default="float32"))
    if dtype not in DTYPES:
        problems.append(f"trainer.dtype={dtype}: must be one of {', '.join(DTYPES)}")
    keep_checkpoints = _int(cfg, "trainer.keep_checkpoints", problems, optional=True)
    resume = OmegaConf.select(cfg, "trainer.resume")
    if resume is not None and (not isinstance(resume, str) or not resume):
        problems.append(f"trainer.resume={resume!r}: must be null, auto or a checkpoint path")
    elif resume not in (None, "auto"):
        from runner.checkpoint import CheckpointError, resolve_resume

        try:  # a path names a checkpoint directory, or a run directory with checkpoints
            resolve_resume(resume, None)
        except CheckpointError as exc:
            problems.append(str(exc))
    comm_timeout = OmegaConf.select(cfg, "trainer.comm_timeout_s")
    if comm_timeout is not None and (isinstance(comm_timeout, bool)
                                     or not isinstance(comm_timeout, (int, float))
                                     or comm_timeout <= 0):
        problems.append(f"trainer.comm_timeout_s={comm_timeout!r}: must be null or a number of "
                        f"seconds > 0")
        comm_timeout = None
    logger = str(OmegaConf.select(cfg, "logger.name", default="none"))
    if logger not in LOGGERS:
        problems.append(f"logger={logger}: must be one of {', '.join(LOGGERS)}")
    elif logger == "tensorboard":
        from runner.board import tensorboard_missing

        problems += filter(None, [tensorboard_missing()])
    model, dataset = _plugin(cfg, "model", problems), _plugin(cfg, "dataset", problems)
    strategy, optimizer = _plugin(cfg, "strategy", problems), _plugin(cfg, "optimizer", problems)

    launcher_cfg = OmegaConf.select(cfg, "launcher") or {}
    launcher = LauncherConfig(command=_strings(launcher_cfg.get("command")),
                              nproc_flag=str(launcher_cfg.get("nproc_flag", "-n")),
                              args=_strings(launcher_cfg.get("args")))
    fail_at = _int(cfg, "debug.fail_at_step", problems, optional=True)
    fail_on = _int(cfg, "debug.fail_on_rank", problems, minimum=0, optional=True) or 0
    fail_mode = str(OmegaConf.select(cfg, "debug.fail_mode", default="raise"))
    if fail_mode not in FAILURE_MODES:
        problems.append(f"debug.fail_mode={fail_mode}: must be one of {', '.join(FAILURE_MODES)}")
    grid = GridShape(pr, pc) if pr and pc else None
    if grid and world_size is not None and grid.size != world_size:
        problems.append(f"grid.pr*grid.pc={grid.size} but the MPI job has {world_size} ranks "
                        f"(set grid.pr and grid.pc so that their product is {world_size})")
    if grid and fail_at is not None and fail_on >= grid.size:
        problems.append(f"debug.fail_on_rank={fail_on} is not a rank of a {grid.size}-rank job")
    slow_rank = _int(cfg, "debug.slow_rank", problems, minimum=0, optional=True)
    slow_seconds = OmegaConf.select(cfg, "debug.slow_seconds", default=0.0) or 0.0
    if not isinstance(slow_seconds, (int, float)) or slow_seconds < 0:
        problems.append(f"debug.slow_seconds must be a number >= 0, got {slow_seconds}")
    if grid and slow_rank is not None and slow_rank >= grid.size:
        problems.append(f"debug.slow_rank={slow_rank} is not a rank of a {grid.size}-rank job")

    # Plugins: known names, known options, and what each can say about the others.
    spec = meta_model = None
    if dataset.name:
        try:
            dataset_cls = DATASETS.get(dataset.name)
            _check_options("dataset", dataset_cls, dataset.options, (), problems)
            spec = dataset_cls(**dataset.options).spec()
        except UnknownPluginError as exc:
            problems.append(f"dataset={dataset.name}: {exc}")
        except (TypeError, ValueError) as exc:
            problems.append(f"dataset={dataset.name}: {exc}")
    if model.name:
        try:
            factory = MODELS.get(model.name)
            _check_options("model", factory, model.options,
                           ("input_shape", "num_classes", "vocab_size", "padding_idx"), problems)
            if spec is not None:
                meta_model = _check_model_shapes(model, factory, spec, problems)
        except UnknownPluginError as exc:
            problems.append(f"model={model.name}: {exc}")
    if optimizer.name:
        try:
            opt_cls = OPTIMIZERS.get(optimizer.name)
            reserved = ("model", "grid", "total_steps")
            before = len(problems)
            _check_options("optimizer", opt_cls, optimizer.options, reserved, problems)
            if len(problems) == before:
                problems += opt_cls.check(**optimizer.options)
        except UnknownPluginError as exc:
            problems.append(f"optimizer={optimizer.name}: {exc}")
    if strategy.name:
        try:
            strategy_cls = STRATEGIES.get(strategy.name)
            before = len(problems)
            _check_options("strategy", strategy_cls, strategy.options, (), problems)
            if len(problems) == before:
                instance = strategy_cls(**strategy.options)
                if grid and batch:
                    problems += instance.check(grid, batch)
                if meta_model is not None and spec is not None and grid:
                    problems += instance.check_model(meta_model, spec.input_shape, grid)
        except UnknownPluginError as exc:
            problems.append(f"strategy={strategy.name}: {exc}")
    if spec is not None and batch and batch > spec.train_size:
        problems.append(f"trainer.batch_size={batch} is larger than the {spec.train_size} "
                        f"training samples of dataset={dataset.name}")
    if problems:
        raise ConfigError(problems)
    assert seed is not None and grid and steps and batch
    return RunConfig(
        seed=seed, grid=grid,
        trainer=TrainerConfig(steps, batch, log_every, eval_every, checkpoint_every,
                              None if resume is None else str(resume), threads, dtype,
                              None if comm_timeout is None else float(comm_timeout),
                              keep_checkpoints),
        model=model, dataset=dataset, strategy=strategy, optimizer=optimizer,
        launcher=launcher,
        debug=DebugConfig(fail_at, fail_on, fail_mode,
                          bool(OmegaConf.select(cfg, "debug.isolate_comm", default=False)),
                          slow_rank, float(slow_seconds)),
        logger=logger,
    )


def _check_model_shapes(model: Plugin, factory: Any, spec: Any, problems: list[str]) -> Any:
    """Build the model on the meta device and push a batch through: no memory, no compute.
    Returns the meta model (for the strategy's own checks), or None when it does not fit."""
    import torch

    from runner.models import dataset_arguments

    try:
        extra = dataset_arguments(factory, spec)
    except ValueError as exc:
        problems.append(f"model={model.name}: {exc}")
        return None
    dtype = torch.long if spec.vocab_size is not None else torch.float32
    try:
        with torch.device("meta"):
            net = factory(spec.input_shape, spec.num_classes, **extra, **model.options)
            out = net(torch.zeros(2, *spec.input_shape, dtype=dtype))
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problems.append(f"model={model.name} does not fit the dataset's inputs of shape "
                        f"{tuple(spec.input_shape)}: {first}")
        return None
    if tuple(out.shape) != (2, spec.num_classes):
        problems.append(f"model={model.name} gives outputs of shape {tuple(out.shape[1:])}, "
                        f"the dataset has {spec.num_classes} classes")
        return None
    return net

