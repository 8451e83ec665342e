"""`hydra/launcher=mpi`: each multirun job becomes its own MPI job of its own size.

Jobs run one after another (concurrent jobs would share the cores and spoil every job's timings).
The launcher serves two kinds of app (one app per sweep):

- **gridrun's own** (the task function is `runner.cli.app.hydra_task`): for each job the launcher
  composes the job's config, and the task function validates it, writes the job's run directory
  and starts `mpiexec -n pr*pc` for it (1-rank jobs train in this process). gridrun's `grid.*`
  and `launcher.*` size and start the job: this launcher's own fields below are ignored. A job
  that is invalid or fails is recorded and the sweep goes on; at the end a sweep table (one row
  per job, its numbers read from the job's `summary.json`: the task returns only the sweepers'
  objective) is printed and written to `<sweep dir>/sweep_summary.csv`. Expected failures (a
  config the validator refused, a training job that failed) are listed under the table and the
  sweep exits with code 1; anything else is left to Hydra, which shows its traceback.
- **any other Hydra app**: each job runs as `<command> <nproc_flag> <ranks> <args> python -m
  hydra_plugins.gridrun_launcher.app_rank ...`, every rank running the task
  (`hydra_plugins.gridrun_launcher.app_jobs`); no sweep table.

The launcher's fields, read from each job's own config (`hydra.launcher.ranks='${n}'` takes
each job's `n`): `ranks` (the job's number of ranks), `command` (the MPI launcher and its
arguments; null: the mpiexec installed beside this Python, else `mpiexec` on PATH),
`nproc_flag`, `args` (more arguments for the launcher). Hydra also resolves them once against
the sweep's own config when it creates the launcher, where a key that only the sweep adds
(`+n=1,2`) is missing: give the key a default in the app's config, or write
`hydra.launcher.ranks='${oc.select:n,1}'`.
"""

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from omegaconf import DictConfig, OmegaConf, open_dict

if TYPE_CHECKING:
    from rich.console import Console

    from runner.cli.sweep import SweepJob

log = logging.getLogger(__name__)

SWEEP_CSV = "sweep_summary.csv"
# The module of gridrun's own task function (`runner.cli.app.hydra_task`).
GRIDRUN_TASK_MODULE = "runner.cli.app"


@dataclass
class MPILauncherConf:
    _target_: str = "hydra_plugins.gridrun_launcher.mpi_launcher.MPILauncher"
    ranks: int = 1
    command: str | None = None
    nproc_flag: str = "-n"
    args: list[str] = field(default_factory=list)


ConfigStore.instance().store(group="hydra/launcher", name="mpi", node=MPILauncherConf,
                             provider="gridrun")


