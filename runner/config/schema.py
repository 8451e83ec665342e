"""The run configuration: one schema, in one place.

Every key of the engine's own sections has its type, default and documentation here, in a
dataclass per section (the docstring under a field documents it). The entry points register these
dataclasses in Hydra's ConfigStore (`runner.cli.compose`), so `conf/` holds only the plugin groups
(model, dataset, strategy, optimizer, experiment) and the root's defaults list. A plugin's own
options are typed by its constructor's signature (`runner.config.options`).

`parse()` turns a composed config (Hydra's, or a run directory's `config.yaml`) into a frozen
`RunConfig`, naming every unknown key and wrong type at once; the cross-field and plugin checks
are `runner.cli.validation`'s. Nothing here imports Hydra or torch.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, OmegaConf

from runner.config.options import type_problem

if TYPE_CHECKING:  # imported when parsing: `--help` and `--cfg` need no torch
    from runner.core.grid import GridShape

DTYPES = ("float32", "float64")  # float64: to check a strategy's mathematics beyond rounding
FAILURE_MODES = ("raise", "kill", "hang", "nan")
LOGGERS = ("none", "tensorboard")
COMM_BACKENDS = ("mpi", "torch")
DEVICES = ("cpu", "cuda", "auto")
PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("none", "blocks", "model")  # trainer.compile (`strategies.compiled`)
CUDA_AWARE = ("auto", "true", "false")
PLUGIN_GROUPS = ("model", "dataset", "strategy", "optimizer")
# What a run's task returns to a Hydra sweeper (Optuna...): a summary key, and its direction.
OBJECTIVES = {"val_loss": "minimize", "val_accuracy": "maximize", "final_loss": "minimize",
              "workers_val_loss": "minimize", "workers_val_accuracy": "maximize",
              "wall_time_s": "minimize", "median_step_time_s": "minimize",
              "samples_per_s": "maximize"}
TARGET_KEY = "_target_"

# The bounds of keys whose range is not a plain "at least".
MIN_COMM_TIMEOUT_S = 1.0
MAX_COMM_TIMEOUT_S = 365 * 86400.0
MAX_SLOW_SECONDS = 86400.0
MAX_THREADS = 4096

# OmegaConf reads these annotations at run time: the typing spellings it understands
# (`Optional[int]`, not `int | None`), hence the UP007 exemptions below. It refuses `Literal`
# in a structured config, so a choice key is a `str` whose choices sit in its field's metadata
# (`one_of`), as a range sits in a number's (`at_least`, `within`): declared with the key, and
# checked for every key alike by `_section`.


def one_of(choices: tuple[str, ...], default: str, fold_case: bool = False) -> Any:
    """A key that takes one of `choices` (`fold_case`: in any case, for true/false words, which
    the command line hands over as booleans and OmegaConf turns into `True`/`False`)."""
    return field(default=default, metadata={"choices": choices, "fold_case": fold_case})


def at_least(minimum: float, default: Any) -> Any:
    """A number key that must be at least `minimum` (null passes where the type allows it)."""
    return field(default=default, metadata={"minimum": minimum})


def within(minimum: float, maximum: float, default: Any, why: str) -> Any:
    """A number key from `minimum` to `maximum`; `why` says where the bounds come from."""
    return field(default=default, metadata={"minimum": minimum, "maximum": maximum, "why": why})


def _number(value: float) -> str:
    return f"{value:.15g}" if isinstance(value, float) else str(value)


def declared_problem(key: str, value: Any, metadata: Mapping[str, Any]) -> str | None:
    """`key=value: must be …` where a well-typed value is outside what its field declares."""
    choices = metadata.get("choices")
    if choices is not None and (str(value).lower() if metadata["fold_case"] else value
                                ) not in choices:
        return f"{key}={value}: must be one of {', '.join(choices)}"
    if value is None or "minimum" not in metadata:
        return None
    low, high = metadata["minimum"], metadata.get("maximum")
    if high is None and value < low:
        return f"{key}={_number(value)}: must be >= {_number(low)}"
    if high is not None and not low <= value <= high:
        return (f"{key}={_number(value)}: must be from {_number(low)} to {_number(high)} "
                f"({metadata['why']})")
    return None


class ConfigError(ValueError):
    """A configuration that cannot run; `problems` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass
