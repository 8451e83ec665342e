"""SIGINT / SIGTERM / SIGUSR1 as a request to stop: finish the step, checkpoint, exit cleanly.

The head forwards SIGTERM to the job whatever it got (launchers pass SIGTERM on to every rank,
SIGINT not always; see `runner.cli.mpijob`; srun gets SIGUSR1), after writing the signal it got,
and the one it relays, to a file: a rank that gets the relayed signal names the head's instead
(`relay_stop_signal_from`), so Ctrl-C reads "SIGINT" in the summary. A rank only notes the
signal here. Ranks see it at different moments, so the training loop agrees on when to stop
through a collective it already makes each step (the loss all-reduce).
A second signal to a 1-process run (the head trains itself) interrupts at once, as usual; once
the stop is made, a rank's process ignores SIGTERM and SIGUSR1 until it ends.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# What the head sends the ranks, whatever it got, unless its file names another ("relayed_as":
# SIGUSR1 through Slurm's srun, which kills the tasks at once on a SIGTERM of its own).
RELAYED_AS = signal.SIGTERM

_relayed_from: Path | None = None


def relay_stop_signal_from(path: Path | None) -> None:
    """The signal the head relays (SIGTERM, or the file's "relayed_as") stands for the signal
    named in `path` (written by the head before it relays the stop), when there is one; None:
    every signal stands for itself."""
    global _relayed_from
    _relayed_from = path


def _relayed_name(received: int) -> str:
    """The name of the signal the user sent: `received`, unless the head relayed another."""
    name = signal.Signals(received).name
    if _relayed_from is None:
        return name
    try:
        written = json.loads(_relayed_from.read_text())
        relayed, relayed_as = written["signal"], written.get("relayed_as", RELAYED_AS.name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return name  # no file: the signal came from elsewhere
    names = {s.name for s in STOP_SIGNALS}
    return relayed if relayed in names and name == relayed_as else name


class StopRequest:
    """A context that turns stop signals into a flag while training runs."""

    def __init__(self, ends_process: bool = False) -> None:
        self.ends_process = ends_process  # the process ends with the run (a rank's)
        self._received: int | None = None
        self._name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self._received is not None

    @property
    def signal_name(self) -> str | None:
        """The stop signal's name (the one the user sent the head, where it relayed one), read
        when first asked: after the stop is agreed, never inside the signal handler."""
        if self._received is None:
            return None
        if self._name is None:
            self._name = _relayed_name(self._received)
        return self._name

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        if self._received is None:  # the first one asked to stop
            self._received = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # else: no handlers allowed
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            # After a stop, a process that ends with the run only writes the stop's summary: a
            # repeated request (srun passing on the head's SIGUSR1 after Slurm's own SIGTERM
            # reached the rank) is the same stop, and must not kill it with the default action
            # before it says so. Ctrl-C still interrupts. A process that goes on (a run in a
            # caller's process) gets its own handlers back.
            stopping = self.ends_process and self.requested and signum != signal.SIGINT
            signal.signal(signum, signal.SIG_IGN if stopping else handler)
        self._previous.clear()
