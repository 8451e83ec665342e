"""SIGINT / SIGTERM / SIGUSR1 as a request to stop: finish the step, checkpoint, exit cleanly.

The head forwards the signal to the job (MPICH's mpiexec passes SIGINT, SIGTERM and SIGUSR1 on to
every rank); a rank only notes it here. Ranks see it at different moments, so the training loop
agrees on when to stop through a collective it already makes each step (the loss all-reduce).
A second signal to a 1-process run (the head trains itself) interrupts at once, as usual.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """A context that turns stop signals into a flag while training runs."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # else: no handlers allowed
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
