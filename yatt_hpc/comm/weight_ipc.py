"""Weight buckets between two processes on one GPU: CUDA IPC handles over MPI, no copy through the host.

    payload, shared = ipc_payload(bucket)    # a trainer owner: handles of its device tensors, as bytes
    bucket = rebuild_ipc_bucket(payload)     # the engine rank on the same GPU: its own copies, on that GPU

CUDA only (a CPU tensor has no IPC handle); the `ipc` transport is chosen only for an (owner, engine)
pair on one GPU with the sglang engine (`placement/weight_transport.py`). Checked on a GPU by
tests/gpu/test_weight_transports.py and `tools/gpu_check.py` (sglang-ipc); nothing here runs on a CPU machine.

The handles are `torch.multiprocessing.reductions.reduce_tensor` of each tensor (what torch's own
multiprocessing sends: a handle to the allocation, offset, size and an event the producer recorded),
pickled; the tensor data never leaves the device. The engine rank opens each handle and clones it at
once: torch refuses to share a tensor that came from another process again, and SGLang's
`update_weights_from_tensor` shares what it is given with its TP workers. The owner keeps the bucket
alive until the engine answers (TAG_WEIGHTS_DONE): its tensors may be views of parameters the next
optimizer step changes, and the clone must have read them first.
"""
from __future__ import annotations

import pickle

import numpy as np
import torch

from yatt_hpc.comm.transport import TAG_WEIGHTS_DONE

__all__ = ["TAG_WEIGHTS_DONE", "ipc_payload", "rebuild_ipc_bucket"]


def ipc_payload(bucket: list[tuple[str, torch.Tensor]]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """The bucket's CUDA IPC handles as bytes, and the tensors they point at, which the caller keeps
    alive until the engine answers."""
    from torch.multiprocessing.reductions import reduce_tensor

    for name, tensor in bucket:
        if not tensor.is_cuda:
            raise ValueError(f"ipc weight sync needs CUDA tensors, {name!r} is on {tensor.device}; "
                             "set rollout.weight_transport=mpi")
    shared = [tensor.detach().contiguous() for _, tensor in bucket]
    handles = [(name, reduce_tensor(tensor)) for (name, _), tensor in zip(bucket, shared)]
    return np.frombuffer(pickle.dumps(handles), dtype=np.uint8), shared


def rebuild_ipc_bucket(payload: np.ndarray) -> list[tuple[str, torch.Tensor]]:
    """This process's copies of the tensors behind `payload`'s handles, on their GPU, finished."""
    bucket = []
    for name, (rebuild, args) in pickle.loads(payload.tobytes()):  # noqa: S301 - from our own owner rank
        bucket.append((name, rebuild(*args).clone()))
    if bucket:
        torch.cuda.synchronize(bucket[0][1].device)  # the copies are done before the owner lets go
    return bucket
