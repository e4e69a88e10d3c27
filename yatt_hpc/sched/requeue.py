"""The stop reasons, the wall-time deadline, and the requeue decision (pure: no signals, no MPI).

    decision = decide_requeue(reason, restarts, max_requeues, in_slurm)   # Decision(requeue, reason)
    past_deadline(now, end_time, step_seconds, save_seconds)              # one more step would not fit
    stop_record_name(job_id, restart)                                     # RUN_DIR/logs/<name>

The signal half (`StopFlag`) is `runtime/signals.py`; the loop agrees on the reason code at a step
boundary and the leader acts on the `Decision` (and logs its reason).
"""
from __future__ import annotations

from dataclasses import dataclass

NONE, DEADLINE, SIGNAL = 0, 1, 2
REASONS = {NONE: "none", DEADLINE: "wall-time deadline", SIGNAL: "stop signal"}


def stop_record_name(job_id: str | None, restart_count: int) -> str:
    """RUN_DIR/logs/<name>: the leader's stop decision, read by the launcher after the ranks exit."""
    return f"stop_{job_id or 'local'}_{restart_count}.json"


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
