"""Checkpoints: safetensors for tensors, one HDF5 file for the rest, atomic multi-rank commit, async writes.

    from yatt_hpc.ckpt import CheckpointManager, RankState, SharedState, capture_rng, restore_rng
    mgr = CheckpointManager(run_dir, MPI.COMM_WORLD, keep_last=2, async_save=True)
    restored = mgr.load_latest("trainer/dp0/tp0/pp0")        # None on a fresh run
    mgr.save(step, RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0}, model=sd,
                             optim=opt, rng=capture_rng(), data_position={"next": 128}),
             SharedState(counters={"step": step}, config_yaml=text))
    mgr.close()

    yatt-hpc ckpt list RUN_DIR | ckpt verify RUN_DIR [--step N] | ckpt export-hf RUN_DIR --step N --out OUT

See layout.py (names), commit.py (the protocol), manifest.py (digests, verification), state.py
(the HDF5 layout), writer.py (snapshot + background writer), export_hf.py (HF export).
"""
from __future__ import annotations

import importlib

# Attributes load on first use (PEP 562): `yatt-hpc ckpt list` and `yatt-hpc plan` import this
# package without paying for torch and h5py.
_EXPORTS = {
    "CheckpointError": "errors", "DiskFullError": "errors", "should_save": "layout", "Restored": "loader",
    "find_latest": "loader", "CheckpointManager": "manager", "LocalComm": "manager", "load_optimizer_tensors": "optim",
    "optimizer_tensors": "optim", "RngState": "rng", "capture_rng": "rng", "restore_rng": "rng",
    "SharedState": "state", "RankState": "writer", "RngOnlyState": "writer",
}
__all__ = ["CheckpointError", "CheckpointManager", "DiskFullError", "LocalComm", "RankState", "Restored",
           "RngOnlyState", "RngState", "SharedState", "capture_rng", "find_latest", "load_optimizer_tensors", "optimizer_tensors",
           "restore_rng", "should_save"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'yatt_hpc.ckpt' has no attribute {name!r}")
    return getattr(importlib.import_module(f"yatt_hpc.ckpt.{_EXPORTS[name]}"), name)
