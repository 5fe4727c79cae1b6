"""When a run ends early: its time budget (``train.max_minutes``) and stop signals, as one part of the engine.

Each step, every rank proposes what it alone would decide (:meth:`RunClock.flags`:
a stop signal caught here, a checkpoint due by ``ckpt.every_minutes``, the
budget used up by rank 0's clock) and :class:`~pointforge.train.step.TrainStep`'s
vote makes that every rank's decision; :meth:`RunClock.note` acts on the vote
and says it once. The training clock counts across launches (a resumed run
starts from the seconds its checkpoint recorded), so a time-based schedule sets
the same learning rate on every rank and after every restart.
"""

from __future__ import annotations

import time

from pointforge.train.dist import DistEnv, StopSignal
from pointforge.train.logs import get_logger
from pointforge.train.step import LocalFlags, Vote

__all__ = ["RunClock"]

log = get_logger("train")


class RunClock:
    """This launch's clock against ``max_minutes``, and what the ranks have agreed about stopping."""

    def __init__(self, env: DistEnv, max_minutes: float | None, seconds_before: float):
        self.env = env
        self.max_minutes = max_minutes
        self.start = time.monotonic()
        self.seconds_before = seconds_before  # the training clock of earlier launches
        self.out_of_time = False
        self.stop_noted = False

    def flags(self, stopper: StopSignal, ckpt_due: bool) -> LocalFlags:
        """What this rank would decide alone; the step's vote makes it every rank's decision."""
        is_main = self.env.is_main
        now = time.monotonic()
        # The budget is rank 0's clock; the reduction carries its decision to every rank.
        time_up = is_main and self.max_minutes is not None and now - self.start >= self.max_minutes * 60
        return LocalFlags(
            stop=bool(stopper.requested),
            ckpt_due=ckpt_due,
            time_up=time_up,
            # Rank 0's training clock; the sum hands it to every rank, so a
            # time-based schedule sets the same LR everywhere.
            train_seconds=self.seconds_before + now - self.start if is_main else 0.0,
        )

    def note(self, vote: Vote, stopper: StopSignal, global_step: int) -> None:
        """Act on (and say once) what the ranks agreed: out of time, or stop requested."""
        if vote.time_up and not vote.stop:
            self.out_of_time = True
            if self.env.is_main:
                log.info(
                    f"time budget of {self.max_minutes:g} min (train.max_minutes) reached at step "
                    f"{global_step}: saving and finishing"
                )
        if vote.stop and not self.stop_noted and self.env.is_main:
            self.stop_noted = True
            log.info(
                f"stop requested ({stopper.requested or 'signal on another rank'}): saving a checkpoint and exiting"
            )
