"""Python's cyclic garbage collector sits out a rank's start-up; what start-up built is frozen out of its scans.

    pause_during_startup()       # first thing a rank does (runtime/worker.py main)
    said = resume_after_startup()  # before the first step: collector on again, start-up's objects frozen

Why: a rank's start-up is imports (torch, Megatron-Core, transformers) and a model build, some 300k
long-lived objects. The collector runs a generation each time 700 more objects were allocated than
freed, and every full collection walks all of them again: measured here, importing torch and
Megatron-Core takes 2.75 s with the collector on and 2.20 s with it off (1.45 -> 1.26 s for torch
alone). On a CPU box whose ranks share the cores, every rank's start-up CPU is on the first step's
critical path.

`gc.freeze()` then moves everything start-up left into a permanent generation that later collections
skip: the step loop's collections walk what the steps allocate, not the imported modules. The price:
reference cycles that start-up dropped are never freed; a full `gc.collect()` to free them would cost
0.15-0.25 s of CPU per rank of the same start-up. What they are, measured (gc.DEBUG_SAVEALL just
before the freeze, every rank of demo_cpu, partial_cpu, disjoint_cpu and demo_vlm_cpu): 7-12k objects
per rank, all of them the imports' own (tuples, closures' cells, functions, typing aliases, a few
dozen frames), and not one tensor or array; the model build and weight loading leave none. Reference
counting, which frees everything not in a cycle (tensors included), runs throughout. A process whose
collector was already off (the user's own `gc.disable()`) keeps it off.
"""
from __future__ import annotations

import gc

_was_enabled: bool | None = None


def pause_during_startup() -> None:
    """Turn the cyclic collector off until `resume_after_startup`; remembers whether it was on."""
    global _was_enabled
    if _was_enabled is None:
        _was_enabled = gc.isenabled()
    gc.disable()


def resume_after_startup() -> str:
    """Freeze what start-up built and turn the collector back on if `pause_during_startup` found it on;
    returns a line for the rank's log."""
    global _was_enabled
    was_enabled, _was_enabled = _was_enabled, None
    gc.freeze()
    frozen = gc.get_freeze_count()
    if not was_enabled:
        return f"start-up's {frozen:,} objects frozen; the cyclic collector left off, as it was"
    gc.enable()
    return f"start-up ran without the cyclic collector; its {frozen:,} objects are frozen out of later collections"
