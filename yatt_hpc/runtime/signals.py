"""Stop signals only set a flag: handlers never save or exit by themselves.

    flag = StopFlag.install()                  # SIGTERM / SIGUSR1 / SIGUSR2 / SIGINT only set a flag
    code = flag.reason_code()                  # the loop agrees on it at a step boundary (sched.requeue codes)
    flag.wait(0.05)                            # another thread: True once a stop signal arrived
    with flag.children_shielded():             # the controllers start their engines (and engine children)
        controller = build_controller(...)
        flag.reclaim()                         # an engine took SIGTERM or the wakeup fd: ours again, logged

A save from inside a signal handler would race the step that was interrupted. The ranks agree at
the next step boundary, save, and the leader acts on a pure `sched.requeue.Decision`. When a step
outlasts `checkpoint.stop_grace_s`, the stop watchdog (`runtime/stop_watchdog.py`) gives it up
instead; it learns of the signal through `wait`, which works even while the main thread is inside
a long C call (Python runs handlers only between bytecodes of the main thread, but the wakeup fd is
written at once).

Engines contend for the same process state. `sglang.Engine` (sglang/srt/entrypoints/engine.py
`_set_envs_and_config`, managers/tokenizer_manager.py `auto_create_handle_loop`) installs a SIGQUIT
handler at start (a failing child sends it; it SIGKILLs the process tree), forces the multiprocessing
start method to `spawn` for the whole process and, on its first request, registers SIGTERM on its
event loop: drain the requests, then SIGKILL its children and this process. `SGLangEngine` takes
SIGTERM back off that loop, and `reclaim()` re-installs this flag's handlers over any engine's. The
stop signals also reach an engine's children: Slurm signals every process of the step (the SIGTERM of
a preemption or time limit, srun forwarding a signal, `scancel --signal` without `-b`), mpirun each
rank's process group, and a child dead of the default action makes SGLang's subprocess watchdog take
the rank down. So the worker builds the controllers inside `children_shielded()` and reclaims before
the block lifts.
"""
from __future__ import annotations

import contextlib
import logging
import select
import signal
import socket
import time
from collections.abc import Iterator

from yatt_hpc.sched.requeue import NONE, SIGNAL

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
log = logging.getLogger(__name__)


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self.since: float | None = None  # time.monotonic() of the first stop signal
        self._wakeup: socket.socket | None = None
        self._wakeup_fd = -1  # the write end the interpreter's C-level handler writes signal numbers to

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
        flag._wakeup_fd = writer.detach()
        signal.set_wakeup_fd(flag._wakeup_fd, warn_on_full_buffer=False)
        return flag

    def reclaim(self) -> list[str]:
        """Main thread only: re-install this flag's handlers and wakeup fd over whatever replaced them
        (an engine's SIGTERM handler, asyncio's wakeup fd); log and return what had been replaced."""
        replaced = []
        for sig in STOP_SIGNALS:
            before = signal.signal(sig, self._handle)
            if before != self._handle:
                replaced.append(f"{signal.Signals(sig).name} (was {_describe(before)})")
        if self._wakeup_fd >= 0:
            before_fd = signal.set_wakeup_fd(self._wakeup_fd, warn_on_full_buffer=False)
            if before_fd != self._wakeup_fd:
                replaced.append(f"the signal wakeup fd (was {before_fd})")
        if replaced:
            log.warning("stop signals: the controllers' engines had replaced %s; the rank's stop flag handles "
                        "them again", ", ".join(replaced))
        else:
            log.info("stop signals: handlers and wakeup fd intact after the controllers started")
        return replaced

    @staticmethod
    @contextlib.contextmanager
    def children_shielded() -> Iterator[None]:
        """Main thread: block the stop signals while the block runs. Every process started meanwhile
        (an engine's scheduler and detokenizer, their children) inherits the block through fork and
        exec, so a signal sent to every process of the step cannot kill it by its default action;
        this process gets a signal that arrived meanwhile as the block lifts (pending, not lost).
        The price: such a child never acts on a stop signal, so `Process.terminate()` (SIGTERM) cannot
        stop it; engines shut theirs down with SIGKILL (SGLang's kill_process_tree), and so must any other."""
        from multiprocessing import resource_tracker

        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        # The first spawn starts multiprocessing's resource tracker, which then unblocks SIGINT and
        # SIGTERM in the calling thread (resource_tracker.ensure_running): start it here, block again.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            held = signal.pthread_sigmask(signal.SIG_SETMASK, before)
            if lost := [sig.name for sig in STOP_SIGNALS if sig not in held]:
                log.warning("stop signals: something unblocked %s while the controllers started; a child "
                            "started after that dies of it", ", ".join(lost))

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


def _describe(handler) -> str:
    if handler in (signal.SIG_DFL, signal.SIG_IGN):
        return signal.Handlers(handler).name
    if handler is None:
        return "a handler installed outside Python"
    name = getattr(handler, "__qualname__", None) or repr(handler)
    return f"{getattr(handler, '__module__', None) or '?'}.{name}"
