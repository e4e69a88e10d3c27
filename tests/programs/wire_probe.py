"""MPI probe for the data plane: batches and weight buckets cross ranks as buffers, intact.

    mpirun -np 3 python tests/programs/wire_probe.py OUT_DIR

Rank 0 sends a random ragged batch and a set of weight tensors (several buckets) to ranks 1 and 2;
they write what they received to OUT_DIR as safetensors/npz for the test to compare.
"""
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from safetensors.torch import save_file

from yatt_hpc.batch import SampleBatch
from yatt_hpc.comm.transport import TAG_SAMPLES, bcast_batch, recv_batch, send_batch
from yatt_hpc.comm.weight_sync import WeightSender, receive_weights


def make_batch(seed: int) -> SampleBatch:
    rng = np.random.default_rng(seed)
    n = 7
    plen, rlen, alen = (rng.integers(1, 9, n).astype(np.int32) for _ in range(3))
    return SampleBatch(
        sample_id=rng.permutation(n).astype(np.int64) + 100, prompt_id=np.arange(n, dtype=np.int64),
        owner=np.zeros(n, np.int32), prompt_len=plen, prompt_tokens=rng.integers(0, 50, plen.sum()).astype(np.int32),
        response_len=rlen, response_tokens=rng.integers(0, 50, rlen.sum()).astype(np.int32),
        logprobs=rng.standard_normal(rlen.sum()).astype(np.float32), answer_len=alen,
        answer=rng.integers(97, 123, alen.sum()).astype(np.uint8), finish=np.zeros(n, np.int8),
        question_len=alen + 1, question=rng.integers(97, 123, alen.sum() + n).astype(np.uint8),
        metadata_len=np.full(n, 8, np.int32), metadata=np.frombuffer(b'{"k": 1}' * n, np.uint8).copy(),
        reward=rng.random(n).astype(np.float32), rule_score=np.zeros(n, np.float32),
        genrm_score=np.zeros(n, np.float32), parse_fail=np.zeros(n, np.int8))


def weights():
    g = torch.Generator().manual_seed(0)
    yield "a.weight", torch.randn(64, 64, generator=g)
    yield "b.bias", torch.randn(3, generator=g).to(torch.bfloat16)
    yield "c.weight", torch.randn(300, 100, generator=g)
    yield "d.scalar", torch.tensor(1.5)


class Collector:
    """Stands where an engine would: keeps every tensor a weight sync loads."""

    def __init__(self) -> None:
        self.tensors: dict = {}

    def update_weights(self, bucket, *, final: bool) -> None:
        self.tensors.update(dict(bucket))

    def take_weights(self, bucket, *, final: bool) -> None:  # what a weight sync calls: tensors it gives up
        self.update_weights(bucket, final=final)


def main() -> None:
    out = Path(sys.argv[1])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if rank == 0:
        send_batch(comm, 1, TAG_SAMPLES, make_batch(1))
        send_batch(comm, 2, TAG_SAMPLES, make_batch(2))
        WeightSender(comm, {}, bucket_mb=0.05).send([1, 2], weights())  # no pairs: every destination by mpi
    else:
        batch, src = recv_batch(comm, MPI.ANY_SOURCE, TAG_SAMPLES)
        np.savez(out / f"batch-{rank}.npz", source=src, **{k: getattr(batch, k) for k in batch.__dataclass_fields__})
        got = Collector()
        buckets = receive_weights(comm, 0, got, "mpi")  # the path a rollout rank's engine takes
        save_file(got.tensors, str(out / f"weights-{rank}.safetensors"))
        (out / f"buckets-{rank}.txt").write_text(str(buckets))
    b = bcast_batch(comm, make_batch(5) if rank == 0 else None, root=0)
    np.savez(out / f"bcast-{rank}.npz", **{k: getattr(b, k) for k in b.__dataclass_fields__})


if __name__ == "__main__":
    main()
