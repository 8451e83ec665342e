"""Runs as Slurm batch jobs (`launcher=slurm`; `hydra/launcher=slurm` submits a sweep's jobs at
once): the batch script and its sbatch options, what Slurm is asked before anything is submitted,
the submission, and the jobs' states while the head waits. No Hydra here; the job's own side is
`runner.cli.slurm_job`.

A run's way: the head validates its config, makes the run directory, writes `slurm-job.sh`
into it and submits it (`sbatch --parsable`), then watches the job (squeue) until it ends and
reads the run's `summary.json`. The batch script runs `python -m runner.cli.slurm_job RUN_DIR
srun --mpi=... python -m runner.cli.worker RUN_DIR`: the srun starts the ranks as the bundled
launcher's mpiexec does.

Signals (measured on Slurm 22.05). The warning before the time limit goes to the batch shell
alone (`--signal=B:USR1@S`), which passes it to `runner.cli.slurm_job`, which has the ranks stop
at a step's end with a checkpoint (through srun, which forwards SIGUSR1 to the tasks; a SIGTERM
to srun would make it kill them at once); the shell then requeues the job (`scontrol requeue`),
and its next start resumes from that checkpoint. `B:` rather than a signal to the job step:
the step exists only once the ranks run, and the process that decides on the requeue must know
that the stop was Slurm's warning. Slurm's own SIGTERM (scancel, `scontrol requeue`, the time
limit, preemption) reaches every process of the job at once, the ranks included, with KillWait
seconds before SIGKILL: the shell outlives it, the ranks checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from runner.config.schema import RunConfig, SlurmConfig
from runner.records.rundir import atomic_write_text, write_json

BATCH_SCRIPT = "slurm-job.sh"
OUTPUT_NAME = "slurm-%j.out"  # the job's output in the run directory (%j: the job id)
JOB_RECORD = "slurm-job.json"  # which job the run directory belongs to
JOB_NAME = "gridrun"
WARNING_SIGNAL = "USR1"
REQUEUE_EXIT = 75  # the job stopped on Slurm's warning with its checkpoint: requeue it
SLURM_TIMEOUT_S = 60.0  # a Slurm command that answers slower than this has failed

# The states in which a job has ended for good (a requeued job is PENDING again).
ENDED_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                          "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED"})
GONE = "GONE"  # Slurm no longer knows the job (purged from its memory after MinJobAge)

TIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_WORD = re.compile(r"[A-Za-z0-9_.+-]+")
# Characters an #SBATCH line cannot hold in a path unquoted.
_UNSAFE_PATH = re.compile(r"[\s\"'\\$`]")


class SlurmError(RuntimeError):
    """Slurm refused or could not be asked (the message quotes it)."""


def options_of(run: RunConfig) -> SlurmConfig:
    """The run's Slurm options (the run is a Slurm run: `launcher=slurm`)."""
    options = run.launcher.slurm
    assert options is not None, "not a launcher=slurm run"
    return options


def time_limit_seconds(text: str) -> int | None:
    """Seconds of a time limit in Slurm's format; None for no limit (UNLIMITED, INFINITE);
    `ValueError` for anything else."""
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.fullmatch(text.strip())
    if match is None:
        raise ValueError(text)
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    assert first is not None
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + first * 3600 + (second or 0) * 60 + (third or 0)
    if third is not None:  # HH:MM:SS
        return first * 3600 + (second or 0) * 60 + third
    return first * 60 + (second or 0)  # minutes[:seconds]


