"""A run held at a known step, for a test that acts on a run while it trains.

A test that must do something while a run is in a given state (still training, past its first
checkpoint, with every rank at one step) holds the run there rather than trusting it to be
slow enough. The run's model is `gated_mlp`: the default MLP (`model=mlp`, the same weights from
the same seed), whose every rank, before the forward of its training step `hold_at`, writes
`held-<rank>-of-<size>` into the gate's directory and waits until the test releases it:

- by a file: `Gate.release()` writes `release` into the directory;
- by a stop signal the rank receives (SIGINT, SIGTERM, SIGUSR1: what the head relays when it is
  asked to stop, and what Slurm sends); the rank's own handler has noted it when the hold ends,
  so the run stops at the next step where its ranks agree, whatever the machine's load
  (`release_on_stop=False`: the file alone, for a test of what happens to ranks that do not
  stop).

A rank holds once per gate directory: a later start of the run in the same gate (a resumed
command, a requeued Slurm job) passes through. A hold that nobody releases within
`HOLD_LIMIT_S` fails the rank (a safety net against a hung test, not a timing).

Steps are counted by backward passes through the model, so the head (which builds the model and
runs it on a sample to check it, never backward) never holds.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from runner.training.interrupt import STOP_SIGNALS
from runner.training.mpienv import detect_mpi_environment
from runner.zoo.models import mlp

TARGET = "tests.gates.gated_mlp"
RELEASE = "release"
HOLD_LIMIT_S = 200.0  # below the suite's TIMEOUT_S: a hold nobody releases fails the run first
# The others' steps past a held straggler take well under a second; a launch of check scripts
# has its timeout to keep too.
PACE_LIMIT_S = 60.0
POLL_S = 0.05


def held_marker(gate: Path, rank: int, size: int) -> Path:
    return gate / f"held-{rank}-of-{size}"


class Gate:
    """The test's side of a gate: the overrides that put a run behind it, a wait until its ranks
    are held, and their release."""

    def __init__(self, directory: Path, hold_at: int, release_on_stop: bool = True) -> None:
        if hold_at < 2:
            raise ValueError("hold_at counts trained steps: the first hold is before step 2")
        self.directory, self.hold_at = directory, hold_at
        self.release_on_stop = release_on_stop
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def overrides(self) -> list[str]:
        return [f"model._target_={TARGET}", f"model.gate={self.directory}",
                f"model.hold_at={self.hold_at}",
                f"model.release_on_stop={str(self.release_on_stop).lower()}"]

    def held(self, ranks: int, size: int | None = None) -> bool:
        """Whether ranks 0..ranks-1 of a job of `size` ranks (default: `ranks`) are held."""
        size = ranks if size is None else size
        return all(held_marker(self.directory, rank, size).exists() for rank in range(ranks))

    def wait_held(self, ranks: int, size: int | None = None,
                  job: subprocess.Popen[str] | None = None,
                  ended: Callable[[], str | None] | None = None,
                  timeout: float = HOLD_LIMIT_S) -> None:
        """Until the ranks are held; fails at once if `job` ended first (or `ended()` says why
        the run cannot get there), and after `timeout` seconds as a safety net."""
        deadline = time.monotonic() + timeout
        while not self.held(ranks, size):
            if job is not None and job.poll() is not None:
                out, err = job.communicate()
                raise AssertionError(f"the run ended (exit {job.returncode}) before its ranks "
                                     f"were held at step {self.hold_at}\n{out}\n{err}")
            why = ended() if ended is not None else None
            assert why is None, f"the run cannot reach step {self.hold_at}: {why}"
            assert time.monotonic() < deadline, (
                f"the ranks were not held at step {self.hold_at} within {timeout:.0f} s")
            time.sleep(POLL_S)

    def release(self) -> None:
        (self.directory / RELEASE).touch()


def _rank_and_size() -> tuple[int, int]:
    job = detect_mpi_environment()
    return (0, 1) if job is None else (job.rank, job.size)


def _wait_for_release(release: Path, limit_s: float, on_stop: bool) -> None:
    """Until `release` exists or (`on_stop`) this process receives a stop signal, seen through
    a wakeup fd: the rank's own handler for it runs in the main thread (at once, or at its next
    bytecode), so it has noted the stop before the rank's next step begins."""
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    try:
        previous: int | None = signal.set_wakeup_fd(writer)
    except ValueError:  # not the main thread: the file alone releases
        previous = None
    stops = {int(signum) for signum in STOP_SIGNALS} if on_stop else set()
    try:
        deadline = time.monotonic() + limit_s
        while not release.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"held for {limit_s:.0f} s and never released ({release})")
            ready, _, _ = select.select([reader], [], [], POLL_S)
            if ready and stops.intersection(os.read(reader, 64)):
                return
    finally:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(reader)
        os.close(writer)


