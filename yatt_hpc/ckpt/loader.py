"""Finding the latest checkpoint that verifies, and reading one rank's part of it (no MPI here).

    step, skipped = find_latest(ckpt_dir)                 # highest committed step whose manifest verifies
    restored = read_rank(step_dir, "trainer/dp0/tp1/pp0")  # tensors, RNG, data position, shared state
    weights = read_weights(step_dir, tp=1, pp=0)           # parameters of one shard only

Reading uses safetensors and h5py only: no pickle, so loading a checkpoint runs no code.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.errors import CheckpointError
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.ckpt.rng import RngState
from yatt_hpc.ckpt.state import SharedState, read_record, read_shared

log = logging.getLogger(__name__)
if TYPE_CHECKING:  # torch is imported where weights are read: a rank without any never needs it
    import torch

    StateDict = dict[str, torch.Tensor]


@dataclass
class Restored:
    """One rank's view of a loaded checkpoint."""

    step: int
    identity: str
    coords: dict[str, int]
    model: StateDict = field(default_factory=dict)
    optim: StateDict = field(default_factory=dict)
    optim_meta: dict[str, str] = field(default_factory=dict)
    rng: RngState | None = None
    data_position: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    shared: SharedState = field(default_factory=SharedState)
    saved_world_rank: int = -1


def find_latest(ckpt_dir: Path, quarantine: bool = False) -> tuple[int | None, list[tuple[int, str]]]:
    """The highest step that verifies, and the (step, reason) of every newer one that did not.

    Each skipped checkpoint is logged as a warning. ``quarantine=True`` (the leader at resume)
    renames them to ``step-N.corrupt`` so that pruning by step order can never keep a corrupt
    checkpoint in place of a good one.
    """
    skipped = []
    for entry in reversed(layout.list_steps(ckpt_dir)):
        problem = verify_step(entry.path)
        if problem is None:
            return entry.step, skipped
        log.warning("checkpoint %s is not usable (%s); trying the previous one", entry.path, problem)
        skipped.append((entry.step, problem))
        if quarantine:
            target = entry.path.with_name(entry.path.name + layout.CORRUPT_SUFFIX)
            if not target.exists():
                os.rename(entry.path, target)
                log.warning("moved %s aside to %s", entry.path, target)
    return None, skipped


def read_weights(step_dir: Path, tp: int = 0, pp: int = 0) -> StateDict:
    path = step_dir / layout.model_file(tp, pp)
    if not path.is_file():
        have = sorted(p.name for p in step_dir.glob("model-*.safetensors"))
        raise CheckpointError(f"{step_dir} has no parameters for tp={tp} pp={pp} ({path.name}); "
                              f"it has {have}: was it saved with another parallel layout?")
    from safetensors.torch import load_file

    return load_file(str(path))


def _read_safetensors(path: Path) -> tuple[StateDict, dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(layout.METADATA_KEY, "{}"))
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is no dict
    meta.pop("identity", None)
    return tensors, meta


def read_rank(step_dir: Path, identity: str) -> Restored:
    """Everything saved for ``identity`` in a (verified) step directory."""
    state = step_dir / layout.STATE_FILE
    step, shared = read_shared(state)
    try:
        rec = read_record(state, identity)
    except KeyError as err:
        raise CheckpointError(str(err.args[0])) from None
    out = Restored(step=step, identity=identity, coords=rec.coords, rng=rec.rng,
                   data_position=rec.data_position, extra=rec.extra, shared=shared,
                   saved_world_rank=rec.world_rank)
    if "tp" in rec.coords:  # a trainer shard: its parameters come from that shard's dp-rank-0 file
        out.model = read_weights(step_dir, rec.coords.get("tp", 0), rec.coords.get("pp", 0))
    for name in rec.files:
        if name.startswith("optim-"):
            out.optim, out.optim_meta = _read_safetensors(step_dir / name)
    return out