class GridConfig:
    """The process grid `pr × pc`."""

    pr: int = at_least(1, 2)
    """Ranks that split the model (or each sample's domain): the size of a model group."""
    pc: int = at_least(1, 2)
    """Ranks that split the batch: the number of batch replicas."""


@dataclass
class TrainerConfig:
    """The training loop."""

    steps: int = at_least(1, 300)
    """Training steps (global batches)."""
    batch_size: int = at_least(1, 64)
    """The global batch: the same whatever the number of ranks."""
    log_every: int = at_least(1, 1)
    """A metrics.jsonl line every N steps."""
    eval_every: Optional[int] = at_least(1, 100)  # noqa: UP045
    """Validation loss and accuracy every N steps (null: only at the end)."""
    eval_samples: Optional[int] = at_least(1, None)  # noqa: UP045
    """Validate on the first N samples of the validation set (null: all of it)."""
    checkpoint_every: Optional[int] = at_least(1, None)  # noqa: UP045
    """A sharded checkpoint every N steps, and at the end (null: none, but the one at the end
    of a run started from model.weights or with trainer.export)."""
    export: bool = False
    """At the end, the trained model as safetensors in RUN_DIR/export (a transformers
    directory for a transformers model), as `python -m runner.export` writes it; a checkpoint
    is written at the end for it."""
    keep_checkpoints: Optional[int] = at_least(1, 3)  # noqa: UP045
    """The newest complete checkpoints kept (null: all)."""
    resume: Optional[str] = None  # noqa: UP045
    """null, auto (this run directory's latest checkpoint), or a checkpoint or run directory."""
    comm_timeout_s: Optional[float] = within(  # noqa: UP045
        MIN_COMM_TIMEOUT_S, MAX_COMM_TIMEOUT_S, 300.0,
        "null waits for ever; under a second any collective waits longer now and then, past a "
        "year the torch backend's own timeout overflows")
    """The most seconds a collective may wait before it ends the job (null: wait for ever; 1 s
    to a year). Inside training steps, once three have been timed, the deadline is shorter:
    max(30 s, 5 × the slowest step so far), so at the default a hung rank ends the job within
    a minute while no step has taken over 10 s. Start-up, the first steps, evaluation,
    checkpoints and the first step after each of these get this whole cap."""
    threads: Optional[int] = within(  # noqa: UP045
        1, MAX_THREADS, None, "no node has more cores; null: the node's cores / its ranks")
    """torch threads per rank (null: the node's cores / its ranks)."""
    dtype: str = one_of(DTYPES, "float32")
    """float32, or float64 to check a strategy against one process beyond float32 rounding."""
    device: str = one_of(DEVICES, "cpu")
    """cpu; cuda (rank r uses GPU `local rank % GPUs on its node`; model, batches and the whole
    step live there); auto (cuda where torch sees a GPU, else cpu)."""
    precision: str = one_of(PRECISIONS, "fp32")
    """fp32; bf16 or fp16: the forward and the loss under autocast (the parameters, their
    gradients and the optimizer stay float32), floating inputs stored in that dtype; fp16 with
    dynamic loss scaling (a step whose gradients overflow is skipped on every rank)."""
    accumulate_steps: int = at_least(1, 1)
    """Micro-batches per step: each rank's rows of the global batch run as N equal consecutive
    pieces, their gradients summed locally and exchanged once, after the last (the batch per
    rank must divide by N; BatchNorm with batch statistics is refused)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward instead of keeping them: none; units (the children of
    the model's largest nn.ModuleList, its repeated blocks); or a glob over the model's
    named_modules() (e.g. 'blocks.*', '2')."""
    compile: str = one_of(COMPILE_MODES, "none")
    """torch.compile, after the strategy has split the model, with every collective outside
    the graphs: none; blocks (each of the model's repeated blocks, fsdp's strategy.units); model
    (the whole model). A module that cannot be one graph (a collective or a graph break inside)
    runs eagerly and its children are compiled instead; the summary's `compile` names them."""
    compile_cache: Optional[str] = None  # noqa: UP045
    """Where compiled graphs are cached, reused by later runs, resumed ones and every rank
    (null: $GRIDRUN_CACHE/compile, else ~/.cache/gridrun/compile)."""


