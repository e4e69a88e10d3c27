"""Trainer -> rollout weight sync in size-bounded buckets of raw bytes over MPI.

    sent = send_weights(comm, dests, policy.hf_weights(), bucket_mb=64)   # trainer replica, TP rank 0
    sent.nbytes, sent.buckets                                           # per destination
    for bucket, final in recv_weights(comm, source): engine.update_weights(bucket, final=final)

A bucket is two messages: a small JSON manifest (names, dtypes, shapes, byte offsets, `final`)
as uint8, then one contiguous byte buffer. Tensors are never pickled. A single tensor larger than
the bucket goes alone in its own bucket.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from yatt_hpc.activity import ACTIVITY
from yatt_hpc.comm.transport import TAG_WEIGHTS, wait_for_message

_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)}


def _pack(items: list[tuple[str, torch.Tensor]], final: bool) -> tuple[np.ndarray, np.ndarray]:
    entries, offset, chunks = [], 0, []
    for name, tensor in items:
        flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "offset": offset, "nbytes": int(flat.size)})
        chunks.append(flat)
        offset += flat.size
    manifest = np.frombuffer(json.dumps({"final": final, "tensors": entries}).encode(), dtype=np.uint8)
    return manifest, (np.concatenate(chunks) if chunks else np.zeros(0, np.uint8))


class Sent(NamedTuple):
    """What one weight sync sent to each destination (both 0 without destinations)."""

    nbytes: int
    buckets: int


def send_weights(comm, dests: list[int], weights: Iterable[tuple[str, torch.Tensor]], bucket_mb: float) -> Sent:
    """Send every (name, tensor) to each rank in `dests`; returns the bytes and buckets sent per destination.

    The iterator is drained even with no destinations: it may be a collective over the TP group.
    """
    limit = int(bucket_mb * 2**20)
    bucket: list[tuple[str, torch.Tensor]] = []
    size = sent = buckets = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            sent += _send_bucket(comm, dests, bucket, final=False)
            buckets += 1
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    sent += _send_bucket(comm, dests, bucket, final=True)
    return Sent(sent, buckets + 1 if dests else 0)


def _send_bucket(comm, dests: list[int], bucket, final: bool) -> int:
    if not dests:
        return 0
    manifest, payload = _pack(bucket, final)
    for dest in dests:
        comm.Send(np.array([manifest.size, payload.size], dtype=np.int64), dest=dest, tag=TAG_WEIGHTS)
        comm.Send(manifest, dest=dest, tag=TAG_WEIGHTS)
        if payload.size:
            comm.Send(payload, dest=dest, tag=TAG_WEIGHTS)
        ACTIVITY.progress("send weights")
    return int(payload.size)


def recv_weights(comm, source: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield (bucket, final) until the final bucket of one weight version has arrived."""
    while True:
        wait_for_message(comm, source, TAG_WEIGHTS)
        sizes = np.empty(2, dtype=np.int64)
        comm.Recv(sizes, source=source, tag=TAG_WEIGHTS)
        manifest = np.empty(int(sizes[0]), dtype=np.uint8)
        comm.Recv(manifest, source=source, tag=TAG_WEIGHTS)
        payload = np.empty(int(sizes[1]), dtype=np.uint8)
        if sizes[1]:
            comm.Recv(payload, source=source, tag=TAG_WEIGHTS)
        meta = json.loads(manifest.tobytes())
        raw = torch.from_numpy(payload)
        bucket = []
        for e in meta["tensors"]:
            chunk = raw[e["offset"]: e["offset"] + e["nbytes"]]
            bucket.append((e["name"], chunk.view(_DTYPES[e["dtype"]]).reshape(e["shape"]).clone()))
        yield bucket, bool(meta["final"])
        if meta["final"]:
            return
