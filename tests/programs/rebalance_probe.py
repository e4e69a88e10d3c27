"""MPI probe: trainer owners rebalance skewed GRPO groups with Karmarkar-Karp.

    mpirun -np 4 python tests/programs/rebalance_probe.py OUT_DIR

Rank r starts with 6 groups of 4 samples; rank 0's responses are long (a long tail), others short.
Each rank writes the groups and sample ids it ends with, and the balance info.
"""
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from yatt_hpc.batch import SampleBatch
from yatt_hpc.comm.rebalance import Rebalancer


def start_batch(rank: int) -> SampleBatch:
    rng = np.random.default_rng(rank)
    groups, n = 6, 4
    prompt_id = np.repeat(np.arange(groups) + 100 * rank, n)
    rlen = (rng.integers(200, 400, groups * n) if rank == 0 else rng.integers(5, 60, groups * n)).astype(np.int32)
    plen = np.full(groups * n, 8, np.int32)
    return SampleBatch(sample_id=prompt_id * n + np.tile(np.arange(n), groups), prompt_id=prompt_id,
                       owner=np.full(groups * n, rank, np.int32), prompt_len=plen,
                       prompt_tokens=np.ones(plen.sum(), np.int32), response_len=rlen,
                       response_tokens=np.full(rlen.sum(), 7, np.int32), logprobs=np.zeros(rlen.sum(), np.float32),
                       reward=rng.random(groups * n).astype(np.float32))


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    batch = start_batch(rank)
    balancer = Rebalancer(comm, comm, list(range(comm.Get_size())), a=64.0)
    out, info = balancer.rebalance(batch)
    responses = [r.tolist() for r in out.ragged("response_tokens")]
    Path(sys.argv[1], f"rank-{rank}.json").write_text(json.dumps({
        "sample_id": out.sample_id.tolist(), "prompt_id": out.prompt_id.tolist(),
        "response_len": out.response_len.tolist(), "responses_ok": all(len(r) == n for r, n in zip(responses, out.response_len)),
        "before": info.before, "after": info.after, "moved": info.moved_groups}))


if __name__ == "__main__":
    main()