def option_problems(run: RunConfig) -> list[str]:
    """What is wrong with the run's `launcher.slurm` options by themselves and against the
    run's size (nothing asks Slurm here: `submission_problems` does)."""
    options, tasks = options_of(run), run.grid.size
    problems = []
    if options.time is not None:
        try:
            limit = time_limit_seconds(options.time)
        except ValueError:
            problems.append(f"launcher.slurm.time={options.time}: not a time in Slurm's format "
                            f"({TIME_FORMATS})")
        else:
            if limit is not None and limit <= options.signal_s:
                problems.append(f"launcher.slurm.time={options.time}: {limit} s, no longer than "
                                f"the warning launcher.slurm.signal_s={options.signal_s} s before "
                                f"it")
    if not _WORD.fullmatch(options.mpi):
        problems.append(f"launcher.slurm.mpi={options.mpi!r}: must be one of srun's --mpi "
                        f"words (pmi2, pmix, none, ...)")
    for key in ("partition", "account", "qos"):
        value = getattr(options, key)
        if value is not None and not _WORD.fullmatch(str(value).replace(",", "")):
            problems.append(f"launcher.slurm.{key}={value!r}: must be a name (or names "
                            f"separated by commas)")
    for option in options.extra:
        if not option.startswith("-") or "\n" in option:
            problems.append(f"launcher.slurm.extra: {option!r} is not an sbatch option "
                            f"(--name=value)")
    if options.nodes is not None and options.nodes > tasks >= 1:
        problems.append(f"launcher.slurm.nodes={options.nodes}: more nodes than the run's "
                        f"{tasks} rank(s) (grid.pr*grid.pc)")
    if (options.ntasks_per_node is not None and options.nodes is not None
            and options.ntasks_per_node * options.nodes < tasks):
        problems.append(f"launcher.slurm.ntasks_per_node={options.ntasks_per_node} on "
                        f"launcher.slurm.nodes={options.nodes}: room for "
                        f"{options.ntasks_per_node * options.nodes} of the run's {tasks} ranks")
    return problems


# -- the batch script --------------------------------------------------------------------------

@dataclass(frozen=True)
class JobShape:
    """What a run asks of Slurm: one task per rank, and each task's CPUs and GPUs."""

    tasks: int
    cpus_per_task: int
    gpus_per_task: int

    def cpus(self) -> int:
        return self.tasks * self.cpus_per_task


def job_shape(run: RunConfig) -> JobShape:
    """grid.pr × grid.pc tasks; CPUs per task from `launcher.slurm.cpus_per_task`, else
    `trainer.threads`, else 1; GPUs per task from `launcher.slurm.gpus_per_task`, else one
    under `trainer.device=cuda` (none under `auto`: the job runs on what it is given)."""
    options = options_of(run)
    gpus = options.gpus_per_task
    if gpus is None:
        gpus = 1 if run.trainer.device == "cuda" else 0
    return JobShape(run.grid.size, options.cpus_per_task or run.trainer.threads or 1, gpus)


def sbatch_options(run: RunConfig, run_dir: Path, workdir: Path) -> list[str]:
    """The job's sbatch options: its size and place, where its output goes (appended to over a
    requeue), the warning before its time limit, and that it may be requeued; then
    `launcher.slurm.extra`, which may override any of them."""
    options, shape = options_of(run), job_shape(run)
    words = [f"--job-name={JOB_NAME}", f"--ntasks={shape.tasks}",
             f"--cpus-per-task={shape.cpus_per_task}"]
    if shape.gpus_per_task:
        words.append(f"--gpus-per-task={shape.gpus_per_task}")
    for flag, value in (("--nodes", options.nodes), ("--ntasks-per-node", options.ntasks_per_node),
                        ("--partition", options.partition), ("--account", options.account),
                        ("--qos", options.qos), ("--time", options.time)):
        if value is not None:
            words.append(f"{flag}={value}")
    if options.overcommit:
        words.append("--overcommit")
    words += [f"--chdir={workdir}", f"--output={run_dir / OUTPUT_NAME}", "--open-mode=append",
              f"--signal=B:{WARNING_SIGNAL}@{options.signal_s}", "--requeue", *options.extra]
    return words


def srun_command(run: RunConfig, run_dir: Path, python: str = sys.executable) -> list[str]:
    """How the job starts its ranks: srun with the site's MPI plug-in and binding, each task
    one rank running `python -m runner.cli.worker RUN_DIR` (as under the bundled mpiexec); a
    rank that fails ends the step."""
    return ["srun", f"--mpi={options_of(run).mpi}", f"--ntasks={run.grid.size}",
            "--kill-on-bad-exit=1", python, "-m", "runner.cli.worker", str(run_dir)]


