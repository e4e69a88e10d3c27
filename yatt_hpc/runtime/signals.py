"""Stop signals only set a flag: handlers never save or exit by themselves.

    flag = StopFlag.install()                  # SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT only set a flag
    code = flag.reason_code()                  # the loop agrees on it at a step boundary (sched.requeue codes)
    flag.wait(0.05)                            # another thread: True once a stop signal arrived

A save from inside a signal handler would race the step that was interrupted. The ranks agree at
the next step boundary, save, and the leader acts on a pure `sched.requeue.Decision`. When a step
outlasts `checkpoint.stop_grace_s`, the stop watchdog (`runtime/stop_watchdog.py`) gives it up
instead; it learns of the signal through `wait`, which works even while the main thread is inside
a long C call (Python runs handlers only between bytecodes of the main thread, but the wakeup fd is
written at once).
"""
from __future__ import annotations

import select
import signal
import socket
import time

from yatt_hpc.sched.requeue import NONE, SIGNAL

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
