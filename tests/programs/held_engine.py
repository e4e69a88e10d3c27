"""A test-only engine wrapper that makes a step long by construction: it holds the first rollout on fresh weights.

    YATT_TEST_ENGINE_WRAPPER=tests.programs.held_engine:HeldEngine YATT_TEST_ENGINE_DIR=DIR yatt-hpc run ...

A stop-grace test needs a step still running `checkpoint.stop_grace_s` after the stop signal. A step
that is long by its size is long only on a slow enough machine (the Slurm requeue test's 64 x 16
samples took 0.73 s here once the engine got faster, under its 1 s grace); this one cannot end by
itself. The configured engine does the work until a rollout rank has taken the trainer's weights
once (weight version 1: the end of step 1, as rollout ranks take fresh weights after generating);
its next `generate` writes DIR/holding (the event a test waits for before it sends the signal) and
blocks until the process ends: the stop watchdog gives the step up and ends the rank. The hold is
bounded (HOLD_LIMIT_S), so a give-up that never comes fails the test instead of hanging it, and
`abort` does not end it (the step must stay long). An engine built while DIR/holding exists does
not hold: a requeued or resumed run in the same DIR runs through. The judge's engine never takes
weights, so it never holds.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from yatt_hpc.rollout.engine import BaseEngine

DIR_ENV = "YATT_TEST_ENGINE_DIR"
HOLD_LIMIT_S = 300.0
log = logging.getLogger(__name__)


def holding_marker(directory: str | Path) -> Path:
    """The file a held engine writes when it starts holding (what the test waits for)."""
    return Path(directory) / "holding"


class HeldEngine(BaseEngine):
    def __init__(self, inner: BaseEngine) -> None:
        self.inner = inner
        self._marker = holding_marker(os.environ[DIR_ENV])
        self._armed = not self._marker.exists()
        log.warning("held stand-in engine: %s", "armed: the first rollout on fresh weights holds until the "
                    "rank is stopped" if self._armed else f"{self._marker} exists: runs through")

    @property
    def reports_while_decoding(self) -> bool:
        return self.inner.reports_while_decoding

    def generate(self, requests, on_result=None, on_step=None):
        if self._armed and self.inner.weight_version >= 1:
            self._hold()
        return self.inner.generate(requests, on_result, on_step)

    def _hold(self) -> None:
        self._marker.parent.mkdir(parents=True, exist_ok=True)
        self._marker.write_text(f"{os.getpid()}\n")
        log.warning("held stand-in engine: holding this rollout (weights version %d) until the rank is stopped",
                    self.inner.weight_version)
        threading.Event().wait(HOLD_LIMIT_S)
        raise RuntimeError(f"held stand-in engine: nothing stopped this rank within {HOLD_LIMIT_S:g} s of the hold")

    def abort(self) -> None:
        self.inner.abort()

    def update_weights(self, named_tensors, *, final: bool, version: int | None = None) -> None:
        self.inner.update_weights(named_tensors, final=final, version=version)

    def join_weight_group(self, rendezvous) -> None:
        self.inner.join_weight_group(rendezvous)

    def update_weights_from_group(self, manifest, *, version: int | None = None) -> None:
        self.inner.update_weights_from_group(manifest, version=version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def release_memory(self) -> None:
        self.inner.release_memory()

    def resume_memory(self) -> None:
        self.inner.resume_memory()

    def shutdown(self) -> None:
        self.inner.shutdown()
