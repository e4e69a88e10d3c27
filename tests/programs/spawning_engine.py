"""A test-only engine wrapper that starts as `sglang.Engine` does, on CPU: a spawned child, a SIGTERM of its own.

    YATT_TEST_ENGINE_WRAPPER=tests.programs.spawning_engine:SpawningEngine YATT_TEST_ENGINE_DIR=DIR yatt-hpc run ...

The configured engine (the demo's `hf`) does the work; at start this wrapper does to the rank what
SGLang does (read: sglang/srt/entrypoints/engine.py `_set_envs_and_config`, `_launch_subprocesses`;
managers/tokenizer_manager.py `auto_create_handle_loop`, `sigterm_watchdog`; utils `kill_process_tree`):

* sets the multiprocessing start method to `spawn` and starts a child with it, so the child re-runs
  the rank's main module, `yatt_hpc.runtime.worker`, as `__mp_main__` (engine_child.py reports on it
  to DIR/child-<pid>.json);
* takes SIGTERM with a handler that SIGKILLs the child, then the process itself (SGLang drains its
  requests first), and sets a signal wakeup fd of its own, as asyncio's `add_signal_handler` does;
* treats a dead child as fatal, as SGLang's subprocess watchdog does (it SIGQUITs the parent);
* registers its shutdown (SIGKILL to the child) with atexit.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import socket
from pathlib import Path

from tests.programs import engine_child
from tests.programs.wrapped_engine import DIR_ENV, WrappedEngine

log = logging.getLogger(__name__)


class SpawningEngine(WrappedEngine):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        multiprocessing.set_start_method("spawn", force=True)
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        directory = Path(os.environ[DIR_ENV])
        directory.mkdir(parents=True, exist_ok=True)
        self._child = ctx.Process(target=engine_child.serve, name="spawning-engine-child", daemon=True,
                                  args=(child_end, str(directory)))
        self._child.start()
        child_end.close()
        if not self._conn.poll(300):
            raise RuntimeError(f"the engine child {self._child.pid} did not start within 300 s")
        self._conn.recv()
        atexit.register(self.shutdown)
        signal.signal(signal.SIGTERM, self._kill_tree)
        self._wakeup, writer = socket.socketpair()
        for sock in (self._wakeup, writer):
            sock.setblocking(False)
        signal.set_wakeup_fd(writer.detach())
        log.warning("spawning stand-in engine: child %d started (spawn); SIGTERM and the wakeup fd are now "
                    "the engine's", self._child.pid)

    def _kill_tree(self, signum, _frame) -> None:
        log.error("spawning stand-in engine: signal %d: killing the child and this process, as SGLang does", signum)
        self._child.kill()
        os.kill(os.getpid(), signal.SIGKILL)

    def _check_child(self) -> None:
        if not self._child.is_alive():
            raise RuntimeError(f"the engine child {self._child.pid} died (exit code {self._child.exitcode}); "
                               "SGLang's subprocess watchdog would take this rank down")

    def generate(self, requests, on_result=None, on_step=None):
        self._check_child()
        return super().generate(requests, on_result, on_step)

    def update_weights(self, named_tensors, *, final: bool, version: int | None = None) -> None:
        self._check_child()
        super().update_weights(named_tensors, final=final, version=version)

    def take_weights(self, named_tensors, *, final: bool, version: int | None = None) -> None:
        self._check_child()
        super().take_weights(named_tensors, final=final, version=version)

    def join_weight_group(self, rendezvous) -> None:
        self._check_child()
        super().join_weight_group(rendezvous)

    def update_weights_from_group(self, manifest, *, version: int | None = None) -> None:
        self._check_child()
        super().update_weights_from_group(manifest, version=version)

    def resume_memory(self) -> None:
        self._check_child()
        super().resume_memory()

    def shutdown(self) -> None:
        if self._child.is_alive():
            self._child.kill()  # SIGKILL, as kill_process_tree: a shielded child ignores terminate()'s SIGTERM
        self._child.join(timeout=30)
        super().shutdown()
