"""What this process's loop thread is doing, for the health monitor: making progress, or waiting on peers.

    from yatt_hpc.metrics.activity import ACTIVITY
    ACTIVITY.progress("decode")                # cheap: a counter and a label (call it often)
    with ACTIVITY.waiting("recv samples"):     # blocked on other ranks, not on itself
        ...

One instance per process (`ACTIVITY`), like the process's signal handlers: the MPI waits in `wire`,
the step loop, the engines' decode loops and the trainer's micro-batches mark it; the health
monitor thread (`runtime/health.py`) only reads it. Marking costs an integer increment and two stores, no lock:
a reader that sees a label one update late is harmless.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class Activity:
    def __init__(self) -> None:
        self.count = 0          # bumped at every progress point
        self.label = "start"    # the last progress point or the wait in progress
        self.waiting_since: float | None = None  # monotonic time a wait on peers began; None = busy
        self.done = False       # the rank's loop is over (it only waits for the others now)

    def progress(self, label: str | None = None) -> None:
        self.count += 1
        if label is not None:
            self.label = label

    @contextmanager
    def waiting(self, label: str):
        outer = self.waiting_since  # nested waits keep the outer start
        before = self.label
        if outer is None:
            self.waiting_since = time.monotonic()
        self.label = label
        try:
            yield
        finally:
            self.waiting_since = outer
            self.label = before if outer is not None else label
            self.count += 1

    @property
    def is_waiting(self) -> bool:
        return self.waiting_since is not None or self.done


ACTIVITY = Activity()
