"""The base of the test-only engine wrappers (`YATT_TEST_ENGINE_WRAPPER`): every engine call goes to the wrapped engine.

A wrapper (tests/programs/spawning_engine.py, held_engine.py) overrides only what it changes; the
configured engine does the work.
"""
from __future__ import annotations

from yatt_hpc.rollout.engine import BaseEngine

DIR_ENV = "YATT_TEST_ENGINE_DIR"
"""The directory a wrapper reports to (a spawned child's report, a hold's files)."""


class WrappedEngine(BaseEngine):
    def __init__(self, inner: BaseEngine) -> None:
        self.inner = inner

    @property
    def reports_while_decoding(self) -> bool:
        return self.inner.reports_while_decoding

    def generate(self, requests, on_result=None, on_step=None):
        return self.inner.generate(requests, on_result, on_step)

    def abort(self) -> None:
        self.inner.abort()

    def update_weights(self, named_tensors, *, final: bool, version: int | None = None) -> None:
        self.inner.update_weights(named_tensors, final=final, version=version)

    def take_weights(self, named_tensors, *, final: bool, version: int | None = None) -> None:
        self.inner.take_weights(named_tensors, final=final, version=version)

    def join_weight_group(self, rendezvous) -> None:
        self.inner.join_weight_group(rendezvous)

    def update_weights_from_group(self, manifest, *, version: int | None = None) -> None:
        self.inner.update_weights_from_group(manifest, version=version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def release_memory(self) -> None:
        self.inner.release_memory()

    def drop_weights(self) -> int:
        return self.inner.drop_weights()

    def resume_memory(self) -> None:
        self.inner.resume_memory()

    def shutdown(self) -> None:
        self.inner.shutdown()
