"""A one-rank MPI job (singleton MPI.COMM_WORLD) whose second async save hits a full disk; started by tests only.

    .venv/bin/python tests/programs/ckpt_disk_full.py RUN_DIR MODEL_FLOATS EXTRA_FLOATS

Saves step 1 and waits for its commit, then saves step 2 (the same sizes) asynchronously and waits
for it. ``MODEL_FLOATS`` float32 zeros go into the safetensors file this rank writes, ``EXTRA_FLOATS``
into ``state.h5`` (written by the leader), so the caller picks which write meets the full disk.
Prints one JSON line: the CheckpointError of step 2 (or null), its class and whether commits ran off the
loop thread. Started by tests/unit/test_ckpt_disk_full.py, which mounts RUN_DIR/checkpoints.
"""
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

from yatt_hpc.ckpt import CheckpointError, CheckpointManager, RankState, SharedState, capture_rng

IDENTITY = "trainer/dp0/tp0/pp0"


def rank_state(step: int, model_floats: int, extra_floats: int) -> RankState:
    model = {"w": torch.full((model_floats,), float(step))}
    return RankState(IDENTITY, {"dp": 0, "tp": 0, "pp": 0}, model=model, rng=capture_rng(),
                     data_position={"next": 16 * step}, extra={"pad": np.zeros(extra_floats, np.float32)})


def main() -> None:
    run_dir, model_floats, extra_floats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mgr = CheckpointManager(run_dir, MPI.COMM_WORLD, keep_last=2, async_save=True)
    for step in (1, 2):
        mgr.save(step, rank_state(step, model_floats, extra_floats), SharedState({"step": step}))
    error = kind = None
    try:
        mgr.wait()
    except CheckpointError as err:
        error, kind = str(err), type(err).__name__
    report = {"error": error, "kind": kind, "threaded_commit": mgr._threaded_commit, "world": MPI.COMM_WORLD.Get_size()}
    mgr.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
