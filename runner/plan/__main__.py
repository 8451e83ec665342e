"""`gridrun-plan key=value ...` (or `python -m runner.plan`): the planner's command line.

A Hydra app over the same `conf/` and schema as training: its primary config, `conf/plan.yaml`,
is `config.yaml` plus Hydra's basic launcher (the planner starts no MPI job; `-m` runs one plan
per job in this process) and no run directory (`hydra.run.dir=.`, no `.hydra/`). `--help`, `-m`,
`--cfg job` and `-sc` (shell completion) are Hydra's; bad input is one line on stderr and exit
code 2, checked before Hydra runs (`precheck`), for a single plan and for every job of a sweep.
`plan.calibrate=true` measures this machine's α and β (an MPI job on this machine) instead.
Heavy modules (torch, the plugins) are imported only once a plan is built.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.cli.compose import (
    CONF_DIR,
    pickle_flag_problem,
    register_configs,
    with_target_groups,
)
from runner.config.schema import PlanConfig, Plugin, RunConfig
from runner.records.console import make_console, print_error

if TYPE_CHECKING:
    from torch import nn

    from runner.plan.planner import Plan
    from strategies import PricingContext, Strategy

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
PLAN_CONFIG = "plan"  # conf/plan.yaml
_MULTIRUN_FLAGS = ("-m", "--multirun")

# The jobs of a sweep that failed (each already named on stderr); the sweep goes on without them.
_failed_jobs: list[str] = []


def _sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Every job's overrides, as Hydra's basic sweeper expands `key=a,b` (Hydra's errors are
    raised, the lexer's among them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    choices: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(overrides=overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():  # as written (`~key` has no value to print)
            choices.append([override.input_line or f"{key}={override.get_value_element_as_str()}"])
        elif override.is_discrete_sweep():
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            raise HydraException(f"{override.input_line}: the basic sweeper takes lists "
                                 "(key=a,b), not ranges or intervals")
    return [list(job) for job in itertools.product(*choices)]


def precheck(args: list[str]) -> str | None:
    """The problem with a single plan's overrides, or with any job of a sweep's, as one line;
    None when there is none, or when a Hydra flag other than `-m` and `-cd` asks for something
    else (Hydra answers those)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.cli.compose import compose, config_dirs, one_line, without_config_dirs
    from runner.config.schema import ConfigError, parse_plan

    rest = without_config_dirs(args)
    flags = [a for a in rest if a.startswith("-")]
    overrides = [a for a in rest if not a.startswith("-")]
    if any(f not in _MULTIRUN_FLAGS for f in flags):
        return None
    if flags and any(o.lstrip("+~").startswith(("hydra/sweeper=", "hydra.sweeper."))
                     for o in overrides):
        return None  # another sweeper's syntax: Hydra expands it
    try:
        jobs = _sweep_jobs(overrides) if flags else [overrides]
    except HydraException as exc:
        return one_line(exc)
    for index, job in enumerate(jobs):
        where = f"job {index} ({' '.join(job)}): " if flags else ""
        try:
            parse_plan(compose(job, extra_dirs=config_dirs(args)))
        except (HydraException, OmegaConfBaseException) as exc:
            return where + one_line(exc)
        except ConfigError as exc:
            return where + str(exc)
    return None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=PLAN_CONFIG)
