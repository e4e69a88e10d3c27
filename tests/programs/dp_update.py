"""One update of the demo policy over one global batch, split over this MPI world's data-parallel ranks.

    mpirun -n 2 python -m tests.programs.dp_update --out DIR --set loss_agg_mode=seq-mean-token-mean ...

Every rank builds the same policy (tp 1, so dp = the world size) and the same global batch (3 prompt
groups of uneven sizes and lengths), keeps the groups g with g % size == rank, and runs
`MegatronPolicy.update` with the plan and advantages the trainer would make (`train/step_plan.py`, global
counts over the ranks); rank 0 writes the resulting parameters to DIR/params-<size>.npz. The same program with
-n 1 is the single-replica reference: the two must agree up to float summation order.
"""
from __future__ import annotations

import argparse
import socket
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

REPO = Path(__file__).resolve().parents[2]


def global_batch():
    from yatt_hpc.batch import SampleBatch

    rng = np.random.default_rng(3)
    sizes = [4, 4, 4, 4, 4, 4]
    groups = np.repeat(np.arange(len(sizes)), sizes)
    prompts = [rng.integers(3, 40, rng.integers(4, 9)) for _ in sizes]
    lengths = rng.integers(1, 12, len(groups))
    return SampleBatch(
        sample_id=np.arange(len(groups), dtype=np.int64), prompt_id=groups.astype(np.int64),
        prompt_len=np.array([len(prompts[g]) for g in groups], np.int32),
        prompt_tokens=np.concatenate([prompts[g] for g in groups]).astype(np.int32),
        response_len=lengths.astype(np.int32), response_tokens=rng.integers(3, 40, lengths.sum()).astype(np.int32),
        logprobs=rng.uniform(-4, -3, int(lengths.sum())).astype(np.float32),
        reward=rng.integers(0, 2, len(groups)).astype(np.float32),
        finish=(lengths == lengths.max()).astype(np.int8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="train.<field>=<value> (YAML value)")
    ap.add_argument("--updates", type=int, default=1, help="updates on the same batch (optimizer state matters)")
    ap.add_argument("--bf16", action="store_true", help="a bf16 model with fp32 masters")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import yaml

    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.policy import MegatronPolicy
    from yatt_hpc.train.step_plan import plan_update, step_advantages

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    port = None
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    mm.initialize_model_parallel(rank, size, "127.0.0.1", comm.bcast(port), tp_size=1, seed=0)
    fields = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    # lr 1 with eps 1: the step is ~ the gradient itself (g / (|g| + 1)), not its sign, so a comparison of the
    # weights compares gradients (Adam with eps 1e-8 turns a 1e-9 gradient into a full step either way)
    cfg = TrainConfig(**{"lr": 1.0, "adam_eps": 1.0, "micro_batch_size": 4, "prompts_per_step": 6, **fields})
    torch.manual_seed(0)
    policy = MegatronPolicy.from_hf(REPO / "models" / "demo" / "policy", 0, 1, cfg,
                                    dtype=torch.bfloat16 if args.bf16 else torch.float32)
    whole = global_batch()
    mine = whole.select(np.flatnonzero(whole.prompt_id % size == rank))

    def reduce(values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        comm.Allreduce(np.ascontiguousarray(values, np.float64), out, op=MPI.SUM)
        return out

    def gather(items: list) -> list:
        return [x for part in comm.allgather(items) for x in part]

    adv = step_advantages(mine, cfg, reduce=reduce)
    plan = plan_update(mine, cfg, 12, gather=gather, reduce=reduce, kl_coef=cfg.kl_coef)
    for _ in range(args.updates):
        policy.update(mine, adv.values, plan)
    if rank == 0:
        np.savez(Path(args.out) / f"params-{size}{args.tag}.npz",
                 **{n: p.detach().float().numpy() for n, p in policy.model.named_parameters()})
    mm.destroy_model_parallel()


if __name__ == "__main__":
    main()
