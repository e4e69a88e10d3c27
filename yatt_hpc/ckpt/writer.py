"""What a rank hands to a save, its host-memory snapshot, and the one-slot background writer.

    staging = Staging()
    snap = snapshot(rank_state, staging)      # the only part the training loop waits for
    writer = BackgroundWriter()
    writer.submit(lambda: write_everything(snap))   # waits for the previous job first
    writer.wait()                              # re-raises the job's error, if any

The staging buffers are allocated once and reused by every save, so a snapshot is a plain memcpy
into memory that is already faulted in (pinned when the source is on a GPU). Reuse is safe because
at most one save is in flight: ``submit`` waits for the previous job before the next snapshot.
"""
from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from yatt_hpc.ckpt.rng import RngState

if TYPE_CHECKING:  # torch is imported where tensors are copied: a rank without tensors never needs it
    import torch

    StateDict = dict[str, torch.Tensor]


@dataclass
class RankState:
    """One rank's part of a checkpoint. Every field is optional except the identity.

    ``identity`` is the rank's global identity, stable across restarts with the same layout, e.g.
    ``trainer/dp1/tp0/pp0``, ``rollout/r0``. ``coords`` names the shard (``tp``, ``pp``, ``dp``).
    Pass ``model`` only on the rank that writes that shard's parameters (dp-rank 0 of the shard);
    pass ``optim`` on every rank that owns optimizer state. Rollout/GenRM ranks pass just ``rng``.
    """

    identity: str
    coords: dict[str, int] = field(default_factory=dict)
    model: StateDict | None = None
    optim: StateDict | None = None
    optim_meta: dict[str, str] = field(default_factory=dict)
    rng: RngState | None = None
    data_position: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class Staging:
    """Reusable host buffers, one per (slot, tensor name); re-allocated only when a shape changes."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def copy(self, slot: str, tensors: StateDict) -> StateDict:
        import torch

        out = {}
        any_cuda = False
        for name, src in tensors.items():
            src = src.detach()
            key = (slot, name)
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self._buffers[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            any_cuda |= src.is_cuda
            out[name] = buf
        if any_cuda:
            torch.cuda.synchronize()
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _host_view(tensors: StateDict) -> StateDict:
    """Synchronous path: CPU tensors as they are (made contiguous), device tensors copied to CPU.

    Tensors sharing storage (tied weights) are cloned: safetensors refuses aliased tensors.
    """
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        key = t.untyped_storage().data_ptr() if t.numel() else None
        if key is not None and key in seen:
            t = t.clone()
        seen.add(key)
        out[name] = t
    return out


def _copy_tree(tree: dict[str, Any]) -> dict[str, Any]:
    torch = sys.modules.get("torch")

    def one(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: one(v) for k, v in value.items()}
        if torch is not None and isinstance(value, torch.Tensor):
            return value.detach().cpu().clone()
        if isinstance(value, np.ndarray):
            return value.copy()
        return copy.copy(value)

    return one(tree)


def snapshot(state: RankState, staging: Staging | None) -> RankState:
    """A copy of ``state`` that the caller may mutate freely afterwards (staging=None: no copy of CPU tensors)."""
    def tensors(slot: str, sd: StateDict | None) -> StateDict | None:
        if sd is None:
            return None
        return staging.copy(slot, sd) if staging is not None else _host_view(sd)

    return replace(state, coords=dict(state.coords), model=tensors("model", state.model),
                   optim=tensors("optim", state.optim), optim_meta=dict(state.optim_meta),
                   rng=copy.deepcopy(state.rng), data_position=_copy_tree(state.data_position),
                   extra=_copy_tree(state.extra))


class BackgroundWriter:
    """Runs at most one job at a time in a non-daemon thread (so interpreter exit waits for it)."""

    def __init__(self, name: str = "ckpt-writer") -> None:
        self._name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as err:  # noqa: BLE001 - handed to the caller at wait()
                self._error = err

        self._thread = threading.Thread(target=run, name=self._name, daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the in-flight job is done; re-raise its error once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err