def batch_script(run: RunConfig, run_dir: Path, workdir: Path | None = None,
                 python: str = sys.executable) -> str:
    """The batch script of the run in `run_dir` (an absolute path), run from `workdir` (where
    the user's own modules import from: the current directory)."""
    run_dir = Path(run_dir).absolute()
    workdir = (workdir or Path.cwd()).absolute()
    job = shlex.join([python, "-m", "runner.cli.slurm_job", str(run_dir),
                      *srun_command(run, run_dir, python)])
    lines = [
        "#!/bin/bash",
        f"# gridrun's batch job for the run in {run_dir}",
        f"# (sbatch {shlex.quote(str(run_dir / BATCH_SCRIPT))} submits it again)",
        *(f"#SBATCH {option}" for option in sbatch_options(run, run_dir, workdir)),
        "",
        "# Slurm's warning before the time limit comes to this shell alone: it passes it on to",
        "# gridrun, whose ranks stop at a step's end with a checkpoint. Slurm's SIGTERM (scancel,",
        "# a requeue, the time limit) reaches every process of the job at once: this shell",
        "# outlives it, so that the ranks have Slurm's KillWait to write their checkpoint.",
        "trap 'warned=USR1' USR1",
        "trap 'warned=${warned:-INT}' INT",
        "trap ':' TERM",
        f"{job} &",
        "job=$!",
        "trap 'kill -USR1 \"$job\" 2>/dev/null' USR1",
        "trap 'kill -INT \"$job\" 2>/dev/null' INT",
        'if [ -n "${warned:-}" ]; then kill "-$warned" "$job" 2>/dev/null; fi',
        "# a signal this shell traps ends `wait` early: wait on until gridrun has ended",
        'while :; do wait "$job"; code=$?; kill -0 "$job" 2>/dev/null || break; done',
        f'if [ "$code" -eq {REQUEUE_EXIT} ]; then',
        "    # stopped on the warning with a checkpoint: Slurm starts the job again, and the run",
        "    # resumes from that checkpoint",
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


def sbatch_command(script: Path) -> list[str]:
    return ["sbatch", "--parsable", str(script)]


def dry_run_text(run: RunConfig, run_dir: Path, label: str = "") -> str:
    """What a dry run prints: the batch script and the command that would submit it."""
    run_dir = Path(run_dir).absolute()
    script = batch_script(run, run_dir)
    command = shlex.join(sbatch_command(run_dir / BATCH_SCRIPT))
    title = f"{label}: " if label else ""
    return (f"# {title}dry run (launcher.slurm.dry_run=true): nothing submitted\n"
            f"# the batch script, {run_dir / BATCH_SCRIPT}:\n{script}"
            f"# submitted with:\n{command}\n")


def write_batch_script(run: RunConfig, run_dir: Path) -> Path:
    path = Path(run_dir).absolute() / BATCH_SCRIPT
    atomic_write_text(path, batch_script(run, path.parent))
    path.chmod(0o755)
    return path


# -- asking Slurm --------------------------------------------------------------------------

def _slurm(*command: str) -> subprocess.CompletedProcess[str]:
    """A Slurm command's answer (exit code 127 and the reason where it could not run)."""
    try:
        return subprocess.run(list(command), capture_output=True, text=True,
                              timeout=SLURM_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(list(command), 127, "", str(exc))


def _error_line(text: str) -> str:
    """Slurm's first error line without its 'sbatch: error: ' prefix."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    chosen = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
    return re.sub(r"^\w+: (?:error|fatal): ", "", chosen) or "no message"


def _fields(line: str) -> dict[str, str]:
    """`Key=Value Key=Value` (scontrol's one-line output) as a mapping."""
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


@dataclass(frozen=True)
class Partition:
    name: str
    cpus: int
    nodes: int
    oversubscribe: str


def find_partition(name: str | None) -> Partition | None:
    """The partition `name` (None: the cluster's default) as `scontrol show partition` has it;
    None where Slurm does not know it (sbatch's own check then says so)."""
    answer = _slurm("scontrol", "show", "partition", "--oneliner", *([name] if name else []))
    if answer.returncode != 0:
        return None
    for line in answer.stdout.splitlines():
        fields = _fields(line)
        if "PartitionName" not in fields or (name is None and fields.get("Default") != "YES"):
            continue
        try:
            return Partition(fields["PartitionName"], int(fields.get("TotalCPUs", "0")),
                             int(fields.get("TotalNodes", "0")), fields.get("OverSubscribe", ""))
        except ValueError:
            return None
    return None


def capacity_problem(run: RunConfig, partition: Partition) -> str | None:
    """A job its partition can never run. Counted in CPUs: the job's tasks × CPUs per task
    against the partition's CPUs. OverSubscribe does not change this count: it lets jobs share
    CPUs with other jobs, never one job's tasks outnumber its CPUs (on Slurm 22.05 such a job is
    accepted and then pends for ever, Reason=PartitionConfig); `launcher.slurm.overcommit`
    (sbatch --overcommit) is how ranks share CPUs."""
    options, shape = options_of(run), job_shape(run)
    if options.nodes is not None and partition.nodes and options.nodes > partition.nodes:
        return (f"launcher.slurm.nodes={options.nodes}: partition {partition.name} has "
                f"{partition.nodes} node(s)")
    if options.overcommit or not partition.cpus or shape.cpus() <= partition.cpus:
        return None
    return (f"grid.pr*grid.pc={shape.tasks} ranks × {shape.cpus_per_task} CPU(s) need "
            f"{shape.cpus()} CPUs, and partition {partition.name} has {partition.cpus} "
            f"(scontrol show partition; OverSubscribe={partition.oversubscribe or 'NO'} shares "
            f"CPUs between jobs, not between one job's ranks): Slurm would keep the job pending "
            f"for ever; use fewer ranks, or launcher.slurm.overcommit=true to let ranks share "
            f"CPUs")


# Words of Slurm's refusals, and the option each one is about.
_REFUSED_OPTIONS = (("partition", "partition"), ("account", "account"), ("qos", "qos"),
                    ("time", "time"), ("gres", "gpus_per_task"), ("gpu", "gpus_per_task"))


def test_only_problem(run: RunConfig, run_dir: Path) -> str | None:
    """What Slurm says of the job without submitting it (`sbatch --test-only` with the job's
    options), quoted, and the option it concerns named; None when Slurm would take it."""
    options = options_of(run)
    words = sbatch_options(run, Path(run_dir).absolute(), Path.cwd())
    answer = _slurm("sbatch", "--test-only", *words, "--wrap=true")
    if answer.returncode == 0:
        return None
    message = _error_line(answer.stderr or answer.stdout)
    lowered = message.lower()
    for word, key in _REFUSED_OPTIONS:
        value = getattr(options, key)
        if word in lowered and value is not None:
            return f"launcher.slurm.{key}={value}: Slurm refuses the job: {message}"
    if options.extra:
        return (f"Slurm refuses the job: {message} (sbatch --test-only with its options and "
                f"launcher.slurm.extra={options.extra})")
    shape = job_shape(run)
    return (f"Slurm refuses the job of grid.pr*grid.pc={shape.tasks} ranks × "
            f"{shape.cpus_per_task} CPU(s)"
            f"{f' × {shape.gpus_per_task} GPU(s)' if shape.gpus_per_task else ''}: {message}")


def time_problem(run: RunConfig, step_seconds: float | None, notes: list[str]) -> str | None:
    """A time limit shorter than one checkpoint interval (the predicted step time ×
    `trainer.checkpoint_every`): a job Slurm ends at its limit without the warning reaching it
    would lose every step it trained, each time. With a limit and no checkpoint interval, only
    the stop on the warning writes a checkpoint: said in `notes`."""
    options = options_of(run)
    if options.time is None:
        return None
    limit = time_limit_seconds(options.time)
    every = run.trainer.checkpoint_every
    if limit is None:
        return None
    if every is None:
        notes.append(f"launcher.slurm.time={options.time} without trainer.checkpoint_every: only "
                     f"the stop on Slurm's warning, launcher.slurm.signal_s={options.signal_s} s "
                     f"before the limit, writes a checkpoint; a job preempted or ended without "
                     f"that warning starts again from scratch")
        return None
    if step_seconds is None:
        return None
    interval = step_seconds * every
    if interval <= limit:
        return None
    return (f"launcher.slurm.time={options.time} ({limit} s) is shorter than one checkpoint "
            f"interval: trainer.checkpoint_every={every} × {step_seconds:.3g} s predicted per "
            f"step = {interval:,.0f} s; checkpoint more often, or give the job more time")


def submission_problems(run: RunConfig, run_dir: Path, step_seconds: float | None,
                        notes: list[str]) -> list[str]:
    """What Slurm would make of the job, asked before anything is submitted: sbatch on the
    PATH, the partition's size, `sbatch --test-only`, the time limit against the checkpoint
    interval."""
    if shutil.which("sbatch") is None:
        return ["launcher=slurm: sbatch not found on the PATH (run gridrun where Slurm's "
                "commands are: a login node, or after loading the site's Slurm module)"]
    for path, what in ((Path(run_dir).absolute(), "hydra.run.dir"), (Path.cwd(), "the "
                                                                      "working directory")):
        if _UNSAFE_PATH.search(str(path)):
            return [f"{what}={path}: an #SBATCH line cannot hold a path with spaces, quotes, "
                    f"'$' or '\\'"]
    problems = []
    partition = find_partition(options_of(run).partition)
    problem = capacity_problem(run, partition) if partition is not None else None
    problem = problem or test_only_problem(run, run_dir)
    if problem is not None:
        problems.append(problem)
    problem = time_problem(run, step_seconds, notes)
    if problem is not None:
        problems.append(problem)
    return problems


def submit(script: Path) -> str:
    """Submit the batch script; its job id. `SlurmError` quotes sbatch's refusal."""
    answer = _slurm(*sbatch_command(script))
    job_id = answer.stdout.strip().split(";")[0]  # --parsable: "id" or "id;cluster"
    if answer.returncode != 0 or not job_id.isdigit():
        raise SlurmError(f"sbatch refused {script}: {_error_line(answer.stderr or answer.stdout)}")
    return job_id


def write_job_record(run_dir: Path, job_id: str) -> None:
    """Which Slurm job the run directory belongs to (read by `live_job_problem`)."""
    write_json(Path(run_dir) / JOB_RECORD, {"job_id": job_id, "submitted": time.time()})


def live_job_problem(run_dir: Path) -> str | None:
    """A run directory whose Slurm job is still pending or running belongs to that job (its
    batch script takes the directory's lock only when it starts)."""
    try:
        job_id = str(json.loads((Path(run_dir) / JOB_RECORD).read_text())["job_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not job_id.isdigit() or shutil.which("squeue") is None:
        return None
    state = job_states([job_id])
    if state is None or state[job_id].ended:
        return None
    return (f"the run directory {run_dir} belongs to Slurm job {job_id}, which is "
            f"{state[job_id].shown()}: wait for it to end, scancel {job_id}, or choose another "
            f"hydra.run.dir")


@dataclass(frozen=True)
class JobState:
    """A job as squeue has it (`state` GONE: Slurm no longer knows it)."""

    job_id: str
    state: str
    reason: str = ""
    restarts: int = 0
    exit_code: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES or self.state == GONE

    def shown(self) -> str:
        """'pending (Priority)', 'running', 'completed', 'failed (exit code 1)'."""
        word = self.state.lower().replace("_", " ")
        if self.state == "PENDING" and self.reason and self.reason != "None":
            return f"{word} ({self.reason})"
        status = _exit_status(self.exit_code) if self.ended else None
        return f"{word} ({status})" if status else word


def _exit_status(raw: str) -> str | None:
    """squeue's exit_code (the batch script's wait status) in words; None for a clean exit."""
    if not raw.isdigit() or int(raw) == 0:
        return None
    status = int(raw)
    if status & 0x7F:
        return f"signal {status & 0x7F}"
    return f"exit code {status >> 8}"


def job_states(job_ids: Sequence[str]) -> dict[str, JobState] | None:
    """Every job's state in one squeue call (finished jobs too, while Slurm remembers them);
    None when squeue could not answer."""
    if not job_ids:
        return {}
    answer = _slurm("squeue", "--noheader", "--states=all", f"--jobs={','.join(job_ids)}",
                    "--Format=JobID:|,State:|,Reason:|,RestartCnt:|,exit_code:|")
    if answer.returncode != 0 and "invalid job id" not in answer.stderr.lower():
        return None
    found: dict[str, JobState] = {}
    for line in answer.stdout.splitlines():
        parts = [part.strip() for part in line.split("|")]
        if len(parts) < 4 or parts[0] not in job_ids:
            continue
        restarts = int(parts[3]) if parts[3].isdigit() else 0
        found[parts[0]] = JobState(parts[0], parts[1], parts[2], restarts,
                                   parts[4] if len(parts) > 4 else "")
    return {job_id: found.get(job_id, JobState(job_id, GONE)) for job_id in job_ids}


def cancel(job_id: str, signal_name: str | None = None) -> None:
    """scancel the job, or (`signal_name`) send that signal to its batch script."""
    if signal_name is None:
        _slurm("scancel", job_id)
    else:
        _slurm("scancel", "--batch", f"--signal={signal_name}", job_id)


# -- waiting for jobs ------------------------------------------------------------------------

@dataclass
class WatchedJob:
    """A submitted job the head waits for: `label` names it to the user."""

    label: str
    job_id: str
    run_dir: Path
    state: JobState | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def requeued(self) -> int:
        return self.state.restarts if self.state is not None else 0


class JobWatch:
    """The head's wait for its jobs: their states from squeue every `poll_s`, shown as a line
    per change (one job, or no terminal) or as a live table (a sweep on a terminal), until every
    job has ended. The first SIGINT or SIGTERM asks the jobs to stop (a running job's batch
    script gets SIGINT: the ranks checkpoint; a pending one is cancelled), the second cancels
    them all."""

    def __init__(self, jobs: Sequence[WatchedJob], poll_s: float, console: Console,
                 table: bool = False) -> None:
        self.jobs, self.poll_s, self.console = list(jobs), poll_s, console
        self.live = table and console.is_terminal
        self.stop_requests = 0
        self._complained = False

    def wait(self) -> list[WatchedJob]:
        previous = self._install_handlers()
        try:
            if self.live:
                with Live(self.table(), console=self.console, auto_refresh=False) as live:
                    self._loop(lambda: live.update(self.table(), refresh=True))
            else:
                self._loop(None)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self.jobs

    def _loop(self, redraw: Callable[[], None] | None) -> None:
        handled = 0
        while True:
            if self.stop_requests > handled:
                handled = self.stop_requests
                self._stop(kill=handled > 1)
            states = job_states([job.job_id for job in self.jobs])
            if states is None:
                if not self._complained:
                    self.console.print("squeue did not answer: asking again")
                    self._complained = True
            else:
                for job in self.jobs:
                    self._update(job, states[job.job_id], redraw is None)
            if redraw is not None:
                redraw()
            if states is not None and all(job.state is not None and job.state.ended
                                          for job in self.jobs):
                return
            time.sleep(self.poll_s)

    def _update(self, job: WatchedJob, state: JobState, lines: bool) -> None:
        before = job.state
        job.state = state
        if lines and (before is None or before.shown() != state.shown()
                      or before.restarts != state.restarts):
            requeued = (f", requeued {state.restarts} time(s)"
                        if state.restarts and (before is None or before.restarts
                                               != state.restarts) else "")
            self.console.print(f"{job.label}: slurm job {job.job_id} {state.shown()}{requeued}")

    def table(self) -> Table:
        table = Table(title="slurm jobs", title_justify="left")
        for header in ("job", "slurm job", "state", "requeued", "time (s)"):
            table.add_column(header, justify="left" if header in ("job", "state") else "right")
        now = time.monotonic()
        for job in self.jobs:
            state = job.state.shown() if job.state is not None else "submitted"
            table.add_row(job.label, job.job_id, state, str(job.requeued),
                          f"{now - job.started:.0f}")
        return table

    def _stop(self, kill: bool) -> None:
        for job in self.jobs:
            if job.state is not None and job.state.ended:
                continue
            if kill or job.state is None or job.state.state != "RUNNING":
                cancel(job.job_id)
            else:
                cancel(job.job_id, "INT")
        self.console.print("the jobs were cancelled" if kill else
                           "stopping: running jobs write a checkpoint and end, pending ones are "
                           "cancelled (again to cancel them all)")

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_signal)
                for signum in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requests += 1


def output_tail(run_dir: Path, job_id: str, lines: int = 1) -> str | None:
    """The last lines of the job's output (where a job that wrote no summary said why)."""
    path = Path(run_dir) / OUTPUT_NAME.replace("%j", job_id)
    with contextlib.suppress(OSError):
        text = [line.strip() for line in path.read_text(errors="replace").splitlines()
                if line.strip()]
        return " | ".join(text[-lines:]) if text else None
    return None
