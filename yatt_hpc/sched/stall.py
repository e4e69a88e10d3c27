"""The stall rule (pure): which rank, if any, the leader names as stalled, from what it heard.

    stall = find_stall(now, {rank: RankView(last_heard, last_progress, ...)}, timeout_s)

  * silent: a rank whose heartbeat the leader has not heard for `timeout_s` (stopped, frozen);
  * stuck: no rank progressed for `timeout_s` and some rank is busy (not waiting on peers): the
    busy rank whose progress stopped first (a hung engine, library or I/O call);
  * deadlock: no rank progressed and every rank waits on the others: the one waiting longest.

`runtime/health.py` feeds it from the heartbeats and acts on the answer.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class RankView:
    """What the leader knows of one rank, on the leader's clock."""

    last_heard: float
    last_progress: float
    count: int = -1
    waiting: bool = False
    done: bool = False
    label: str = "start"


@dataclass(frozen=True)
class Stall:
    rank: int
    kind: str  # "silent" | "stuck" | "deadlock"
    seconds: float
    cause: str


def find_stall(now: float, views: Mapping[int, RankView], timeout_s: float) -> Stall | None:
    """The leader's rule (pure): a silent rank first, then a world that made no progress."""
    silent = {r: now - v.last_heard for r, v in views.items() if now - v.last_heard > timeout_s}
    if silent:
        rank = max(silent, key=lambda r: (silent[r], -r))
        return Stall(rank, "silent", silent[rank],
                     f"no heartbeat for {silent[rank]:.0f}s (last seen in '{views[rank].label}'): the process is "
                     "stopped (SIGSTOP), frozen, or inside a call that holds the Python interpreter lock")
    idle = {r: now - v.last_progress for r, v in views.items()}
    if not views or min(idle.values()) <= timeout_s:
        return None
    busy = [r for r, v in views.items() if not (v.waiting or v.done)]
    if busy:
        rank = max(busy, key=lambda r: (idle[r], -r))
        return Stall(rank, "stuck", idle[rank],
                     f"no progress for {idle[rank]:.0f}s in '{views[rank].label}' while every other rank waits "
                     "(a hung engine, library or I/O call)")
    rank = max(views, key=lambda r: (idle[r], -r))
    waits = ", ".join(f"{r}: '{v.label}'" for r, v in sorted(views.items()))
    return Stall(rank, "deadlock", idle[rank],
                 f"every rank has waited on the others for {min(idle.values()):.0f}s: a deadlock (ranks wait in {waits})")
