"""The pace of a rank's work: what a collective's deadline derives from.

A collective that has waited far longer than this rank's work between meetings with its peers
ever took is stuck: a peer hung, or died unseen. The work's owner (the training loop) says what
the rank is doing (`begin_step`, `begin` for anything else: start-up, evaluation, a
checkpoint...) and which steps end a round: the stretch from one meeting of every rank it may
wait for to the next (each step when the replicas exchange every step; every τ-th when they
meet every τ steps; each step, within its replica, when they never meet). A rank waits at most
one round for a slower peer, so `deadline` gives a collective inside training steps
`ROUND_FACTOR` × the slowest round timed so far, at least `FLOOR_S`, at most the cap (the
user's setting). Everything else, where one occurrence is no guide to the next, gets the cap:
start-up, evaluation, checkpoints, the end, the first rounds (they warm up), and the round right
after any of these (a peer may still be finishing it while this rank already waits in the step).

Written by the thread that does the work, read by the watchdog's (`runner.core.watchdog`): no
lock; a deadline is only acted on long after the last write, while that thread waits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

FLOOR_S = 30.0  # a healthy step that stalls (a busy machine, a slow disk) must not end the job
ROUND_FACTOR = 5.0
TIMED_ROUNDS = 3  # rounds timed before their pace is trusted
STEP = "step"


@dataclass(frozen=True)
class Deadline:
    """How long a collective may wait, and how that was derived (for the failure's one line)."""

    seconds: float
    how: str


class Pace:
    """What this rank is doing now, and the slowest round of training steps timed so far."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.phase = "start-up"
        self.step: int | None = None
        self.rounds = 0  # rounds timed
        self.slowest_s = 0.0
        self.steps_per_round = 1  # the most steps a timed round took
        self.floor_s = FLOOR_S  # the least derived deadline (`debug.deadline_floor_s` lowers it)
        self._clock = clock
        self._round_began: float | None = None  # None: the round in progress is not timed
        self._round_steps = 0
        self._ends_round = False
        self._after = "start-up"  # the last phase other than steps

    def begin_step(self, step: int, ends_round: bool = True) -> None:
        """Step `step` begins; `ends_round`: its collectives meet every rank this one may wait
        for (the next step starts the next round)."""
        now = self._clock()
        was_step, ended = self.phase == STEP, self._ends_round
        self._close(now)
        if not was_step:
            self._round_began, self._round_steps = None, 0  # right after another phase
        elif ended:
            self._round_began, self._round_steps = now, 0
        self.phase, self.step, self._ends_round = STEP, step, ends_round
        self._round_steps += 1

    def begin(self, phase: str, step: int | None = None) -> None:
        """Something other than a training step begins (`phase` reads after "during": "a
        checkpoint", "evaluation"); `step`: the last step done."""
        self._close(self._clock())
        self.phase, self.step, self._after = phase, step, phase
        self._round_began, self._ends_round = None, False

    def _close(self, now: float) -> None:
        """A timed round that the step now ending closes is counted."""
        if self.phase == STEP and self._ends_round and self._round_began is not None:
            self.rounds += 1
            self.slowest_s = max(self.slowest_s, now - self._round_began)
            self.steps_per_round = max(self.steps_per_round, self._round_steps)

    def where(self) -> str:
        """What the rank is doing, after a collective's name: " in step 8", " during
        evaluation after step 100"."""
        if self.phase == STEP:
            return f" in step {self.step}"
        return f" during {self.phase}" + ("" if self.step is None else f" after step {self.step}")

    def deadline(self, cap_s: float, setting: str) -> Deadline:
        """A collective's deadline now, at most `cap_s` (the user's `setting`)."""
        if self.phase != STEP:
            return Deadline(cap_s, f"{setting}, the deadline outside training steps")
        if self._round_began is None:
            return Deadline(cap_s, f"{setting}, the deadline of the first steps after "
                                   f"{self._after}")
        if self.rounds < TIMED_ROUNDS:
            return Deadline(cap_s, f"{setting}, the deadline until {TIMED_ROUNDS} steps are "
                                   f"timed")
        unit = "step" if self.steps_per_round == 1 else "stretch between the replicas' meetings"
        paced = ROUND_FACTOR * self.slowest_s
        floor = self.floor_s
        derived = floor if paced <= floor else float(math.ceil(paced))  # whole seconds
        rule = (f"the {floor:g} s floor, above {ROUND_FACTOR:g} × the slowest {unit} so far "
                f"({self.slowest_s:.2f} s)" if derived == floor else
                f"{ROUND_FACTOR:g} × the slowest {unit} so far ({self.slowest_s:.2f} s)")
        if derived >= cap_s:
            return Deadline(cap_s, f"{setting}, below {derived:.0f} s: {rule}")
        return Deadline(derived, f"{rule}; at most {setting}={cap_s:g} s")
