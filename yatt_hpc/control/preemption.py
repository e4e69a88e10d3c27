"""Stop signals, the wall-time deadline, and the requeue decision.

    flag = StopFlag.install()                  # SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT only set a flag
    stop = world.comm.allreduce(flag.reason_code(), op=MPI.MAX)      # agreed at a step boundary
    decision = decide_requeue(reason, restarts, max_requeues, in_slurm)

Handlers never save or exit by themselves: a save from inside a signal handler would race the
step that was interrupted. The controllers agree at the next step boundary, save, and the leader
acts on a pure `Decision` (and logs its reason).
"""
from __future__ import annotations

import signal
from dataclasses import dataclass

NONE, DEADLINE, SIGNAL = 0, 1, 2
REASONS = {NONE: "none", DEADLINE: "wall-time deadline", SIGNAL: "stop signal"}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None

    @classmethod
    def install(cls) -> StopFlag:
        flag = cls()
        for sig in STOP_SIGNALS:
            signal.signal(sig, flag._handle)
        return flag

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    def reason_code(self) -> int:
        return SIGNAL if self.signum is not None else NONE


def past_deadline(now: float, end_time: float | None, step_seconds: float, save_seconds: float,
                  margin: float = 1.5) -> bool:
    """True when one more step plus a save might not finish before the job's end time."""
    if end_time is None or step_seconds <= 0:
        return False
    return now + margin * (step_seconds + save_seconds) >= end_time


@dataclass(frozen=True)
class Decision:
    requeue: bool
    reason: str


def decide_requeue(stop_reason: int, restarts: int, max_requeues: int, in_slurm: bool) -> Decision:
    """Whether the leader should requeue the job after saving, and why (or why not)."""
    why = REASONS[stop_reason]
    if not in_slurm:
        return Decision(False, f"{why} outside Slurm: saved; run the same command again to resume")
    if restarts >= max_requeues:
        return Decision(False, f"{why}: already restarted {restarts} times (slurm.max_requeues={max_requeues}); "
                               "not requeueing: resubmit to continue")
    return Decision(True, f"{why}: requeue {restarts + 1} of at most {max_requeues}")
