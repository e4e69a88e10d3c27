"""A test-only engine wrapper that makes a step long by construction: it holds one rollout until an event.

    YATT_TEST_ENGINE_WRAPPER=tests.programs.held_engine:HeldEngine YATT_TEST_ENGINE_DIR=DIR yatt-hpc run ...
    (optional) YATT_TEST_HOLD_AT_VERSION=6 YATT_TEST_HOLD_UNTIL=signal

A test that stops a run in a step needs that step still running when the stop arrives. A step long by
its size is long only on a slow enough machine (the Slurm requeue test's 64 x 16 samples took 0.73 s
here once the engine got faster, under its 1 s grace; a preemption that had 14 steps of ~0.09 s to
land in landed with 7 to spare); this one cannot end by itself. The configured engine does the work
until it serves weight version YATT_TEST_HOLD_AT_VERSION (default 1: the end of step 1, as rollout
ranks take fresh weights after generating, so in a fresh run version N is step N+1's rollout; a
resumed run's engine first takes the restored weights as version 1); that `generate` writes
DIR/holding (the event a test waits for before it stops the run) and holds:

* until the process ends (YATT_TEST_HOLD_UNTIL=stopped, the default): the stop watchdog gives the step
  up and ends the rank (tests of checkpoint.stop_grace_s);
* until this rank's stop flag is set (=signal): then the rollout runs and the step ends, so the run
  stops at that step's boundary as any signalled run does (preemption, cancel);
* until the test writes DIR/release (=released, `release(DIR)`): a fault test kills or stops a rank of
  a run that cannot have ended, then lets the others go on (a hold far shorter than a stall timeout).

Whichever the end, the hold is bounded (HOLD_LIMIT_S), so an event that never comes fails the test instead of
hanging it, and `abort` does not end it. An engine built while DIR/holding exists does not hold: a
requeued or resumed run in the same DIR runs through. The judge's engine never takes weights, so it
never holds. Holding changes no number: a held run's weights are those of a run never held.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from tests.programs.wrapped_engine import DIR_ENV, WrappedEngine
from yatt_hpc.rollout.engine import TEST_WRAPPER_ENV
from yatt_hpc.runtime.signals import StopFlag

AT_VERSION_ENV = "YATT_TEST_HOLD_AT_VERSION"
UNTIL_ENV = "YATT_TEST_HOLD_UNTIL"
UNTIL = {"stopped": "the rank is stopped", "signal": "the rank's stop signal", "released": "the test releases it"}
HOLD_LIMIT_S = 300.0
log = logging.getLogger(__name__)


def held_env(directory: str | Path, until: str = "stopped", at_version: int = 1) -> dict[str, str]:
    """The environment that wraps a run's engines in `HeldEngine`: the rollout on weights version
    `at_version` (step at_version + 1) holds until `until` (see the module docstring)."""
    return {TEST_WRAPPER_ENV: "tests.programs.held_engine:HeldEngine", DIR_ENV: str(directory),
            UNTIL_ENV: until, AT_VERSION_ENV: str(at_version)}


def holding_marker(directory: str | Path) -> Path:
    """The file a held engine writes when it starts holding (what the test waits for)."""
    return Path(directory) / "holding"


def release(directory: str | Path) -> None:
    """End the holds of engines held `until="released"` in `directory`."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "release").write_text("go\n")


def _stop_flag() -> StopFlag:
    """The rank's stop flag: the owner of the SIGTERM handler the worker installed."""
    flag = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if not isinstance(flag, StopFlag):
        raise RuntimeError("held stand-in engine: no stop flag handles SIGTERM in this process")
    return flag


class HeldEngine(WrappedEngine):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self._marker = holding_marker(os.environ[DIR_ENV])
        self._at_version = int(os.environ.get(AT_VERSION_ENV, "1"))
        self._until = os.environ.get(UNTIL_ENV, "stopped")
        if self._until not in UNTIL:
            raise ValueError(f"{UNTIL_ENV}={self._until!r}: one of {', '.join(UNTIL)}")
        self._armed = not self._marker.exists()
        log.warning("held stand-in engine: %s", f"armed: the rollout on weights version {self._at_version} holds "
                    f"until {UNTIL[self._until]}" if self._armed else f"{self._marker} exists: runs through")

    def generate(self, requests, on_result=None, on_step=None):
        if self._armed and self.inner.weight_version >= self._at_version:
            self._armed = False
            self._hold()
        return super().generate(requests, on_result, on_step)

    def _hold(self) -> None:
        flag = _stop_flag() if self._until == "signal" else None
        released = self._marker.parent / "release"
        self._marker.parent.mkdir(parents=True, exist_ok=True)
        self._marker.write_text(f"{os.getpid()}\n")
        log.warning("held stand-in engine: holding this rollout (weights version %d) until %s",
                    self.inner.weight_version, UNTIL[self._until])
        if self._until == "stopped":
            threading.Event().wait(HOLD_LIMIT_S)
        else:
            def ended() -> bool:
                return flag.signum is not None if flag is not None else released.exists()

            deadline = time.monotonic() + HOLD_LIMIT_S
            while not ended() and time.monotonic() < deadline:
                time.sleep(0.02)  # a signal cuts the sleep short; its handler sets the flag
            if ended():
                log.warning("held stand-in engine: %s; the rollout runs",
                            f"signal {flag.signum} arrived" if flag is not None else "released")
                return
        raise RuntimeError(f"held stand-in engine: no end to the hold ({UNTIL[self._until]}) within {HOLD_LIMIT_S:g} s")
