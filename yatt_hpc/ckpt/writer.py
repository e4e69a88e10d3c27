"""What a rank hands to a save, its host-memory snapshot, the tensor files, and the one-slot background writer.

    staging = Staging(cap_bytes=2 << 30)
    snap = snapshot(rank_state, staging)      # the only part the training loop waits for ...
    files = [TensorFile(path, snap.model, meta)]
    files[0].write([name for _, name in staging.unstaged])   # ... and the tensors the staging cap left live
    writer = BackgroundWriter()
    writer.submit(lambda: [f.write() for f in files])   # the rest; waits for the previous job first
    writer.wait()                              # re-raises the job's error, if any

The staging buffers are allocated once and reused by every save, so a snapshot is a plain memcpy
into memory that is already faulted in (pinned when the source is on a GPU). Reuse is safe because
at most one save is in flight: ``submit`` waits for the previous job before the next snapshot.

They hold at most ``cap_bytes`` (``checkpoint.staging_mb``): a rank whose tensors are larger stages
what fits, tensor by tensor in order, and writes the others into their files from the live tensors
before the step goes on; the staged ones follow in the background. The files are the same bytes
whatever the cap: a ``TensorFile`` fixes every tensor's offset first and fills them in any order.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from yatt_hpc.ckpt.rng import RngState, capture_rng, restore_rng

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
    critic: StateDict | None = None
    """The value model's parameters (`train.adv_estimator: gae`), like ``model``; its optimizer like ``optim``."""
    critic_optim: StateDict | None = None
    critic_optim_meta: dict[str, str] = field(default_factory=dict)
    rng: RngState | None = None
    data_position: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


class RngOnlyState:
    """The checkpoint part of a rank whose only state is its RNG (a GenRM or rollout rank, a tool rank); a
    controller with more overrides these. It provides `identity`."""

    identity: str

    def light_state(self, step: int) -> dict:
        """RankState fields that change before the optimizer step; cheap (called at every step start)."""
        return {"rng": capture_rng()}

    def checkpoint_state(self, step: int, light: dict | None = None) -> RankState:
        """This rank's part of checkpoint `step`; `light` from the step start, else taken now."""
        return RankState(self.identity, **(light if light is not None else self.light_state(step)))

    def watch_mutations(self, guard) -> None:
        """Call `guard.enter_mutation()` before checkpointed state beyond `light_state` changes."""

    def restore(self, restored) -> None:
        if restored.found:  # a rank the checkpoint's layout did not have keeps the RNG a fresh start seeds
            restore_rng(restored.rng)


class Staging:
    """Reusable host buffers, one per (slot, tensor name), holding at most ``cap_bytes`` in all (None: no
    cap); a buffer is re-allocated only when its tensor's shape changes. `copy` stages the tensors of one
    save in order while they fit; `unstaged` names the others, which the save writes from the live tensors."""

    def __init__(self, cap_bytes: int | None = None) -> None:
        self.cap_bytes = cap_bytes
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._staged: set[tuple[str, str]] = set()
        self._staged_bytes = 0
        self.unstaged: set[tuple[str, str]] = set()

    def begin(self) -> None:
        """A new save: nothing staged yet."""
        self._staged, self._staged_bytes, self.unstaged = set(), 0, set()

    def copy(self, slot: str, tensors: StateDict) -> StateDict:
        """``tensors`` with each one that fits under the cap replaced by its staged copy; the others are
        returned as they are (live) and listed in `unstaged`."""
        import torch

        out = {}
        any_cuda = False
        for name, src in tensors.items():
            src = src.detach()
            key = (slot, name)
            if self.cap_bytes is not None and self._staged_bytes + _nbytes(src) > self.cap_bytes:
                self.unstaged.add(key)
                out[name] = src
                continue
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                self._buffers.pop(key, None)
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self._buffers[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            self._staged.add(key)
            self._staged_bytes += _nbytes(buf)
            any_cuda |= src.is_cuda
            out[name] = buf
        for key in [k for k in self._buffers if k[0] == slot and k not in self._staged]:
            del self._buffers[key]  # staged before, not now (the state changed): the cap still holds
        if any_cuda:
            torch.cuda.synchronize()
        return out

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self._buffers.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class TensorFile:
    """One safetensors file (https://github.com/huggingface/safetensors, the format: an 8-byte little-endian
    header size, the JSON header, then the tensors' bytes) written in parts: the header and every tensor's
    place are fixed at the first write, each tensor's bytes are written at its place when `write` names it.
    Tensors are laid out by element size (largest first) then name, each aligned to its element, as
    safetensors' own writer does; safetensors' loaders read the result."""

    def __init__(self, path: Path, tensors: StateDict, metadata: dict[str, str]) -> None:
        self.path, self.tensors = Path(path), tensors
        order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
        header: dict[str, Any] = {"__metadata__": metadata}
        self.offsets, cursor = {}, 0
        for name in order:
            t = tensors[name]
            dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
            if dtype is None:
                raise TypeError(f"{name}: {t.dtype} has no safetensors dtype here")
            self.offsets[name] = cursor
            header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [cursor, cursor + _nbytes(t)]}
            cursor += _nbytes(t)
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self._head = len(text).to_bytes(8, "little") + text
        self.size = len(self._head) + cursor
        self._pending = set(order)
        self._created = False

    def write(self, names=None) -> None:
        """Write the named tensors (default: every one not yet written); creates the file on first use."""
        names = sorted(self._pending if names is None else set(names) & self._pending)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (0 if self._created else os.O_TRUNC), 0o644)
        try:
            if not self._created:
                os.ftruncate(fd, self.size)
                os.pwrite(fd, self._head, 0)
                self._created = True
            for name in names:
                data = _host_bytes(self.tensors[name])
                written, view = 0, memoryview(data)
                while written < len(view):
                    written += os.pwrite(fd, view[written:], len(self._head) + self.offsets[name] + written)
                self._pending.discard(name)
        finally:
            os.close(fd)

    @property
    def complete(self) -> bool:
        return not self._pending


def _host_bytes(t: torch.Tensor):
    """The tensor's bytes in host memory (a copy only when it is on a device or not contiguous)."""
    import torch

    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


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
    """A copy of ``state`` that the caller may mutate freely afterwards (staging=None: no copy of CPU tensors),
    but for the tensors a capped `staging` left live (`staging.unstaged`): write those before mutating."""
    if staging is not None:
        staging.begin()

    def tensors(slot: str, sd: StateDict | None) -> StateDict | None:
        if sd is None:
            return None
        return staging.copy(slot, sd) if staging is not None else _host_view(sd)

    return replace(state, coords=dict(state.coords), model=tensors("model", state.model),
                   optim=tensors("optim", state.optim), optim_meta=dict(state.optim_meta),
                   critic=tensors("critic", state.critic), critic_optim=tensors("critic_optim", state.critic_optim),
                   critic_optim_meta=dict(state.critic_optim_meta),
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
