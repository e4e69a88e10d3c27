"""How a rank's stop flag fares against an engine that starts like SGLang (tests/unit/test_spawn_safety.py).

    YATT_TEST_ENGINE_DIR=DIR python -m tests.programs.signal_probe reclaim      # prints one JSON line
    YATT_TEST_ENGINE_DIR=DIR python -m tests.programs.signal_probe unguarded    # dies of SIGKILL

`reclaim` does what the worker does: install the stop flag, build the engine (the spawning stand-in
around an engine that does nothing) inside `children_shielded()`, SIGUSR2 itself there, reclaim;
then it signals the engine's child and itself and reports what happened. `unguarded` builds the same
engine with neither, then SIGTERMs itself: the engine's handler kills the child and the process, the
fate of a rank that does not reclaim.
"""
import json
import os
import signal
import sys


def pending_and_blocked(pid: int) -> dict[str, list[str]]:
    """The signals pending for process `pid` (ShdPnd) and those its main thread blocks (SigBlk)."""
    fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    names = {}
    for key in ("ShdPnd", "SigBlk"):
        mask = int(fields[key], 16)
        names[key] = sorted(signal.Signals(n).name for n in range(1, 65) if mask >> (n - 1) & 1
                            and n in signal.valid_signals())
    return names


def build_engine():
    from tests.programs.spawning_engine import SpawningEngine
    from yatt_hpc.rollout.engine import BaseEngine

    class IdleEngine(BaseEngine):
        weight_version = 0

        def generate(self, requests, on_result=None, on_step=None):
            return []

        def abort(self): ...
        def update_weights(self, named_tensors, *, final, version=None): ...
        def release_memory(self): ...
        def resume_memory(self): ...
        def shutdown(self): ...

    return SpawningEngine(IdleEngine())


def reclaim() -> None:
    from yatt_hpc.runtime.signals import StopFlag

    flag = StopFlag.install()
    with flag.children_shielded():
        engine = build_engine()
        os.kill(os.getpid(), signal.SIGUSR2)
        during = flag.signum
        replaced = flag.reclaim()
    after_shield = flag.signum
    wakeup = signal.set_wakeup_fd(flag._wakeup_fd)
    child = engine._child.pid
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        os.kill(child, sig)
    child_state = pending_and_blocked(child)
    flag.signum = None
    os.kill(os.getpid(), signal.SIGTERM)
    print(json.dumps({"replaced": replaced, "during_shield": during, "after_shield": after_shield,
                      "wakeup_is_ours": wakeup == flag._wakeup_fd, "after_sigterm": flag.signum,
                      "child": child, "child_alive": engine._child.is_alive(), **child_state}), flush=True)
    engine.shutdown()


def unguarded() -> None:
    build_engine()
    print("engine started", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("survived SIGTERM", flush=True)


if __name__ == "__main__":
    {"reclaim": reclaim, "unguarded": unguarded}[sys.argv[1]]()
