"""Two updates of the value model over one global batch in this MPI world's layout (--tp, --pp, dp the rest).

    mpirun -n 2 python -m tests.programs.critic_update --out DIR --tp 2 --pp 1 --model models/demo/policy [--model ...]

Every rank builds the critic of each --model (train.critic on its own decoder, a new head seeded by train.seed),
keeps the prompt groups g with g % dp == its dp rank, and runs `MegatronCritic.values` and two
`update_values` with the plan the trainer makes (`train/step_plan.py`, global counts over the dp ranks). Each
rank writes DIR/rank-<r>.npz: per model, the sample ids it holds and their values before and after. With -n 1
it is the single-rank reference; tests/mpi/test_critic_layouts.py compares the layouts.
"""
from __future__ import annotations

import argparse
import socket
from pathlib import Path

import numpy as np
from mpi4py import MPI

from tests.programs.dp_update import global_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--model", action="append", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dp = size // (args.tp * args.pp)  # Megatron's order: tp fastest, then dp, then pp
    tp_rank, dp_rank, pp_rank = rank % args.tp, (rank // args.tp) % dp, rank // (args.tp * dp)
    dp_comm = comm.Split(tp_rank + args.tp * pp_rank, dp_rank)
    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)

    from yatt_hpc.config.schema import RunConfig
    from yatt_hpc.critic.update import MegatronCritic
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.step_plan import plan_update

    mm.initialize_model_parallel(rank, size, "127.0.0.1", port, tp_size=args.tp, pp_size=args.pp, seed=0)
    batch = global_batch()
    mine = batch.select(np.flatnonzero(batch.prompt_id % dp == dp_rank))
    rng = np.random.default_rng(5)
    targets = rng.uniform(-1, 1, len(batch))
    returns = [np.full(n, targets[i], np.float32) for i, n in zip(mine.sample_id, mine.response_len)]
    out = {}
    for index, model in enumerate(args.model):
        cfg = RunConfig.model_validate({"model": {"path": model}, "train": {
            "adv_estimator": "gae", "micro_batch_size": 3, "mini_batches": 2,
            "critic": {"lr": 1e-3, "head_init_std": 0.1, "value_clip": 0.2}}})
        critic = MegatronCritic.from_run_config(cfg, tp_rank, args.tp)
        plan = plan_update(mine, cfg.train, cfg.rollout.max_new_tokens,
                           gather=lambda items: [x for part in dp_comm.allgather(items) for x in part],
                           reduce=lambda x: dp_comm.allreduce(np.asarray(x, np.float64), op=MPI.SUM))
        before = critic.values(mine)
        for _ in range(2):
            critic.update_values(mine, before, returns, plan)
        after = critic.values(mine)
        out[f"ids{index}"] = mine.sample_id
        out[f"before{index}"] = np.concatenate(before)
        out[f"after{index}"] = np.concatenate(after)
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(args.out / f"rank-{rank}.npz", **out)
    mm.destroy_model_parallel()


if __name__ == "__main__":
    main()
