"""Random-number-generator states of one process, captured and restored without pickle.

    rng = capture_rng({"dropout": my_torch_generator})   # torch CPU (+CUDA), numpy global, python
    ...
    restore_rng(rng, {"dropout": my_torch_generator})    # the same streams continue from here

Encoding: torch generator states are uint8 arrays (what ``get_state()`` returns); numpy's and
python's states are JSON (numpy's MT19937 key as a list of ints, python's 625-int tuple as a
list). ``state.py`` stores them as HDF5 datasets and attributes; nothing here executes code on load.
"""
from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class RngState:
    torch_cpu: np.ndarray
    numpy_json: str
    python_json: str
    torch_cuda: list[np.ndarray] = field(default_factory=list)
    generators: dict[str, np.ndarray] = field(default_factory=dict)
    """Named extra ``torch.Generator`` states (e.g. a dropout or sampling generator)."""


def capture_rng(generators: dict[str, torch.Generator] | None = None) -> RngState:
    """This process's RNG states: torch CPU, every initialized CUDA device, numpy global, python.

    A process that never imported torch (a GenRM rank scoring by rule only) has no torch stream to
    keep: its ``torch_cpu`` is empty, and torch is not imported just to read a state nobody draws from.
    """
    torch = sys.modules.get("torch")
    np_state = np.random.get_state(legacy=False)
    np_state = {**np_state, "state": {"key": np_state["state"]["key"].tolist(),
                                      "pos": int(np_state["state"]["pos"])}}
    version, internal, gauss = random.getstate()
    cuda = []
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.numpy().copy() for s in torch.cuda.get_rng_state_all()]
    return RngState(
        torch_cpu=torch.get_rng_state().numpy().copy() if torch is not None else np.zeros(0, np.uint8),
        numpy_json=json.dumps(np_state),
        python_json=json.dumps([version, list(internal), gauss]),
        torch_cuda=cuda,
        generators={name: g.get_state().numpy().copy() for name, g in (generators or {}).items()},
    )


def restore_rng(state: RngState, generators: dict[str, torch.Generator] | None = None) -> None:
    """Put every captured stream back; named generators must be passed under the same names. An empty
    ``torch_cpu`` (captured before torch was ever imported) leaves torch alone: nothing had drawn from it."""
    np_state = json.loads(state.numpy_json)
    np_state["state"]["key"] = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(np_state)
    version, internal, gauss = json.loads(state.python_json)
    random.setstate((version, tuple(internal), gauss))
    if not (state.torch_cpu.size or state.torch_cuda or generators):
        return
    import torch

    if state.torch_cpu.size:
        torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(state.torch_cpu, dtype=np.uint8)))
    if state.torch_cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(s) for s in state.torch_cuda])
    for name, gen in (generators or {}).items():
        if name not in state.generators:
            raise KeyError(f"no saved state for generator {name!r}; saved: {sorted(state.generators)}")
        gen.set_state(torch.from_numpy(np.ascontiguousarray(state.generators[name], dtype=np.uint8)))
