"""Device memory in turns: a role's engine or model holds the devices only for its own phase.

    with holding_devices(stats, engine, enabled=colocate):   # resume_memory(), then release_memory()
        ...generate...
    hand_over(stats, idle=judge, active=engine)              # a pool rank switching roles

In full colocation rollout, GenRM and training take the same devices in turn; in a dynamic split
a pool rank parks the engine of the role it does not serve. Each resume and release is timed as
the `resume` / `release` phase of the rank's stats. `thing` is anything with `resume_memory()` and
`release_memory()` (an engine, the judge, the trainer's policy); None (no judge) is skipped.

On CPU the cores are the devices: in full colocation a rank that resumes also takes its share of
the node's cores as torch threads and gives them back on release (`Plan.phase_threads`, from
`placement.node_cpus`; the worker calls `set_phase_threads` once). The counts come from the config
alone, never from the machine, so a run's numbers do not depend on how it was launched.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from yatt_hpc.runtime.allocator import give_back_freed_memory

_THREADS = (0, 0)  # (idle, active) torch threads; 0: leave torch's setting alone (tests, tools)


def set_phase_threads(idle: int, active: int) -> None:
    """This rank's torch threads outside and inside its colocated phase; starts idle."""
    global _THREADS
    _THREADS = (idle, active)
    _threads(idle)


def _threads(n: int) -> None:
    if not n:
        return
    torch = sys.modules.get("torch")
    if torch is None:  # not imported yet (or never, on a rank scoring by rule only): torch starts with n
        os.environ["OMP_NUM_THREADS"] = str(n)
    elif torch.get_num_threads() != n:
        torch.set_num_threads(n)


def resume(stats, thing) -> None:
    if thing is not None:
        with stats.phase("resume"):
            thing.resume_memory()
        _threads(_THREADS[1])


def release(stats, thing) -> None:
    if thing is not None:
        _threads(_THREADS[0])
        with stats.phase("release"):
            thing.release_memory()
            give_back_freed_memory()  # host memory in turns too, when the phase freed a lot (runtime/allocator.py)


@contextmanager
def holding_devices(stats, thing, enabled: bool):
    """Resume `thing` on entry and release it on a normal exit, when `enabled` (colocation)."""
    if enabled:
        resume(stats, thing)
    yield
    if enabled:
        release(stats, thing)


def hand_over(stats, idle, active) -> None:
    """The role being left gives its device memory back first, then the new one takes it."""
    release(stats, idle)
    resume(stats, active)
