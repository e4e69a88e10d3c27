"""Bytes of activations a forward keeps for its backward, measured where the CPU has no allocator statistics.

    with SavedActivations(model.parameters()) as saved:
        loss = forward(...)
    saved.bytes          # distinct storages autograd kept for the backward, the parameters' own excluded
    loss.backward()

On CUDA `torch.cuda.max_memory_allocated` answers how much a step held; the CPU allocator keeps no such
count, and the process's peak RSS mixes activations with the allocator's caching and everything else the
process holds. What activation recomputation changes is exactly what autograd saves between the forward and
the backward, so this counts that: every tensor packed by `torch.autograd.graph.saved_tensors_hooks` while
the block runs, one count per underlying storage (a view and its base, or a tensor saved by two nodes, are
held once), leaving out the storages of `params` (weights are held anyway). A checkpointed region saves only
its inputs inside the block; what its backward recomputes is allocated later, one region at a time.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedActivations:
    """Context manager: `bytes` is the total size of the distinct non-parameter storages saved inside it."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._params and key:
            self._seen[key] = max(self._seen.get(key, 0), storage.nbytes())
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