class _Steps:
    """Counts the backward passes through a model (hooked on a module whose output requires a
    gradient in training): the rank's trained steps."""

    def __init__(self) -> None:
        self.trained = 0

    def count(self, module: nn.Module, args: object, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(self._trained)

    def _trained(self, grad: torch.Tensor) -> None:
        self.trained += 1


class _Hold(_Steps):
    """The rank's side of a gate: holds once, before step `hold_at`."""

    def __init__(self, gate: Path, hold_at: int, release_on_stop: bool) -> None:
        super().__init__()
        self.gate, self.hold_at, self.release_on_stop = gate, hold_at, release_on_stop
        self.done = False

    def before(self, module: nn.Module, args: object) -> None:
        if self.done or not torch.is_grad_enabled() or self.trained != self.hold_at - 1:
            return
        self.done = True
        marker = held_marker(self.gate, *_rank_and_size())
        if marker.exists():  # an earlier start of this run held here
            return
        marker.write_text(f"{os.getpid()}\n")
        _wait_for_release(self.gate / RELEASE, HOLD_LIMIT_S, self.release_on_stop)


def gated_mlp(input_shape: Sequence[int], num_classes: int, gate: str, hold_at: int,
              release_on_stop: bool = True, hidden: Sequence[int] = (128, 128),
              activation: str = "relu") -> nn.Sequential:
    """`model=mlp` (its defaults, the same weights), each rank held before the forward of its
    training step `hold_at` until the test releases it (see the module's docstring). The hooks
    sit on the first module (Flatten) and the first activation, which every strategy keeps as
    they are."""
    if hold_at < 2:
        raise ValueError(f"model.hold_at={hold_at}: the first hold is before step 2")
    model: nn.Sequential = mlp(input_shape, num_classes, hidden, activation)
    hold = _Hold(Path(gate), hold_at, release_on_stop)
    model[0].register_forward_pre_hook(hold.before)
    model[2].register_forward_hook(hold.count)
    return model


# -- who is ahead of whom -------------------------------------------------------------------

AHEAD = "ahead"  # the straggler's record: a line per step it began, "<step> <furthest other's>"


def began_path(progress: Path, rank: int) -> Path:
    return progress / f"began-{rank}"


def read_began(progress: Path, rank: int) -> int:
    """The last training step `rank` began (0: none yet)."""
    try:
        return int(began_path(progress, rank).read_text())
    except (OSError, ValueError):
        return 0


def read_ahead(progress: Path) -> list[tuple[int, int]]:
    """The straggler's record: (its step, the furthest step any other rank had begun then)."""
    lines = (progress / AHEAD).read_text().splitlines()
    return [(int(mine), int(furthest)) for mine, furthest in (line.split() for line in lines)]


class _Pace(_Steps):
    """Each rank notes the step it begins; the straggler also notes how far the others had got,
    and with `hold_until` waits before its step 2 until each of them has begun that step."""

    def __init__(self, progress: Path, straggler: int, hold_until: int) -> None:
        super().__init__()
        self.progress, self.straggler, self.hold_until = progress, straggler, hold_until

    def before(self, module: nn.Module, args: object) -> None:
        if not torch.is_grad_enabled():
            return
        step = self.trained + 1
        rank, size = _rank_and_size()
        path = began_path(self.progress, rank)
        fresh = path.with_suffix(".tmp")
        fresh.write_text(str(step))
        os.replace(fresh, path)  # a reader sees one step or the next, never half a file
        if rank != self.straggler:
            return
        others = [other for other in range(size) if other != rank]
        if step == 2 and self.hold_until:
            deadline = time.monotonic() + PACE_LIMIT_S
            while min(read_began(self.progress, other) for other in others) < self.hold_until:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the other ranks did not begin step {self.hold_until} "
                                       f"while rank {rank} was held before its step 2: they "
                                       f"waited for it")
                time.sleep(POLL_S)
        furthest = max(read_began(self.progress, other) for other in others)
        with (self.progress / AHEAD).open("a") as record:
            record.write(f"{step} {furthest}\n")


def paced_mlp(input_shape: Sequence[int], num_classes: int, progress: str, straggler: int,
              hold_until: int = 0, hidden: Sequence[int] = (128, 128),
              activation: str = "relu") -> nn.Sequential:
    """`model=mlp` whose ranks note in `progress` the training step each begins, and rank
    `straggler` how far ahead the others were at each of its steps (`read_ahead`); with
    `hold_until`, the straggler is held before its step 2 until every other rank has begun
    step `hold_until`, which they can only if they never wait for it."""
    model: nn.Sequential = mlp(input_shape, num_classes, hidden, activation)
    Path(progress).mkdir(parents=True, exist_ok=True)
    pace = _Pace(Path(progress), straggler, hold_until)
    model[0].register_forward_pre_hook(pace.before)
    model[2].register_forward_hook(pace.count)
    return model
