"""A real single-node Slurm on this machine, for the tests of `launcher=slurm`.

`slurm_cluster()` starts MUNGE (if it is not running), `slurmctld` and `slurmd` as root, from a
`slurm.conf` written into a fresh directory: one node (`localhost`) of this machine's CPUs, its
jobs oversubscribing them (`OverSubscribe=FORCE:4`, as ranks share cores in the rest of the
suite), process tracking by `/proc` and no task plugin (nothing of cgroups needed), requeueing
allowed, finished jobs kept in the controller's memory for an hour (`scontrol show job` answers
for them; there is no accounting database). Ports the operating system picks. The daemons are
stopped and their directory removed at the end.

Where Slurm cannot be started (not installed, not root, a daemon that does not come up) the
tests say why: they skip, except where `GRIDRUN_REQUIRE_SLURM=1`, where they fail. `.ci/run`
installs Debian's `slurm-wlm` and `munge`.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRED = os.environ.get("GRIDRUN_REQUIRE_SLURM") == "1"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
PARTITION = "debug"
START_TIMEOUT_S = 30.0
CRED_EXPIRE_S = 5  # Slurm takes no less (a smaller value stands for its default)


@dataclass(frozen=True)
class SlurmCluster:
    """The running cluster: its configuration directory, and the environment its commands
    (`sbatch`, `squeue`, ...) need (`SLURM_CONF`)."""

    directory: Path
    partition: str
    cpus: int

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True,
                              timeout=timeout)


def unavailable(reason: str) -> None:
    """Skip, or (`GRIDRUN_REQUIRE_SLURM=1`) fail, saying why Slurm is not here."""
    message = f"a real Slurm could not be started: {reason}"
    if REQUIRED:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _munge_running() -> bool:
    try:
        credential = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        check = subprocess.run(["unmunge"], input=credential.stdout, capture_output=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return credential.returncode == 0 and check.returncode == 0


def _start_munge() -> str | None:
    """MUNGE running, or why it is not."""
    if _munge_running():
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        made = subprocess.run(["mungekey", "--create"], capture_output=True, text=True)
        if made.returncode != 0:
            return f"mungekey --create: {made.stderr.strip()}"
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    started = subprocess.run(["munged", "--force"], capture_output=True, text=True)
    if started.returncode != 0 or not _munge_running():
        return f"munged did not start: {started.stderr.strip() or started.stdout.strip()}"
    return None


def _write_conf(directory: Path, cpus: int) -> None:
    (directory / "state").mkdir()
    (directory / "spool").mkdir()
    lines = [
        "ClusterName=gridrun-tests",
        "SlurmctldHost=localhost",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd.pid'}",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        f"SlurmctldLogFile={directory / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "ReturnToService=2",
        "JobRequeue=1",
        # Job ids of their own: MPICH names a job's shared memory after its PMI name, the job id
        # under srun, and a segment a killed job left in /dev/shm would meet the next cluster's
        # job of the same id (measured: MPI_Init fails, "Message truncated").
        f"FirstJobId={random.randrange(1 << 16, 1 << 25)}",
        # A requeued job waits the credential lifetime before it may start again (120 s by
        # default), and then for the scheduler's next pass over pending jobs (every 60 s, the
        # backfill's every 30 s, by default): a few seconds here, so that a requeue costs the
        # tests little.
        f"AuthInfo=cred_expire={CRED_EXPIRE_S}",
        "SchedulerParameters=sched_interval=1,bf_interval=1",
        "MinJobAge=3600",
        # the time a stopped job's ranks have, from SIGTERM to SIGKILL, to finish their step
        # and checkpoint: a job stops as soon as they have, so a long one costs nothing, and a
        # loaded machine (the suite's files run two at once) took more than 5 s
        "KillWait=30",
        f"NodeName=localhost CPUs={cpus} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes=localhost Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE:4",
    ]
    (directory / "slurm.conf").write_text("\n".join(lines) + "\n")


def _stop(directory: Path) -> None:
    for name in ("slurmd", "slurmctld"):
        pid_file = directory / f"{name}.pid"
        try:
            os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + 10
    for name in ("slurmd", "slurmctld"):
        pid_file = directory / f"{name}.pid"
        while pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


@contextmanager
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running single-node Slurm (see the module docstring); skips or fails where there can
    be none."""
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        unavailable(f"{', '.join(missing)} not found (Debian: apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        unavailable("its daemons run as root here, and this is not root")
    problem = _start_munge()
    if problem is not None:
        unavailable(problem)
    directory = Path(tempfile.mkdtemp(prefix="gridrun-slurm-"))
    cpus = os.cpu_count() or 1
    _write_conf(directory, cpus)
    cluster = SlurmCluster(directory, PARTITION, cpus)
    try:
        for daemon in (["slurmctld", "-f", str(cluster.conf)],
                       ["slurmd", "-f", str(cluster.conf), "-N", "localhost"]):
            started = subprocess.run(daemon, env=cluster.env, capture_output=True, text=True)
            if started.returncode != 0:
                unavailable(f"{daemon[0]}: {started.stderr.strip()}")
        deadline = time.monotonic() + START_TIMEOUT_S
        state = ""
        while time.monotonic() < deadline:
            state = cluster.run("sinfo", "-h", "-o", "%T").stdout.strip()
            if state == "idle":
                break
            time.sleep(0.3)
        else:
            log = (directory / "slurmctld.log").read_text()[-500:] if (
                directory / "slurmctld.log").exists() else ""
            unavailable(f"the node is '{state}' after {START_TIMEOUT_S:.0f} s; {log}")
        yield cluster
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=cluster.env,
                       capture_output=True)
        _stop(directory)
        shutil.rmtree(directory, ignore_errors=True)