class MPILauncher(Launcher):
    def __init__(self, **_fields: Any) -> None:
        """Hydra passes the fields as the sweep's config has them; each job's own config decides
        (see the module docstring), so they are not kept here."""
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None
        # Every gridrun job of the sweep so far: a sweeper that launches batch after batch
        # (Optuna) gets one table and one CSV of the whole sweep, not of its last batch.
        self.gridrun_jobs: list[SweepJob] = []

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        assert self.task_function is not None
        if self.task_function.__module__ == GRIDRUN_TASK_MODULE:
            return self._launch_gridrun_jobs(job_overrides, initial_job_idx)
        from hydra_plugins.gridrun_launcher.app_jobs import launch_app_jobs

        return launch_app_jobs(self.config, self.hydra_context, self.task_function,
                               job_overrides, initial_job_idx)

    def _launch_gridrun_jobs(self, job_overrides: Sequence[Sequence[str]],
                             initial_job_idx: int) -> list[JobReturn]:
        from runner.cli.launch import RunInterrupted
        from runner.cli.sweep import make_sweep_dir
        from runner.records.console import make_console

        assert self.config is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        make_sweep_dir(sweep_dir)
        console = make_console()
        returns: list[JobReturn] = []
        jobs: list[SweepJob] = []
        for offset, overrides in enumerate(job_overrides):
            ret, job = self._run_gridrun_job(overrides, initial_job_idx + offset, console)
            returns.append(ret)
            jobs.append(job)
            if isinstance(ret._return_value, RunInterrupted):  # the user stops the sweep
                break
        self.gridrun_jobs += jobs
        finish_gridrun_sweep(sweep_dir, console, returns, self.gridrun_jobs)
        return returns

    def _run_gridrun_job(self, overrides: Sequence[str], number: int,
                         console: "Console") -> tuple[JobReturn, "SweepJob"]:
        """Run one job in this process (its task starts the job's MPI job) and record it for the
        table. An override that does not compose fails this job only."""
        from rich.markup import escape

        from runner.cli.sweep import SweepJob, job_dir_refusal
        from runner.config.schema import ConfigError
        from runner.records.console import printable
        from runner.records.rundir import RunDir

        assert self.config is not None and self.hydra_context is not None
        assert self.task_function is not None
        shown = filter_overrides(overrides)
        console.print(f"[bold]job {number}[/bold]: "
                      f"{escape(printable(' '.join(shown))) or '(defaults)'}")
        try:
            job_config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides))
        except Exception as exc:
            failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
            failed.return_value = exc
            return failed, SweepJob(number, shown, "", None, str(exc).splitlines()[0])
        with open_dict(job_config):
            job_config.hydra.job.id = f"{number}"
            job_config.hydra.job.num = number
        # before Hydra writes the job's .hydra/ into it: no link on the way is followed
        refused = job_dir_refusal(Path(str(self.config.hydra.sweep.dir)),
                                  str(OmegaConf.select(job_config, "hydra.sweep.subdir")))
        if refused is not None:
            failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
            failed.return_value = ConfigError([refused])
            return failed, SweepJob(number, shown, "", None, refused)
        ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                      config=job_config, job_dir_key="hydra.sweep.dir",
                      job_subdir_key="hydra.sweep.subdir")
        run_dir = str(ret.hydra_cfg.hydra.runtime.output_dir) if ret.hydra_cfg else ""
        if ret.status != JobStatus.COMPLETED:
            return ret, SweepJob(number, shown, run_dir, None,
                                 str(ret._return_value).splitlines()[0])
        # The return value is the sweepers' objective: the job's numbers are in its run directory.
        return ret, SweepJob(number, shown, run_dir, RunDir(Path(run_dir)).read_summary())


def finish_gridrun_sweep(sweep_dir: Path, console: "Console", returns: Sequence[JobReturn],
                         jobs: Sequence["SweepJob"], all_at_once: bool = False) -> None:
    """Print and write the sweep table (`jobs`: the sweep's so far), then end the sweep where
    this batch (`returns`) stopped or failed as expected (exit 130, exit 1); other failures are
    left to Hydra. `all_at_once`: the batch's jobs ran side by side (Slurm), not one after
    another."""
    from runner.cli.launch import RunFailed, RunInterrupted
    from runner.cli.sweep import sweep_failures, sweep_rows, sweep_table, write_sweep_csv
    from runner.config.schema import ConfigError
    from runner.records.console import print_error
    from runner.records.safe_paths import PathRefused

    rows = sweep_rows(jobs)
    try:
        write_sweep_csv(sweep_dir / SWEEP_CSV, rows)
    except PathRefused as exc:  # a link in the table's place: the table is shown, not written
        console.print(sweep_table(rows, title=f"sweep {sweep_dir}"))
        for line in [*sweep_failures(rows), str(exc)]:
            print_error(line)
        sys.exit(2)
    console.print(sweep_table(rows, title=f"sweep {sweep_dir}"))
    console.print(f"sweep table: {sweep_dir / SWEEP_CSV}")
    stopped = [r._return_value for r in returns if isinstance(r._return_value, RunInterrupted)]
    if stopped and all_at_once:
        print("\n".join(map(str, stopped)) + "\nthe sweep was stopped", file=sys.stderr)
        sys.exit(130)
    if stopped:
        print(f"{stopped[-1]}\nthe sweep stopped at job {jobs[-1].number}: the jobs after it "
              f"did not run", file=sys.stderr)
        sys.exit(130)
    failures = sweep_failures(rows)
    expected = (ConfigError, RunFailed, HydraException)
    if failures and all(r.status == JobStatus.COMPLETED or isinstance(r._return_value, expected)
                        for r in returns):
        for line in failures:
            print_error(line)
        sys.exit(1)
