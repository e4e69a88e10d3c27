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

Host memory goes in turns too (`placement.host_memory=in_turns`, the default): a phase that ends returns what
it freed to the kernel (`give_back_phase_memory`, counted in the rank's `given_back_bytes`), so the next phase's
rank can have it. With `kept` (the worker calls `set_host_memory` once) every rank keeps its heap.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from yatt_hpc.runtime.allocator import GIVE_BACK_BYTES, give_back_freed_memory

_THREADS = (0, 0)  # (idle, active) torch threads; 0: leave torch's setting alone (tests, tools)
_IN_TURNS = True  # placement.host_memory=in_turns: a phase's freed host memory goes back to the kernel as it ends


def set_phase_threads(idle: int, active: int) -> None:
    """This rank's torch threads outside and inside its colocated phase; starts idle."""
    global _THREADS
    _THREADS = (idle, active)
    _threads(idle)


def set_host_memory(in_turns: bool) -> None:
    """Whether this rank gives the host memory a phase freed back to the kernel when the phase ends."""
    global _IN_TURNS
    _IN_TURNS = in_turns


def give_back_phase_memory(stats, at_least: int = GIVE_BACK_BYTES) -> int:
    """At the end of a phase, host memory in turns: the rank's free heap back to the kernel when it holds at least
    `at_least` bytes (`runtime/allocator.py`); returns the free bytes it held. What left the process (its
    resident size before less after) is added to the rank's `given_back_bytes`. 0 and nothing done with
    `placement.host_memory=kept`."""
    if not _IN_TURNS:
        return 0
    before = _resident()
    returned = give_back_freed_memory(at_least)
    if returned:
        stats.add("given_back_bytes", max(0, before - _resident()))
    return returned


def _resident() -> int:
    """This process's resident bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
            give_back_phase_memory(stats)  # host memory in turns too, when the phase freed a lot


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