@dataclass
class SlurmConfig:
    """A run as a Slurm batch job (`launcher=slurm`): grid.pr × grid.pc tasks, one rank each,
    started by srun inside the job; these options add to that."""

    partition: Optional[str] = None  # noqa: UP045
    """The partition (sbatch --partition; null: the cluster's default)."""
    account: Optional[str] = None  # noqa: UP045
    """The account the job is charged to (sbatch --account; null: the user's default)."""
    qos: Optional[str] = None  # noqa: UP045
    """The quality of service (sbatch --qos; null: the default)."""
    time: Optional[str] = None  # noqa: UP045
    """The time limit in Slurm's format: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
    (sbatch --time; null: the partition's default)."""
    nodes: Optional[int] = at_least(1, None)  # noqa: UP045
    """Nodes (sbatch --nodes; null: as many as Slurm places the tasks on)."""
    ntasks_per_node: Optional[int] = at_least(1, None)  # noqa: UP045
    """Ranks per node (sbatch --ntasks-per-node; null: as Slurm places them)."""
    cpus_per_task: Optional[int] = at_least(1, None)  # noqa: UP045
    """CPUs per rank (sbatch --cpus-per-task; null: trainer.threads where set, else 1)."""
    gpus_per_task: Optional[int] = at_least(0, None)  # noqa: UP045
    """GPUs per rank (sbatch --gpus-per-task; null: 1 under trainer.device=cuda, else none)."""
    overcommit: bool = False
    """More ranks than CPUs (sbatch --overcommit: one CPU per node, shared by its ranks);
    without it a job that needs more CPUs than its partition has is refused."""
    extra: list[str] = field(default_factory=list)
    """More sbatch options, an #SBATCH line each, after gridrun's own (so they override them):
    e.g. [--mem=16G, --constraint=a100]."""
    signal_s: int = within(1, 65535, 60, "the range of Slurm's --signal")
    """Seconds before the time limit at which Slurm warns the job (SIGUSR1 to the batch script):
    the ranks stop at a step's end with a checkpoint, and the job requeues itself to go on from
    it."""
    poll_s: float = within(0.1, 3600.0, 5.0, "a tenth of a second to an hour")
    """Seconds between the head's questions to Slurm about the job's state while it waits."""
    dry_run: bool = False
    """Print the batch script and the sbatch command, and submit nothing."""
    mpi: str = "pmi2"
    """srun's --mpi: how the ranks' MPI meets Slurm (pmi2 for MPICH, the bundled one; pmix for
    many site builds)."""


@dataclass
class LauncherConfig:
    """How P > 1 ranks are started when the runner is not already inside an MPI job."""

    command: Optional[str] = None  # noqa: UP045
    """The launcher, with its own arguments (null: the mpiexec of the bundled MPICH)."""
    nproc_flag: str = "-n"
    """The launcher's flag for the number of ranks."""
    args: list[str] = field(default_factory=list)
    """Extra launcher arguments, before the program."""
    slurm: Optional[SlurmConfig] = None  # noqa: UP045
    """A Slurm batch job instead (launcher=slurm sets it, with its options; null: the ranks
    start from this process, by command)."""

    @property
    def argv(self) -> list[str]:
        """The launcher command as words (empty: the bundled mpiexec)."""
        return shlex.split(self.command) if self.command else []


@dataclass
class CommConfig:
    """How the ranks communicate."""

    backend: str = one_of(COMM_BACKENDS, "mpi")
    """mpi (mpi4py on host buffers), or torch (torch.distributed process groups over the same
    grid, gloo for CPU tensors, bootstrapped from the MPI job). The EASGD family's one-sided
    windows stay on MPI under both."""
    cuda_aware: str = one_of(CUDA_AWARE, "auto", fold_case=True)
    """Under mpi with trainer.device=cuda: true hands GPU buffers to MPI as they are (an MPI
    built with CUDA support); false stages them through pinned host buffers; auto: true only
    when the MPI library says it was built with CUDA."""


