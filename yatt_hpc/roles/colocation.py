"""Device memory in turns: a role's engine or model holds the devices only for its own phase.

    with holding_devices(stats, engine, enabled=colocate):   # resume_memory(), then release_memory()
        ...generate...
    hand_over(stats, idle=judge, active=engine)              # a pool rank switching roles

In full colocation rollout, GenRM and training take the same devices in turn; in a dynamic split
a pool rank parks the engine of the role it does not serve. Each resume and release is timed as
the `resume` / `release` phase of the rank's stats. `thing` is anything with `resume_memory()` and
`release_memory()` (an engine, the judge, the trainer's policy); None (no judge) is skipped.

On CPU the cores are the devices: `share_cores(world)` (the worker calls it once) makes a rank that
takes the devices also take the node's cores (torch threads = the node's cores / the ranks of its
group on the node) and give them back on release; outside full colocation, or on GPUs, each rank
keeps `placement.<group>.cpus_per_task` threads throughout.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreShare:
    """torch threads of a rank: `active` while its phase holds the devices, `idle` otherwise."""

    idle: int
    active: int


_SHARE = CoreShare(1, 1)


def core_share(world, environ: Mapping[str, str], usable_cores: int, on_cpu: bool) -> CoreShare:
    """The threads of this rank's phases. `usable_cores`: the cores this process may run on (its
    affinity); the node's are SLURM_CPUS_ON_NODE in an allocation, else the same."""
    group = world.plan.group(world.group)
    idle = group.cpus_per_task
    if world.plan.mode != "colocate" or not on_cpu:
        return CoreShare(idle, idle)
    node_cores = int(environ.get("SLURM_CPUS_ON_NODE") or usable_cores)
    return CoreShare(idle, max(idle, min(usable_cores, node_cores // group.tasks_per_node)))


def share_cores(world, on_cpu: bool) -> CoreShare:
    """Set this process's share (see the module docstring) and start it idle; returns the share."""
    import torch

    global _SHARE
    _SHARE = core_share(world, os.environ, len(os.sched_getaffinity(0)), on_cpu)
    torch.set_num_threads(_SHARE.idle)
    return _SHARE


def _threads(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def resume(stats, thing) -> None:
    if thing is not None:
        with stats.phase("resume"):
            thing.resume_memory()
        _threads(_SHARE.active)


def release(stats, thing) -> None:
    if thing is not None:
        _threads(_SHARE.idle)
        with stats.phase("release"):
            thing.release_memory()


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
