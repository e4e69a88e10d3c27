"""Stop signals, the wall-time deadline, and the requeue decision.

    flag = StopFlag.install()                  # SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT only set a flag
    stop = world.comm.allreduce(flag.reason_code(), op=MPI.MAX)      # agreed at a step boundary
    flag.wait(0.05)                            # another thread: True once a stop signal arrived
    decision = decide_requeue(reason, restarts, max_requeues, in_slurm)

Handlers never save or exit by themselves: a save from inside a signal handler would race the
step that was interrupted. The controllers agree at the next step boundary, save, and the leader
acts on a pure `Decision` (and logs its reason). When a step outlasts `checkpoint.stop_grace_s`,
the stop watchdog (`stop_watchdog.py`) gives it up instead; it learns of the signal through
`wait`, which works even while the main thread is inside a long C call (Python runs handlers
only between bytecodes of the main thread, but the wakeup fd is written at once).
"""
from __future__ import annotations

import select
import signal
import socket
import time
from dataclasses import dataclass

NONE, DEADLINE, SIGNAL = 0, 1, 2
REASONS = {NONE: "none", DEADLINE: "wall-time deadline", SIGNAL: "stop signal"}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.since: float | None = None  # time.monotonic() of the first stop signal
        self._wakeup: socket.socket | None = None

    @classmethod
    def install(cls) -> StopFlag:
        """Main thread only: handle the stop signals, and have the interpreter's C-level handler
        write each signal number to a socket that `wait` reads (`signal.set_wakeup_fd`)."""
        flag = cls()
        for sig in STOP_SIGNALS:
            signal.signal(sig, flag._handle)
        flag._wakeup, writer = socket.socketpair()
        flag._wakeup.setblocking(False)
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.detach(), warn_on_full_buffer=False)
        return flag

    def _handle(self, signum, _frame) -> None:
        self.note(signum)

    def note(self, signum: int) -> None:
        """Record a stop signal (the handler, `wait`, or a test); the first one starts the clock."""
        if self.since is None:
            self.since = time.monotonic()
        self.signum = signum

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a stop signal; whether one has arrived (any thread)."""
        if self.signum is None and self._wakeup is not None:
            ready, _, _ = select.select([self._wakeup], [], [], timeout)
            if ready:
                try:
                    seen = self._wakeup.recv(64)
                except BlockingIOError:
                    seen = b""
                for signum in seen:
                    if signum in STOP_SIGNALS:
                        self.note(signum)
        elif self.signum is None:
            time.sleep(timeout)
        return self.signum is not None

    def reason_code(self) -> int:
        return SIGNAL if self.signum is not None else NONE


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
