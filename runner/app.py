"""The command-line entry point: the only module of the runner that touches Hydra.

`python -m runner key=value ...` composes `conf/config.yaml` with the overrides, validates the
result, makes the run directory and hands over to `runner.launch`. Bad input is one line on
stderr and exit code 2, before any MPI job starts.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from runner.config import ConfigError, validate
from runner.console import print_error
from runner.launch import (
    MPIEnvironment,
    RunFailed,
    RunInterrupted,
    detect_mpi_environment,
    execute,
)
from runner.preflight import output_problems
from runner.rundir import PROJECT_ROOT

CONF_DIR = PROJECT_ROOT / "conf"
EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C

# Flags after which Hydra does something other than one run with these overrides.
_HYDRA_FLAGS = {"-m", "--multirun", "-h", "--help", "--hydra-help", "--version", "-c", "--cfg",
                "-i", "--info", "-p", "--package", "--resolve", "-sc", "--shell-completion",
                "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
                "--experimental-rerun"}

_mpi: MPIEnvironment | None = None


def one_line(exc: BaseException) -> str:
    """Hydra's multi-line composition errors as the one line a user needs."""
    text = str(exc)
    missing = re.search(r"Could not find '(?:(.+)/)?([^'/]+)'", text)
    if missing:
        group, name = missing.group(1), missing.group(2)
        options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], re.MULTILINE)
        what = f"{group} '{name}'" if group else f"config '{name}'"
        return f"unknown {what}; available: {', '.join(options) or 'none'}"
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("See https://", "full_key:", "object_type=",
                                        "Config search path")):
            continue
        lines.append(line.rstrip("."))
    return "; ".join(lines)


def precheck(args: list[str]) -> str | None:
    """Compose and validate a single run's overrides before Hydra makes a run directory, so bad
    input costs one line and leaves nothing behind."""
    if any(a in _HYDRA_FLAGS or a.split("=")[0] in _HYDRA_FLAGS for a in args):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=args, return_hydra_config=True)
            run_dir = Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
    except (HydraException, OmegaConfBaseException) as exc:
        return one_line(exc)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        run = validate(cfg, world_size=None if _mpi is None else _mpi.size)
    except ConfigError as exc:
        return str(exc)
    problems = output_problems(run, run_dir)
    return "; ".join(problems) if problems else None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def hydra_task(cfg: DictConfig) -> dict[str, Any] | None:
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if _mpi is not None:
        return _lead_mpi_job(cfg, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return execute(cfg, run_dir)  # the launcher records a failed job and goes on
    try:
        return execute(cfg, run_dir)
    except ConfigError as exc:
        print_error(str(exc))
        sys.exit(EXIT_BAD_INPUT)
    except RunFailed as exc:
        print_error(str(exc))
        sys.exit(EXIT_RUN_FAILED)
    except RunInterrupted as exc:  # not an error: the message says how to continue
        print(str(exc), file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)


def _lead_mpi_job(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """Rank 0 of a job the user started: validate against its size, then train with the rest."""
    from mpi4py import MPI

    from runner.rundir import RunDir
    from runner.worker import announce_run_dir, run_rank

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        print_error("multirun (-m) inside an MPI job is not supported: start the sweep from a "
                    "shell and hydra/launcher=mpi starts one MPI job per sweep job")
        sys.exit(EXIT_BAD_INPUT)
    try:
        validate(cfg, world_size=MPI.COMM_WORLD.Get_size())
    except ConfigError as exc:
        print_error(str(exc))
        sys.exit(EXIT_BAD_INPUT)  # the exit hook releases the other ranks
    directory = RunDir(run_dir)
    directory.create(cfg)
    announce_run_dir(directory.path)
    code = run_rank(directory.path, MPI.COMM_WORLD)
    return directory.read_summary() if code == 0 else None


def main() -> None:
    global _mpi
    _mpi = detect_mpi_environment()
    if _mpi is not None and _mpi.rank != 0:
        from runner.worker import follow_rank0

        sys.exit(follow_rank0())
    if _mpi is not None:
        from runner.worker import lead_followers_on_exit

        lead_followers_on_exit()
    problem = precheck(sys.argv[1:])
    if problem:
        print_error(problem)
        sys.exit(EXIT_BAD_INPUT)
    hydra_task()