@dataclass
class DataConfig:
    """How a rank reads its rows of each batch."""

    workers: int = at_least(0, 1)
    """Threads that read the next steps' rows while a step computes (0: each step reads its
    own rows when it starts; tensors in host memory for a step on the host are read so
    always)."""
    prefetch: int = at_least(1, 2)
    """Steps read ahead: what a rank holds of the data beyond the step it computes."""


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl."""

    name: str = one_of(LOGGERS, "none")
    """none, or tensorboard (event files under <run dir>/tensorboard/)."""


@dataclass
class DebugConfig:
    """For tests and measurements: make one rank fail or straggle; time collectives alone."""

    fail_at_step: Optional[int] = at_least(1, None)  # noqa: UP045
    """Make rank `fail_on_rank` fail at this step (null: never)."""
    fail_on_rank: int = at_least(0, 0)
    """The rank that fails."""
    fail_mode: str = one_of(FAILURE_MODES, "raise")
    """raise (an exception), kill (SIGKILL itself), hang (sleep outside any collective, so the
    others wait in one), nan (its loss becomes NaN)."""
    isolate_comm: bool = False
    """Time each collective alone (a barrier first, no overlap), to check the α–β model."""
    slow_rank: Optional[int] = at_least(0, None)  # noqa: UP045
    """This rank sleeps `slow_seconds` in every step: a straggler (null: none)."""
    slow_seconds: float = within(0, MAX_SLOW_SECONDS, 0.0, "a day at most")
    """How long the straggler sleeps per step."""
    deadline_floor_s: Optional[float] = at_least(0.1, None)  # noqa: UP045
    """The least deadline a collective's is derived down to from the timed steps (null: 30 s):
    lower, a hung rank ends the job sooner (a test of that path)."""
    stage_host_tensors: bool = False
    """Send host tensors through the staging path that GPU tensors take under an MPI without
    CUDA support (copied into pooled host buffers and back): tests that path without a GPU."""


@dataclass
class PlanConfig:
    """The planner: `python -m runner.plan plan.world=16` (README, "Choosing a grid")."""

    world: int = 4
    """Plan every factorisation pr × pc of this many ranks."""
    strategies: list[str] = field(default_factory=lambda: ["data", "model", "grid", "domain",
                                                           "auto", "fsdp"])
    """The strategies compared (auto: per-layer layouts chosen by predicted step time; fsdp:
    at its default stage)."""
    slowdown: float = 1.0
    """How much slower than the calibrated rates a rank computes on the target machine (1: a
    core per rank; 2: two ranks per core)."""
    alpha: Optional[float] = None  # noqa: UP045
    """Seconds per message (null: the calibrated value, else a default)."""
    beta: Optional[float] = None  # noqa: UP045
    """Seconds per byte (null: likewise)."""
    layers: bool = False
    """Also print the per-layer breakdown."""
    out: Optional[str] = None  # noqa: UP045
    """Also write the plan as JSON to this file."""
    calibrate: bool = False
    """Measure this machine's α and β (and local work) instead of planning."""
    calibrate_repeats: int = at_least(1, 20)
    """Repeats of each measured message size (fewer: a quicker, noisier calibration)."""
    memory_per_rank: Optional[float] = None  # noqa: UP045
    """Bytes a rank may hold for the model (e.g. 8e9): for each strategy (and fsdp stage), the
    smallest world up to `world` at which it fits, its fastest grid there and the step time it
    costs (null: no budget)."""


