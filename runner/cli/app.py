"""The command-line entry point: `python -m runner key=value ...`.

Composes `conf/config.yaml` with the overrides (Hydra; the schema registered by
`runner.cli.compose`), validates the result once, makes the run directory and hands over to
`runner.cli.launch`. Bad input is one line on stderr and exit code 2, before any MPI job starts.
Heavy modules (torch, the plugins) are imported only once a run needs them, so `--help` and
`--cfg` answer at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from runner.cli.compose import (
    CONF_DIR,
    compose,
    config_dirs,
    one_line,
    pickle_flag_problem,
    register_configs,
    slurm_options_problem,
    with_slurm_launcher,
    with_target_groups,
    without_config_dirs,
)
from runner.records.console import print_error
from runner.training.mpienv import MPIEnvironment, detect_mpi_environment

if TYPE_CHECKING:
    from runner.config.schema import RunConfig

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C

# Flags after which Hydra does something other than one run with these overrides.
# (`--config-dir` is not among them: `precheck` composes with it.)
_HYDRA_FLAGS = {"-m", "--multirun", "-h", "--help", "--hydra-help", "--version", "-c", "--cfg",
                "-i", "--info", "-p", "--package", "--resolve", "-sc", "--shell-completion",
                "-cp", "--config-path", "-cn", "--config-name", "--experimental-rerun"}

_mpi: MPIEnvironment | None = None
# The single run's config as `precheck` validated it (the run is not validated twice), the run
# directory it checked and locked, and the config as Hydra composed it (its `hydra` node too:
# the run is not composed again).
_checked: RunConfig | None = None
_checked_dir: Path | None = None
_composed: DictConfig | None = None


def precheck(args: list[str]) -> str | None:
    """Compose and validate a single run's overrides before Hydra makes a run directory, so bad
    input costs one line and leaves nothing behind."""
    global _checked, _checked_dir, _composed
    extra_dirs, args = config_dirs(args), without_config_dirs(args)
    if any(a in _HYDRA_FLAGS or a.split("=")[0] in _HYDRA_FLAGS for a in args):
        return None
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from runner.cli.preflight import machine_problems
    from runner.cli.validation import validate_parts
    from runner.config.schema import ConfigError, bool_override_problems
    from runner.records.rundir import RunDirInUse, earlier_records, lock_run_dir, set_aside_earlier

    flags = bool_override_problems(args)
    if flags:
        return "; ".join(flags)
    try:
        cfg = compose(args, with_hydra=True, extra_dirs=extra_dirs)
        run_dir = Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
    except (HydraException, OmegaConfBaseException) as exc:
        return one_line(exc)
    composed, cfg = cfg, cfg.copy()
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        run, parts = validate_parts(cfg, world_size=None if _mpi is None else _mpi.size)
    except ConfigError as exc:
        return str(exc)
    notes: list[str] = []
    problems = machine_problems(run, parts, run_dir, inside_mpi_job=_mpi is not None,
                                notes=notes)
    if problems:
        return "; ".join(problems)
    for note in notes:  # e.g. damaged checkpoints that trainer.resume=auto passes over
        print(f"note: {note}", file=sys.stderr, flush=True)
    if run.launcher.slurm is not None and run.launcher.slurm.dry_run:
        _checked, _checked_dir = run, run_dir  # printed by `main`: nothing is written
        return None
    try:  # before Hydra or the run writes anything into it
        lock_run_dir(run_dir)
    except RunDirInUse as exc:
        return str(exc)
    if run.trainer.resume is not None and earlier_records(run_dir):
        # a resume of this directory's run: Hydra and the run rewrite these next
        set_aside_earlier(run_dir)
    _checked, _checked_dir, _composed = run, run_dir, composed
    return None


def run_task(cfg: DictConfig) -> float | None:
    """One run. Returns the run's objective (`objective`, a float) for Hydra's sweepers; the
    whole summary is `<run dir>/summary.json`, which the MPI launcher's sweep table reads."""
    from runner.cli.launch import RunFailed, RunInterrupted, execute
    from runner.config.schema import ConfigError
    from runner.training.summary import objective_value

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if _mpi is not None:
        return _lead_mpi_job(cfg, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:  # the launcher records a failed job and goes on
        return objective_value(execute(cfg, run_dir))
    try:
        return objective_value(execute(cfg, run_dir, _checked))
    except ConfigError as exc:
        print_error(str(exc))
        sys.exit(EXIT_BAD_INPUT)
    except RunFailed as exc:
        print_error(str(exc))
        sys.exit(EXIT_RUN_FAILED)
    except RunInterrupted as exc:  # not an error: the message says how to continue
        print(str(exc), file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)


hydra_task = hydra.main(version_base="1.3", config_path=str(CONF_DIR),
                        config_name="config")(run_task)


def run_composed(cfg: DictConfig, run_dir: Path) -> None:
    """The checked single run as `hydra.main` runs one (Hydra's own logging, its callbacks, and
    `run_job`: the run directory's `.hydra/`, the job's logging, environment and working
    directory), on the config `precheck` composed. `hydra.main` would compose it twice more,
    to find the run mode and then to run (0.2 s of a small run's start on 2 cores)."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.mode = RunMode.RUN
        cfg.hydra.run.dir = str(run_dir)  # resolved once: a `${now:...}` must not move
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    callbacks = Callbacks(cfg)
    callbacks.on_run_start(config=cfg, config_name="config")
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF_DIR)))
    done = run_job(task_function=run_task, config=cfg, job_dir_key="hydra.run.dir",
                   job_subdir_key=None,
                   hydra_context=HydraContext(config_loader=loader, callbacks=callbacks))
    callbacks.on_run_end(config=cfg, config_name="config", job_return=done)
    _ = done.return_value  # the task's exception, raised


def _lead_mpi_job(cfg: DictConfig, run_dir: Path) -> float | None:
    """Rank 0 of a job the user started: `precheck` validated against its size; train with
    the rest."""
    from mpi4py import MPI

    from runner.records.rundir import RunDir
    from runner.training.rank import announce_run_dir, run_rank

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        print_error("multirun (-m) inside an MPI job is not supported: start the sweep from a "
                    "shell and hydra/launcher=mpi starts one MPI job per sweep job")
        sys.exit(EXIT_BAD_INPUT)
    if _checked is None:  # flags that skip `precheck` (-cd, -cn): validate here, once
        from runner.cli.validation import validate
        from runner.config.schema import ConfigError

        try:
            validate(cfg, world_size=MPI.COMM_WORLD.Get_size())
        except ConfigError as exc:
            print_error(str(exc))
            sys.exit(EXIT_BAD_INPUT)  # the exit hook releases the other ranks
    directory = RunDir(run_dir)
    directory.create(cfg)
    announce_run_dir(directory.path)
    code = run_rank(directory.path, MPI.COMM_WORLD)
    summary = directory.read_summary()
    if code != 0 or summary is None:
        return None
    from runner.training.summary import objective_value

    return objective_value(summary)


def main() -> None:
    global _mpi
    problem = pickle_flag_problem(sys.argv[1:])
    if problem:  # before anything reads the file
        print_error(problem)
        sys.exit(EXIT_BAD_INPUT)
    if {"-h", "--help", "--version"} & set(sys.argv[1:]):  # gridrun's own, not Hydra's
        from runner.cli.help import help_text, version_text

        print(version_text() if "--version" in sys.argv[1:] else help_text())
        sys.exit(0)
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        # As `python -m runner` does: a user's `_target_` and `plugins` modules in the working
        # directory import from the `gridrun` console script too (the ranks run `python -m`).
        sys.path.insert(0, str(Path.cwd()))
    sys.argv[1:] = with_slurm_launcher(with_target_groups(sys.argv[1:]))
    problem = slurm_options_problem(sys.argv[1:])
    if problem:
        print_error(problem)
        sys.exit(EXIT_BAD_INPUT)
    _mpi = detect_mpi_environment()
    if _mpi is not None and _mpi.rank != 0:
        from runner.training.rank import follow_rank0

        sys.exit(follow_rank0())
    if _mpi is not None:
        from runner.training.rank import lead_followers_on_exit

        lead_followers_on_exit()
    from runner.cli.sweep import sweep_record_problem

    problem = sweep_record_problem(sys.argv[1:]) or precheck(sys.argv[1:])
    if problem:
        print_error(problem)
        sys.exit(EXIT_BAD_INPUT)
    if _checked is not None and _checked_dir is not None:
        from runner.cli.launch import print_dry_run

        if print_dry_run(_checked, _checked_dir):  # before Hydra writes a run directory
            sys.exit(0)
    if _composed is not None and _checked_dir is not None:
        run_composed(_composed, _checked_dir)
        return
    register_configs()
    hydra_task()


def run() -> None:
    """The `gridrun` console script: `python -m runner`'s way out (no interpreter teardown,
    `runner.records.process.end_process`)."""
    from runner.records.process import defer_full_collections, end_process

    defer_full_collections()  # until the run trains or its job is watched
    try:
        main()
    except SystemExit as exc:  # bad input, a failed or interrupted run, Hydra's own exits
        end_process(exc.code)
    end_process(0)