def hydra_task(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        code = plan_or_calibrate(cfg)
        if code:
            sys.exit(code)
        return
    job = " ".join(hydra_cfg.overrides.task)
    make_console().print(f"plan job {hydra_cfg.job.num}: {job}", markup=False)
    if plan_or_calibrate(cfg, job=f"job {hydra_cfg.job.num} ({job})"):
        _failed_jobs.append(str(hydra_cfg.job.num))


def plan_or_calibrate(cfg: DictConfig, job: str = "") -> int:
    """Print the plan for a composed config (or calibrate); the exit code. Problems are one
    line on stderr, prefixed with `job` in a sweep."""
    from runner.config.schema import ConfigError, parse_plan
    from runner.core.registry import UnknownPluginError
    from runner.plan.calibration import CalibrationFailed

    prefix = f"{job}: " if job else ""
    try:
        plan_cfg = parse_plan(cfg)
        problems = plan_value_problems(plan_cfg)
        if problems:
            raise ValueError("; ".join(problems))
        if plan_cfg.calibrate:
            calibrate(plan_cfg.calibrate_repeats)
        else:
            try:
                plan = build_plan(cfg, plan_cfg)
            except RuntimeError as exc:  # torch's, from shapes on the meta device
                raise ValueError("the planner follows a model's layers in order and cannot "
                                 f"follow this one: {str(exc).splitlines()[0]}") from exc
            show_plan(plan, plan_cfg)
            if plan_cfg.memory_per_rank is not None:
                show_fits(cfg, plan_cfg, plan)
    except (ValueError, UnknownPluginError, TypeError, ConfigError) as exc:
        print_error(prefix + str(exc))  # a refused calibration (too few cores) among them
        return EXIT_BAD_INPUT
    except CalibrationFailed as exc:
        print_error(prefix + str(exc))
        return EXIT_FAILED
    return 0


def calibrate(repeats: int = 20) -> None:
    import torch

    from runner.plan.calibration import (
        MAX_COLLECTIVE_RANKS,
        calibration_path,
        calibration_ranks,
        measure,
        usable_cores,
    )
    from runner.records.rundir import write_json

    console = make_console()
    cores = usable_cores()
    ranks = calibration_ranks(cores)  # refuses a machine with fewer than 2 usable cores
    console.print(f"measuring α and β (ping-pong on 2 ranks, all-reduce sweep on {ranks}) ...")
    if torch.cuda.is_available():
        console.print(f"and the GPU ({torch.cuda.get_device_name(0)}): its products, "
                      "convolutions and elementwise work, and an all-reduce of its buffers ...")
    if ranks < MAX_COLLECTIVE_RANKS:
        console.print(f"note: the all-reduce sweep runs on {ranks} ranks, not "
                      f"{MAX_COLLECTIVE_RANKS}: this process may use {cores} cores, and ranks "
                      "without a core of their own would measure the scheduler, not MPI")
    result = measure(repeats, collective_ranks=ranks)
    console.print("measuring the runner's own work per step (one process, 60 steps) ...")
    result["compute"]["step_overhead"] = measure_step_overhead()
    write_json(calibration_path(), result)
    compute = result["compute"]
    console.print(f"compute: dispatch {compute['dispatch'] * 1e6:.2f} µs per call, memory "
                  f"{compute['memory'] / 1e9:.1f} GB/s, the runner's own work "
                  f"{compute['step_overhead'] * 1e3:.3f} ms per step")
    for kind in ("point_to_point", "collective"):
        values = result[kind]
        console.print(f"{kind}: α = {values['alpha']:.3e} s, β = {values['beta']:.3e} s/B "
                      f"({1 / values['beta'] / 1e9:.2f} GB/s)")
    for name, device in result.get("devices", {}).items():
        console.print(device_line(name, device))
    console.print(f"stored in {calibration_path()}: later plans and runs use it")


def device_line(name: str, device: Mapping[str, Any]) -> str:
    """What a GPU's calibration found: its products' best rates, its elementwise bandwidth,
    its collectives' α and β (and how the sweep's buffers travelled)."""
    def best(compute: Mapping[str, Any]) -> float:
        return max(rate for band in compute["gemm"].values() for _, rate in band)

    collective = device["collective"]
    return (f"{name}: products up to {best(device['compute']) / 1e12:.1f} TFLOP/s in float32, "
            f"{best(device['compute_bf16']) / 1e12:.1f} in bfloat16; elementwise "
            f"{device['compute']['memory'] / 1e9:.0f} GB/s; all-reduce on "
            f"{collective['ranks']} ranks ({collective.get('path')}): "
            f"α = {collective['alpha']:.3e} s, β = {collective['beta']:.3e} s/B")


def measure_step_overhead(steps: int = 60) -> float:
    """Seconds per step the runner spends besides what the compute model prices (model,
    loss, update): a one-process run of the default model on digits through the runner's own
    loop, its median step less the predicted one at the rates just stored."""
    import contextlib
    import io
    import tempfile

    import torch
    from omegaconf import OmegaConf

    from runner.cli.validation import validate
    from runner.config.machine import load_compute_rates
    from runner.core import ProcessGrid
    from runner.records.rundir import RunDir
    from runner.training import assembly
    from runner.training.loop import train
    from strategies.base import predict_step

    cfg = OmegaConf.create({
        "seed": 0, "grid": {"pr": 1, "pc": 1}, "dataset": {"name": "digits"},
        "model": {"name": "mlp"}, "strategy": {"name": "data"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "trainer": {"steps": steps, "batch_size": 64, "eval_every": steps, "threads": 1}})
    run = validate(cfg, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the compute rates were measured: a rank's one thread
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            directory = RunDir(Path(tmp) / "run")
            directory.create(cfg)
            summary = train(run, directory, ProcessGrid(1, 1))
    finally:
        torch.set_num_threads(threads)
    rates = dataclasses.replace(load_compute_rates(), step_overhead=0.0)
    parts = assembly.assemble(run, rates=rates, device="meta")
    predicted = predict_step(parts.strategy, parts.model, parts.spec.input_shape,
                             run.grid, run.trainer.batch_size).total_s
    return max(0.0, float(summary["median_step_time_s"]) - predicted)


def show_plan(plan: Plan, plan_cfg: PlanConfig) -> None:
    from runner.plan.planner import (
        layer_table,
        layouts_table,
        order,
        plan_json,
        plan_modules_table,
        plan_table,
    )

    console = make_console()
    console.print(plan_table(plan))
    refused: dict[str, list] = {}
    for row in plan.rows:
        if row.refused:
            refused.setdefault(row.strategy, []).append(row)
    # strategies refused at the same grids for the same reason (the sparse modes of `data`)
    # share one line
    lines: dict[tuple[str, str], list[str]] = {}
    for name, rows in refused.items():
        grids = ", ".join(f"{r.pr}x{r.pc}" for r in rows)
        lines.setdefault((grids, str(rows[0].refused)), []).append(name)
    for (grids, reason), names in lines.items():
        console.print(f"not possible: {', '.join(names)} at {grids}: {reason}")
    autos = [row for row in plan.feasible if row.layouts]
    if autos:  # the best grid's per-layer layouts
        best_auto = min(autos, key=order)
        batch = next((r for r in plan.feasible if r.strategy == "data" and r.pr == 1), None)
        against = (f", pure batch (data 1 x {plan.world}) {batch.step_time * 1e3:,.3f} ms"
                   if batch is not None else "")
        console.print(f"auto {best_auto.pr} x {best_auto.pc}: "
                      f"{best_auto.step_time * 1e3:,.3f} ms per step{against}")
        console.print(layouts_table(best_auto))
    planned = [row for row in plan.feasible if row.plan_modules]
    if planned:  # the fastest grid split by a plan by module name: its modules
        console.print(plan_modules_table(min(planned, key=order)))
    for line in variant_lines(plan):
        console.print(line)
    if plan_cfg.layers:
        for row in sorted(plan.feasible, key=order):
            console.print(layer_table(plan, row))
    if plan_cfg.out:
        try:
            Path(plan_cfg.out).write_text(json.dumps(plan_json(plan), indent=2) + "\n")
        except OSError as exc:  # checked before planning; the disk may fill since
            print_error(f"plan.out={plan_cfg.out}: cannot write it: {exc.strerror or exc}")
            sys.exit(EXIT_BAD_INPUT)
        console.print(f"plan written to {plan_cfg.out}")


def show_fits(cfg: DictConfig, plan_cfg: PlanConfig, plan: Plan) -> None:
    """For `plan.memory_per_rank`: every strategy's smallest world that fits, from plans of
    1, 2, 4, ... ranks up to `plan.world`."""
    from runner.plan.planner import fits_table, smallest_fits

    assert plan_cfg.memory_per_rank is not None
    worlds = sorted({1 << i for i in range(plan_cfg.world.bit_length())
                     if 1 << i < plan_cfg.world})
    plans = [build_plan(cfg, plan_cfg, world) for world in worlds] + [plan]
    fits = smallest_fits(plans, plan_cfg.memory_per_rank)
    make_console().print(fits_table(fits, plan_cfg.memory_per_rank, plan_cfg.world))


# A transformer's variants the plan lists side by side: strategy → (option, its choices).
TRANSFORMER_CHOICES = {"model": ("tp_layout", ("pairing", "gather")),
                       "grid": ("tp_layout", ("pairing", "gather")),
                       "domain": ("kv_exchange", ("ring", "allgather"))}


def variant_lines(plan: Plan) -> list[str]:
    """For each strategy planned in several variants (`grid tp_layout=pairing`, ...), a line at
    the grid (Pr > 1: a model group to split over) where its best variant is fastest: every
    variant's step time there, and which is cheaper."""
    by_grid: dict[tuple[str, str, int, int], dict[str, float]] = {}
    for row in plan.feasible:
        base, _, variant = row.strategy.partition(" ")
        if "=" in variant and row.pr > 1:  # a variant of how the model group splits
            key, _, choice = variant.partition("=")
            by_grid.setdefault((base, key, row.pr, row.pc), {})[choice] = row.step_time
    lines = []
    for base, key in dict.fromkeys((b, k) for b, k, _, _ in by_grid):
        grids = {(pr, pc): times for (b, k, pr, pc), times in by_grid.items()
                 if (b, k) == (base, key) and len(times) > 1}
        if not grids:
            continue
        (pr, pc), times = min(grids.items(), key=lambda item: min(item[1].values()))
        cheapest = min(times, key=lambda choice: times[choice])
        shown = ", ".join(f"{choice} {seconds * 1e3:,.3f} ms"
                          for choice, seconds in sorted(times.items(), key=lambda i: i[1]))
        lines.append(f"{base} {pr} x {pc}: {key}={cheapest} is cheaper ({shown} per step)")
    return lines


# The most ranks the planner factorises: every divisor is tried, and a grid of more ranks than
# any machine has would be planned for minutes, in silence.
MAX_WORLD = 1 << 20


def plan_value_problems(plan_cfg: PlanConfig) -> list[str]:
    """The planner's own values that no plan can use, each named."""
    import math

    problems = []
    if plan_cfg.world > MAX_WORLD:
        problems.append(f"plan.world={plan_cfg.world}: at most {MAX_WORLD:,} ranks")
    if not (math.isfinite(plan_cfg.slowdown) and plan_cfg.slowdown > 0):
        problems.append(f"plan.slowdown={plan_cfg.slowdown}: must be a finite number > 0 (1: a "
                        f"core per rank)")
    for key in ("alpha", "beta"):
        value = getattr(plan_cfg, key)
        if value is not None and not (math.isfinite(value) and value >= 0):
            problems.append(f"plan.{key}={value}: must be null or a finite number of seconds "
                            f">= 0")
    budget = plan_cfg.memory_per_rank
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        problems.append(f"plan.memory_per_rank={budget}: must be a number of bytes > 0 "
                        f"(e.g. 8e9)")
    if plan_cfg.calibrate_repeats < 1:
        problems.append(f"plan.calibrate_repeats={plan_cfg.calibrate_repeats}: must be >= 1")
    if plan_cfg.out:
        problems += filter(None, [_unwritable_file(Path(plan_cfg.out))])
    return problems


def _unwritable_file(path: Path) -> str | None:
    """Why the plan cannot be written to `path` (None: it can), found before planning."""
    if path.is_dir():
        return f"plan.out={path}: is a directory; name a file"
    if not path.parent.is_dir():
        return f"plan.out={path}: the folder {path.parent} does not exist"
    existed = path.exists()
    try:
        with path.open("a"):  # tried for real: permissions, a read-only file system
            pass
    except OSError as exc:
        return f"plan.out={path}: cannot write it: {exc.strerror or exc}"
    if not existed:
        path.unlink()
    return None


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    """The model a plan prices, built on the meta device, and what its dataset tells of it."""

    model: nn.Module
    sample_shape: tuple[int, ...]
    steps_per_epoch: int | None  # None: a model described by its own shapes, no dataset
    rows_touched: Callable[[int], float] | None  # of an embedding table (None: no token data)


def planned_model(run: RunConfig, batch: int) -> PlannedModel:
    """The run's model on the meta device: from its dataset's shapes, or from its own
    (`model.sample_shape` and `model.classes`, as alexnet's config gives them)."""
    from runner.training import assembly

    dtype = assembly.dtype_of(run)
    if "sample_shape" in run.model.options:
        sample_shape = tuple(int(d) for d in run.model.options["sample_shape"])
        classes = int(run.model.options["classes"])
        model = assembly.build_model(run.model, sample_shape, classes, {}, dtype, "meta")
        return PlannedModel(model, sample_shape, None, None)
    dataset = assembly.build_dataset(run.dataset, assembly.objective_of(run.model))
    spec = dataset.spec()
    rows_touched = assembly.rows_touched(dataset)
    return PlannedModel(assembly.model_for(run.model, spec, dtype, "meta"),
                        tuple(spec.input_shape), spec.train_size // batch, rows_touched)


def plan_pricing(run: RunConfig, plan_cfg: PlanConfig,
                 rows_touched: Callable[[int], float] | None) -> PricingContext:
    """What the strategies price with: `plan.alpha`/`plan.beta` or this machine's calibration
    (a run on a GPU priced with that GPU's, where there is one), and the run's settings."""
    from runner.config.machine import load_compute_rates, load_machine_costs, pricing_device
    from runner.training import assembly
    from runner.training.precision import HALF_TYPES
    from strategies import PricingContext

    trainer = run.trainer
    device = pricing_device(trainer.device)
    costs = load_machine_costs(plan_cfg.alpha, plan_cfg.beta, device=device)
    return PricingContext(costs, rows_touched, HALF_TYPES.get(trainer.precision),
                          load_compute_rates(device, trainer.precision), trainer.batch_size,
                          plan_cfg.slowdown, assembly.optimizer_kind(run.optimizer),
                          trainer.accumulate_steps, trainer.activation_checkpointing)


def planned_strategies(run: RunConfig, plan_cfg: PlanConfig, pricing: PricingContext,
                       model: nn.Module) -> dict[str, Strategy]:
    """The plan's strategies by row name: `plan.strategies`, the configured one with its
    options and the others with their defaults; one row per variant where the choice is the
    plan's to show (sparse exchange modes of a model with embedding tables, a transformer's
    tensor-parallel layouts and key/value exchanges, FSDP's stages)."""
    from runner.training import assembly
    from strategies.exchange.sparse_gradients import SPARSE_CHOICES, sparse_tables
    from strategies.transformer.gpt import is_gpt

    def strategy(name: str, options: Mapping[str, Any]) -> Strategy:
        return assembly.build_strategy(Plugin(name, options), pricing)

    def configured(name: str) -> Mapping[str, Any]:
        """The configured strategy's options; the others' defaults."""
        return run.strategy.options if name == run.strategy.name else {}

    strategies = {name: strategy(name, configured(name)) for name in plan_cfg.strategies}
    if "data" in strategies and sparse_tables(model):
        # one row per sparse exchange mode: the comparison a user of embedding tables wants
        for mode in SPARSE_CHOICES:
            strategies[f"data sparse={mode}"] = strategy("data",
                                                         {**configured("data"), "sparse": mode})
        del strategies["data"]
    if is_gpt(model):
        # a transformer: one row per tensor-parallel layout and per key/value exchange, so the
        # plan says which is cheaper where
        for name, (key, choices) in TRANSFORMER_CHOICES.items():
            if name not in strategies:
                continue
            for choice in choices:
                strategies[f"{name} {key}={choice}"] = strategy(name,
                                                                {**configured(name), key: choice})
            del strategies[name]
    if "fsdp" in strategies:  # one row per stage: what each shards, and what it costs
        for stage in (1, 2, 3):
            strategies[f"fsdp stage={stage}"] = strategy("fsdp",
                                                         {**configured("fsdp"), "stage": stage})
        del strategies["fsdp"]
    return strategies


def build_plan(cfg: DictConfig, plan_cfg: PlanConfig, world: int | None = None) -> Plan:
    """The plan for a composed config (no MPI: the model is built on the meta device), over
    `world` ranks (`plan.world` by default)."""
    from runner.config.schema import parse
    from runner.plan.planner import make_plan
    from runner.training import assembly

    run = parse(cfg)
    assembly.import_plugins(run)  # a model the user's `plugins` modules register
    world, batch = world or plan_cfg.world, run.trainer.batch_size
    if world < 1 or batch < 1:
        raise ValueError(f"plan.world={world} and trainer.batch_size={batch} must be >= 1")
    planned = planned_model(run, batch)
    pricing = plan_pricing(run, plan_cfg, planned.rows_touched)
    strategies = planned_strategies(run, plan_cfg, pricing, planned.model)
    copies = assembly.optimizer_class(run.optimizer).state_copies(run.optimizer.options)
    return make_plan(planned.model, planned.sample_shape, batch, world, strategies,
                     pricing.costs, steps_per_epoch=planned.steps_per_epoch,
                     state_copies=copies)


# Hydra's flags that take the next word as their value (`--info` only a word of its choices).
_VALUE_FLAGS = {"-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c",
                "--cfg", "-p", "--package", "--experimental-rerun"}
_INFO_CHOICES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _hydra_args(args: list[str]) -> list[str]:
    """`args` as Hydra's argument parser takes them: the flags (with their values) first, then
    the overrides in one run, with the `GROUP=target` choices `with_target_groups` adds (the
    parser takes a single run of overrides: `plan.world=8 -m model=mlp,cnn` would be cut in
    two and refused)."""
    flags: list[str] = []
    overrides: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("-"):
            overrides.append(arg)
        else:
            flags.append(arg)
            following = args[index + 1] if index + 1 < len(args) else None
            if following is not None and (arg in _VALUE_FLAGS or (
                    arg == "--info" and following in _INFO_CHOICES)):
                flags.append(following)
                index += 1
        index += 1
    return [*flags, *with_target_groups(overrides)]


def main(argv: list[str]) -> int:
    """The planner's command line; the exit code (Hydra's own exits are `SystemExit`s)."""
    pickled = pickle_flag_problem(argv)
    if pickled:  # before Hydra reads the file
        print_error(pickled)
        return EXIT_BAD_INPUT
    if "-h" in argv or "--help" in argv:
        from runner.cli.help import plan_help_text

        print(plan_help_text())
        return 0
    if "--version" in argv:
        from runner.cli.help import version_text

        print(version_text())
        return 0
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        # as `python -m runner.plan` has it: a user's `_target_` modules in the working
        # directory import from the `gridrun-plan` console script too
        sys.path.insert(0, str(Path.cwd()))
    problem = precheck(argv)
    if problem:
        print_error(problem)
        return EXIT_BAD_INPUT
    register_configs()
    sys.argv[1:] = _hydra_args(argv)
    hydra_task()
    if _failed_jobs:
        print_error(f"{len(_failed_jobs)} plan job(s) failed: {', '.join(_failed_jobs)}")
        return EXIT_BAD_INPUT
    return 0


def run() -> None:
    """The `gridrun-plan` console script."""
    from runner.records.process import end_process

    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:  # Hydra's own exits, a failed single plan
        end_process(exc.code)
    end_process(code)


if __name__ == "__main__":
    run()