@dataclass
class ConfigSchema:
    """The composed config. The plugin groups hold a registered `name` (or, for model,
    dataset and optimizer, a user's class or function as `_target_`) and its own options."""

    seed: int = at_least(0, 0)
    """Seeds the model's initial weights, the sample order and the synthetic datasets."""
    plugins: list[str] = field(default_factory=list)
    """Modules every rank imports before building the run: where a user's own
    `@register_model`/`@register_dataset`/`@register_optimizer`/`@register_strategy` live."""
    objective: str = one_of(tuple(OBJECTIVES), "val_loss")
    """The summary value the run returns to a Hydra sweeper (Optuna): val_loss, val_accuracy,
    final_loss, workers_val_loss, workers_val_accuracy, wall_time_s, median_step_time_s or
    samples_per_s (the summary records its direction)."""
    grid: GridConfig = field(default_factory=GridConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    model: dict[str, Any] = field(default_factory=dict)
    dataset: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plugin:
    """A config group selection: the registered `name` (or the dotted path of a user's class
    or function, `target`) and the plugin's keyword options; for the model, the file or
    directory of weights it starts from (`model.weights`, not an option of its constructor)."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    target: Optional[str] = None  # noqa: UP045
    weights: Optional[str] = None  # noqa: UP045

    def shown(self, group: str) -> str:
        """How the user chose it: `model=cnn`, or `model._target_=my_pkg.nets.MyNet`."""
        return f"{group}.{TARGET_KEY}={self.target}" if self.target else f"{group}={self.name}"


@dataclass(frozen=True)
class RunConfig:
    """A parsed run: what every rank trains from."""

    seed: int
    grid: GridShape
    trainer: TrainerConfig
    model: Plugin
    dataset: Plugin
    strategy: Plugin
    optimizer: Plugin
    launcher: LauncherConfig
    debug: DebugConfig
    logger: str = "none"
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    plugins: tuple[str, ...] = ()
    objective: str = "val_loss"

    @property
    def checkpoints_at_end(self) -> bool:
        """Whether a completed run writes a checkpoint at its end: with
        `trainer.checkpoint_every`, for `trainer.export`, and for a run started from
        `model.weights` (the trained weights are what a fine-tune is for: export reads them)."""
        trainer = self.trainer
        return bool(trainer.checkpoint_every or trainer.export or self.model.weights is not None)


def _section(key: str, schema: type[Any], value: Any, problems: list[str]) -> Any:
    """The dataclass `schema` filled from the mapping `value`: unknown keys and wrong types
    are added to `problems` (the default then stands in, so checking can go on)."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        problems.append(f"{key}={value!r}: must be a mapping of {schema.__name__} keys")
        return schema()
    hints = _hints(schema)
    metadata = {f.name: f.metadata for f in dataclasses.fields(schema)}
    unknown = sorted(k for k in value if k not in hints)
    if unknown:
        where = f"{key}: " if key else ""
        problems.append(f"{where}unknown key(s) {', '.join(_join(key, k) for k in unknown)}; "
                        f"valid: {', '.join(hints)}")
    values = {}
    for name, annotation in hints.items():
        if name not in value or (not key and name in PLUGIN_GROUPS):  # see _plugin
            continue
        nested = section_type(annotation)
        if nested is not None and (value[name] is not None or nested is annotation):
            values[name] = _section(_join(key, name), nested, value[name], problems)
            continue
        problem = (type_problem(_join(key, name), value[name], annotation)
                   or declared_problem(_join(key, name), value[name], metadata[name]))
        if problem:
            problems.append(problem)
        else:
            values[name] = value[name]
    return schema(**values)


def section_type(annotation: Any) -> type[Any] | None:
    """The dataclass of a section key, `X` or `Optional[X]` (a section that may be null);
    None for any other key."""
    import typing

    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if (len(args) == 1 and type(None) in typing.get_args(annotation)
            and isinstance(args[0], type) and dataclasses.is_dataclass(args[0])):
        return args[0]
    return None


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _hints(schema: type[Any]) -> dict[str, Any]:
    import typing

    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


WEIGHTS_KEY = "weights"  # model.weights: what the model starts from (runner.weights)


def _plugin(key: str, node: Any, problems: list[str]) -> Plugin:
    if key == "model" and isinstance(node, Mapping) and WEIGHTS_KEY in node:
        node = dict(node)
        weights = node.pop(WEIGHTS_KEY)
        if weights is not None and (not isinstance(weights, str) or not weights.strip()):
            problems.append(f"model.weights={weights!r}: must be the path of a file or "
                            f"directory of weights")
            weights = None
        return dataclasses.replace(_plugin(key, node, problems), weights=weights)
    if isinstance(node, Mapping) and node.get(TARGET_KEY) is not None:
        target = node[TARGET_KEY]
        if key == "strategy" or "name" in node:
            problems.append(f"{key}.{TARGET_KEY}={target}: " + (
                "strategies are registered by name (list their module in `plugins`)"
                if key == "strategy" else
                f"give either {key}={node['name']} or {key}.{TARGET_KEY}, not both"))
            return Plugin("")
        if not isinstance(target, str) or not target.strip():
            problems.append(f"{key}.{TARGET_KEY}={target!r}: must be a dotted path "
                            f"(my_pkg.module.Name)")
            return Plugin("")
        return Plugin(target, {k: v for k, v in node.items() if k != TARGET_KEY}, target)
    if not isinstance(node, Mapping) or not node.get("name"):
        problems.append(f"{key}: missing (choose one with {key}=NAME)")
        return Plugin("")
    return Plugin(str(node["name"]), {k: v for k, v in node.items() if k != "name"})


def plain(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The config as plain Python values, interpolations resolved; raises `ConfigError` for a
    missing value (`???`) or an interpolation that does not resolve."""
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        targets = [k for k in missing if k.endswith(f".{TARGET_KEY}")]
        if targets:  # GROUP=target without the class
            raise ConfigError([f"{k}: missing ({k.split('.')[0]}=target takes your own class "
                               f"or function: {k}=my_pkg.module.Name)" for k in targets])
        if missing:
            raise ConfigError([f"missing required value: {', '.join(missing)}"])
        container = OmegaConf.to_container(cfg, resolve=True)
    except ConfigError:
        raise
    except Exception as exc:  # an interpolation that does not resolve: name its key
        key = getattr(exc, "full_key", None)
        where = f"{key}: " if key else ""
        raise ConfigError([f"{where}cannot resolve {str(exc).splitlines()[0]}"]) from None
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def parse_with_problems(cfg: DictConfig | Mapping[str, Any]) -> tuple[RunConfig, list[str]]:
    """The typed run config, and every unknown key and wrong type (where a value is wrong, its
    default stands in, so that later checks can go on and name their problems too)."""
    from runner.core.grid import GridShape

    values = plain(cfg)
    values.pop("hydra", None)
    problems: list[str] = []
    schema: ConfigSchema = _section("", ConfigSchema, values, problems)
    plugins = {key: _plugin(key, values.get(key), problems) for key in PLUGIN_GROUPS}
    run = RunConfig(seed=schema.seed, grid=GridShape(schema.grid.pr, schema.grid.pc),
                    trainer=schema.trainer, launcher=schema.launcher, debug=schema.debug,
                    logger=schema.logger.name, comm=schema.comm, data=schema.data,
                    plugins=tuple(schema.plugins), objective=schema.objective, **plugins)
    return run, problems


def parse(cfg: DictConfig | Mapping[str, Any]) -> RunConfig:
    """The typed run config, or `ConfigError` naming every unknown key and wrong type. No
    plugin is imported: cross-field and plugin checks are `runner.cli.validation.validate`'s."""
    run, problems = parse_with_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return run


def parse_plan(cfg: DictConfig | Mapping[str, Any]) -> PlanConfig:
    """The planner's section alone, typed (`ConfigError` as `parse`)."""
    problems: list[str] = []
    plan: PlanConfig = _section("plan", PlanConfig, plain(cfg).get("plan"), problems)
    if problems:
        raise ConfigError(problems)
    return plan


def load_run_config(path: Path) -> RunConfig:
    """A run directory's `config.yaml`, which the head validated before any rank started: the
    ranks parse it and trust it."""
    loaded = OmegaConf.load(path)
    if not isinstance(loaded, DictConfig):
        raise ConfigError([f"{path}: not a mapping of config keys"])
    return parse(loaded)


BOOL_WORDS = ("true", "false", "1", "0")


def bool_override_problems(overrides: list[str]) -> list[str]:
    """`KEY=VALUE` overrides of the schema's true/false keys whose value is no such word:
    Hydra's typed config turns any other integer into true (`debug.stage_host_tensors=2`)."""
    problems = []
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if not sep or "." not in key:
            continue
        *sections, name = key.split(".")
        schema: type[Any] | None = ConfigSchema
        for section in sections:  # launcher.slurm.dry_run: through the nested sections
            schema = section_type(_hints(schema).get(section)) if schema is not None else None
        if schema is None:
            continue
        if _hints(schema).get(name) is bool and value.strip().lower() not in BOOL_WORDS:
            problems.append(f"{key}={value}: must be true or false")
    return problems
