"""`hydra/launcher=mpi`: each multirun job becomes its own MPI job of its own size.

Jobs run one after another (concurrent jobs would share the cores and spoil every job's timings).
For each job the launcher composes the job's config, and the task function validates it, writes
the job's run directory and starts `mpiexec -n pr*pc` for it (1-rank jobs train in this process).
A job that is invalid or fails is recorded and the sweep goes on; at the end a sweep table (one
row per job) is printed and written to `<sweep dir>/sweep_summary.csv`. Expected failures (a
config the validator refused, a training job that failed) are listed under the table and the
sweep exits with code 1; anything else is left to Hydra, which shows its traceback.
"""


import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    run_job,
    setup_globals,
)
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)

SWEEP_CSV = "sweep_summary.csv"


@dataclass
class MPILauncherConf:
    _target_: str = "hydra_plugins.gridrun_launcher.mpi_launcher.MPILauncher"


ConfigStore.instance().store(group="hydra/launcher", name="mpi", node=MPILauncherConf,
                             provider="gridrun")


class MPILauncher(Launcher):
    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from runner.config import ConfigError
        from runner.console import make_console, print_error
        from runner.launch import RunFailed, RunInterrupted
        from runner.sweep import SweepJob, sweep_failures, sweep_rows, sweep_table, write_sweep_csv

        assert self.config is not None and self.hydra_context is not None
        assert self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        console = make_console()
        returns: list[JobReturn] = []
        jobs: list[SweepJob] = []
        interrupted: RunInterrupted | None = None
        for offset, overrides in enumerate(job_overrides):
            number = initial_job_idx + offset
            shown = filter_overrides(overrides)
            console.print(f"[bold]job {number}[/bold]: {' '.join(shown) or '(defaults)'}")
            try:
                job_config = self.hydra_context.config_loader.load_sweep_config(
                    self.config, list(overrides))
            except Exception as exc:  # an override that does not compose fails this job only
                failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
                failed.return_value = exc
                returns.append(failed)
                jobs.append(SweepJob(number, shown, "", None, str(exc).splitlines()[0]))
                continue
            with open_dict(job_config):
                job_config.hydra.job.id = f"{number}"
                job_config.hydra.job.num = number
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                          config=job_config, job_dir_key="hydra.sweep.dir",
                          job_subdir_key="hydra.sweep.subdir")
            returns.append(ret)
            failed = ret.status != JobStatus.COMPLETED
            summary = None if failed else ret._return_value
            error = str(ret._return_value).splitlines()[0] if failed else None
            run_dir = str(ret.hydra_cfg.hydra.runtime.output_dir) if ret.hydra_cfg else ""
            jobs.append(SweepJob(number, shown, run_dir, summary, error))
            if isinstance(ret._return_value, RunInterrupted):  # the user stops the sweep
                interrupted = ret._return_value
                break
        rows = sweep_rows(jobs)
        write_sweep_csv(sweep_dir / SWEEP_CSV, rows)
        console.print(sweep_table(rows, title=f"sweep {sweep_dir}"))
        console.print(f"sweep table: {sweep_dir / SWEEP_CSV}")
        if interrupted is not None:
            print(f"{interrupted}\nthe sweep stopped at job {jobs[-1].number}: the jobs after "
                  f"it did not run", file=sys.stderr)
            sys.exit(130)
        failures = sweep_failures(rows)
        expected = (ConfigError, RunFailed, HydraException)
        if failures and all(r.status == JobStatus.COMPLETED or isinstance(r._return_value, expected)
                            for r in returns):
            for line in failures:
                print_error(line)
            sys.exit(1)
        return returns
