"""A one-rank job that is SIGKILLed while its async checkpoint write is in flight; started by tests only.

    .venv/bin/python tests/programs/ckpt_kill_writer.py RUN_DIR [local|mpi]

Saves step 1 (committed), then starts an async save of step 2 with ~256 MB of tensors and prints
``MID-WRITE`` as soon as the writer thread has created ``step-2.incomplete/``; the test kills it then.
``mpi``: the manager runs on a real one-rank MPI.COMM_WORLD (singleton), so the writer thread also
runs the commit collectives on its duplicate; ``local`` (the default): on LocalComm.
"""
import sys
import time

import torch

from yatt_hpc.ckpt import CheckpointManager, RankState, capture_rng
from yatt_hpc.ckpt.layout import checkpoints_dir, incomplete_dir


def main() -> None:
    run_dir = sys.argv[1]
    comm = None
    if sys.argv[2:] == ["mpi"]:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    mgr = CheckpointManager(run_dir, comm, keep_last=2, async_save=True)
    coords = {"dp": 0, "tp": 0, "pp": 0}
    mgr.save(1, RankState("trainer/dp0/tp0/pp0", coords, model={"w": torch.ones(16)}, rng=capture_rng()))
    mgr.wait()
    big = {f"w{i}": torch.randn(16 << 20) for i in range(4)}  # 4 x 64 MiB
    mgr.save(2, RankState("trainer/dp0/tp0/pp0", coords, model=big, rng=capture_rng()))
    inc = incomplete_dir(checkpoints_dir(run_dir), 2)
    while not inc.exists():
        time.sleep(0.001)
    print("MID-WRITE", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
