"""Three MPI ranks save and resume checkpoints: trainer tp0 + tp1 (TP=2, dp0) and one rollout rank.

    mpirun --oversubscribe -np 3 .venv/bin/python tests/programs/ckpt_ranks.py save OUT RUN_DIR MODEL_DIR
    mpirun --oversubscribe -np 3 .venv/bin/python tests/programs/ckpt_ranks.py resume OUT RUN_DIR

``save``: async saves of steps 1..3 (keep_last=2) while the main thread keeps issuing allreduces on
COMM_WORLD, then a step 4 whose leader-side write fails; each rank reports the random numbers it
draws right after step 3's RNG capture. ``resume``: a fresh process loads the latest checkpoint,
restores its RNG and reports what it draws and what it loaded. Started by tests/mpi/test_ckpt_commit.py.
"""
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from yatt_hpc.ckpt import (
    CheckpointError,
    CheckpointManager,
    RankState,
    SharedState,
    capture_rng,
    restore_rng,
)
from yatt_hpc.train.convert import hf_to_megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.mpi.convert_tp2_worker import tiny_hf_model

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
TP = 2


def identity() -> tuple[str, dict]:
    if RANK < TP:
        return f"trainer/dp0/tp{RANK}/pp0", {"dp": 0, "tp": RANK, "pp": 0}
    return f"rollout/r{RANK - TP}", {}


def rank_state(step: int, model) -> RankState:
    ident, coords = identity()
    if not coords:  # rollout rank: RNG only
        return RankState(ident, rng=capture_rng())
    shard = hf_to_megatron(model.state_dict(), model.config, RANK, TP)
    optim = {f"{k}.exp_avg": v * 0.5 + step for k, v in shard.items()}
    return RankState(ident, coords, model=shard, optim=optim, rng=capture_rng(),
                     data_position={"next_prompt": 16 * step, "ids": np.arange(step) + 100 * RANK})


def draws() -> list:
    return [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]


def save(out: Path, run_dir: Path, model_dir: Path) -> dict:
    model = tiny_hf_model("gpt2-tied")
    if RANK == 0:
        model.save_pretrained(model_dir)
    torch.manual_seed(10 + RANK), np.random.seed(20 + RANK), random.seed(30 + RANK)
    shared = SharedState({"step": 0}, {"carry": np.arange(4)}, f"model:\n  path: {model_dir}\n")
    mgr = CheckpointManager(run_dir, COMM, keep_last=2, async_save=True)
    report = {"thread_level": MPI.Query_thread(), "multiple": MPI.THREAD_MULTIPLE}
    for step in (1, 2, 3):
        shared.counters["step"] = step
        mgr.save(step, rank_state(step, model), shared)
        if step == 3:
            report["draws_after_save"] = draws()
        # the training loop keeps talking on COMM while the writer thread commits on its Dup
        report[f"allreduce_{step}"] = COMM.allreduce(RANK + step)
    mgr.wait()
    bad = RankState(identity()[0], extra={"bad": [1, 2]} if RANK == 2 else {})
    try:
        mgr.save(4, bad, shared)
        mgr.wait()
        report["step4_error"] = None
    except CheckpointError as err:
        report["step4_error"] = str(err)
    mgr.close()
    return report


def resume(out: Path, run_dir: Path) -> dict:
    torch.manual_seed(999), np.random.seed(999), random.seed(999)
    mgr = CheckpointManager(run_dir, COMM, keep_last=2)
    got = mgr.load_latest(identity()[0])
    want = rank_state(got.step, tiny_hf_model("gpt2-tied"))  # seeds torch: before the restore
    restore_rng(got.rng)
    report = {"step": got.step, "draws_after_resume": draws(), "coords": got.coords,
              "saved_world_rank": got.saved_world_rank, "counters": got.shared.counters,
              "model_keys": len(got.model), "optim_keys": len(got.optim),
              "data_next": got.data_position.get("next_prompt"),
              "data_ids": np.asarray(got.data_position.get("ids", [])).tolist()}
    report["model_equal"] = all(torch.equal(got.model[k], v) for k, v in (want.model or {}).items())
    report["optim_equal"] = all(torch.equal(got.optim[k], v) for k, v in (want.optim or {}).items())
    mgr.close()
    return report


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    report = save(out, Path(sys.argv[3]), Path(sys.argv[4])) if mode == "save" else resume(out, Path(sys.argv[3]))
    (out / f"{mode}-{RANK}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
