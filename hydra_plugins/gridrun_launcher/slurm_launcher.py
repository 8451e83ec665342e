"""`hydra/launcher=slurm`: each job of a gridrun sweep becomes one Slurm batch job sized from its
own config (its grid.pr × grid.pc ranks, its `launcher.slurm.*` options), and every job is
submitted at once, so that the scheduler runs them side by side.

`python -m runner -m hydra/launcher=slurm ...` adds `launcher=slurm` to the sweep's overrides
where no `launcher=` is given. For each job the launcher composes its config, and
`runner.cli.launch.submit_checked` validates it, asks Slurm about it, writes its run directory and
batch script and submits it; a job whose config is refused, or that sbatch refuses, is recorded
and the others go on. The head then shows every job's state (a live table on a terminal, a line
per change otherwise) until all have ended, and writes the sweep table from the jobs'
`summary.json` as `hydra/launcher=mpi` does, with a `requeued` column (how many times Slurm
started each job again). The jobs' returns (each run's objective, for Hydra's sweepers) come
back in job order; the sweep's exit code is the MPI launcher's. With `launcher.slurm.dry_run=true`
each job's batch script and sbatch command are printed and nothing is submitted.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
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

from hydra_plugins.gridrun_launcher.mpi_launcher import GRIDRUN_TASK_MODULE, finish_gridrun_sweep

if TYPE_CHECKING:
    from rich.console import Console

    from runner.cli.slurm import WatchedJob
    from runner.cli.sweep import SweepJob
    from runner.config.schema import RunConfig


@dataclass
class SlurmLauncherConf:
    _target_: str = "hydra_plugins.gridrun_launcher.slurm_launcher.SlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="slurm", node=SlurmLauncherConf,
                             provider="gridrun")


class _Submitted:
    """A job of the sweep after its submission: its Hydra return, and what the wait needs (a
    plain class: Hydra loads this module outside `sys.modules`, where a dataclass cannot read
    annotations that name other modules' classes)."""

    def __init__(self, number: int, shown: Sequence[str], ret: JobReturn, run_dir: Path,
                 run: "RunConfig | None" = None, job_id: str | None = None,
                 error: str | None = None) -> None:
        self.number, self.shown, self.ret, self.run_dir = number, shown, ret, run_dir
        self.run, self.job_id, self.error = run, job_id, error


def _submit_task(cfg: DictConfig) -> Any:
    """The task Hydra runs for each job here: validate and submit, not train."""
    from runner.cli.launch import submit_checked

    return submit_checked(cfg, Path(HydraConfig.get().runtime.output_dir))


class SlurmLauncher(Launcher):
    def __init__(self, **_fields: Any) -> None:
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None
        self.gridrun_jobs: list[SweepJob] = []  # the whole sweep's, as the MPI launcher's

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        from runner.cli.sweep import make_sweep_dir
        from runner.records.console import make_console

        assert self.config is not None and self.task_function is not None
        if self.task_function.__module__ != GRIDRUN_TASK_MODULE:
            raise HydraException("hydra/launcher=slurm runs gridrun's sweeps only (python -m "
                                 "runner -m ...); for another Hydra app, use hydra/launcher=mpi")
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        make_sweep_dir(sweep_dir)
        console = make_console()
        submitted = [self._submit(overrides, initial_job_idx + offset, console)
                     for offset, overrides in enumerate(job_overrides)]
        watched = {job.number: self._watched(job) for job in submitted if job.job_id is not None}
        if not watched and all(job.error is None for job in submitted):
            console.print(f"dry run: {len(submitted)} job(s), nothing submitted")
            return [job.ret for job in submitted]
        if watched:
            from runner.cli.slurm import JobWatch
            from runner.records.process import start_up_done

            start_up_done()  # from here the head watches the jobs

            poll_s = min(slurm_options.poll_s for job in submitted
                         if job.job_id is not None and job.run is not None
                         and (slurm_options := job.run.launcher.slurm) is not None)
            console.print(f"{len(watched)} slurm job(s) submitted; waiting for them "
                          f"(Ctrl-C stops them)")
            JobWatch(list(watched.values()), poll_s, console, table=True).wait()
        jobs = [self._outcome(job, watched.get(job.number)) for job in submitted]
        self.gridrun_jobs += jobs
        returns = [job.ret for job in submitted]
        finish_gridrun_sweep(sweep_dir, console, returns, self.gridrun_jobs, all_at_once=True)
        return returns

    def _submit(self, overrides: Sequence[str], number: int, console: "Console") -> _Submitted:
        """Compose, validate and submit one job (its task, run by Hydra as a job, submits)."""
        from rich.markup import escape

        from runner.cli.sweep import job_dir_refusal
        from runner.config.schema import ConfigError
        from runner.records.console import printable

        assert self.config is not None and self.hydra_context is not None
        shown = filter_overrides(overrides)
        console.print(f"[bold]job {number}[/bold]: "
                      f"{escape(printable(' '.join(shown))) or '(defaults)'}")
        try:
            job_config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides))
        except Exception as exc:  # an override that does not compose fails this job only
            failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
            failed.return_value = exc
            return _Submitted(number, shown, failed, Path(""), error=str(exc).splitlines()[0])
        with open_dict(job_config):
            job_config.hydra.job.id = f"{number}"
            job_config.hydra.job.num = number
        # before Hydra writes the job's .hydra/ into it: no link on the way is followed
        refused = job_dir_refusal(Path(str(self.config.hydra.sweep.dir)),
                                  str(OmegaConf.select(job_config, "hydra.sweep.subdir")))
        if refused is not None:
            failed = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
            failed.return_value = ConfigError([refused])
            return _Submitted(number, shown, failed, Path(""), error=refused)
        ret = run_job(hydra_context=self.hydra_context, task_function=_submit_task,
                      config=job_config, job_dir_key="hydra.sweep.dir",
                      job_subdir_key="hydra.sweep.subdir")
        run_dir = Path(str(ret.hydra_cfg.hydra.runtime.output_dir)) if ret.hydra_cfg else Path("")
        if ret.status != JobStatus.COMPLETED:
            return _Submitted(number, shown, ret, run_dir,
                              error=str(ret._return_value).splitlines()[0])
        run, job_id = ret.return_value
        if job_id is None:  # a dry run
            ret.return_value = float("nan")
        else:
            console.print(f"job {number}: slurm job {job_id}")
        return _Submitted(number, shown, ret, run_dir, run, job_id)

    @staticmethod
    def _watched(job: _Submitted) -> "WatchedJob":
        from runner.cli.slurm import WatchedJob

        assert job.job_id is not None
        return WatchedJob(f"job {job.number}", job.job_id, job.run_dir)

    @staticmethod
    def _outcome(job: _Submitted, watched: "WatchedJob | None") -> "SweepJob":
        """The job's row, and its Hydra return made its run's: the objective, or the
        failure."""
        from runner.cli.launch import RunFailed, RunInterrupted, slurm_outcome
        from runner.cli.sweep import SweepJob
        from runner.training.summary import objective_value

        run_dir = str(job.run_dir) if job.run_dir != Path("") else ""
        if watched is None or job.run is None:  # refused before submission, or a dry run
            return SweepJob(job.number, job.shown, run_dir, None, job.error)
        try:
            summary = slurm_outcome(job.run, watched)
        except (RunFailed, RunInterrupted) as exc:
            job.ret.status = JobStatus.FAILED
            job.ret.return_value = exc
            return SweepJob(job.number, job.shown, run_dir, None, str(exc).splitlines()[0],
                            watched.requeued)
        job.ret.return_value = objective_value(summary)
        return SweepJob(job.number, job.shown, run_dir, summary, None, watched.requeued)
