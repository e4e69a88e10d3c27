"""Trainer -> engine weight sync in size-bounded buckets, each destination by its pair's transport.

    sender = WeightSender(comm, pairs, bucket_mb=64, device="cuda:0")  # pairs: placement.weight_pairs(...)
    sent = sender.send(dests, policy.hf_weights())    # every TP rank drains the iterator (a TP gather)
    sent.nbytes, sent.mpi_bytes, sent.buckets
    receive_weights(comm, sources, engine, transport) # an engine rank: one weight version, final bucket last

The protocol, per destination, every message on TAG_WEIGHTS from its owner (ipc's answer back on
TAG_WEIGHTS_DONE); `receive_weights` refuses a message of another transport, naming both:

    mpi         per bucket: BUCKET(manifest with byte offsets, payload = the tensors' bytes)
    collective  once per pair: JOIN(rendezvous); per bucket: BUCKET(manifest), then one broadcast per
                tensor over the pair's group (`yatt_hpc/device/weight_group.py`)
    ipc         per bucket: BUCKET(manifest, payload = the tensors' CUDA IPC handles) -> DONE from the
                engine once it holds its copies (the owner keeps the bucket alive until then)

A message is an int64 pair (envelope bytes, payload bytes), a JSON envelope {kind, transport, body}
and the payload, if any. Tensor data is never pickled: the mpi payload is raw bytes; ipc pickles only
the handles (`comm/weight_ipc.py`). A single tensor larger than the bucket goes alone in its own bucket,
sent from the tensor's own bytes and loaded from the received buffer (no copy on either side).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import numpy as np
import torch

from yatt_hpc.comm.doorbell import DOORBELL
from yatt_hpc.comm.transport import TAG_WEIGHTS, recv_ints, send_ints, wait_for_message
from yatt_hpc.comm.weight_ipc import TAG_WEIGHTS_DONE, ipc_payload, rebuild_ipc_bucket
from yatt_hpc.device.weight_group import DTYPES as _DTYPES
from yatt_hpc.device.weight_group import BucketManifest, PairGroup, Rendezvous, dtype_name, host_pair_store, pair_backend
from yatt_hpc.metrics.activity import ACTIVITY

Bucket = list[tuple[str, torch.Tensor]]


class Sent(NamedTuple):
    """One weight sync: tensor bytes delivered (summed over destinations), bytes put on MPI for it
    (envelopes and payloads), and buckets per destination (all 0 without destinations)."""

    nbytes: int
    buckets: int
    mpi_bytes: int = 0


def iter_buckets(weights: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[tuple[Bucket, bool]]:
    """(bucket, final) in order; the last is final (empty only if there are no weights at all)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    yield bucket, True


class WeightSender:
    """A trainer owner's side: one object for the run, so each collective pair's group is built once."""

    def __init__(self, comm, pairs: Mapping, bucket_mb: float, device: str = "cpu") -> None:
        """`pairs`: {destination: placement.weight_transport.WeightPair}; a destination not in it takes mpi.
        `device`: where the owner's weights live (a collective pair's backend: NCCL on CUDA, else Gloo)."""
        self.comm, self.pairs, self.backend = comm, pairs, pair_backend(device)
        self.limit = int(bucket_mb * 2**20)
        self.groups: dict[int, PairGroup] = {}
        self._stores: dict[int, object] = {}  # a pair's TCPStore lives as long as its group

    def transport(self, dest: int) -> str:
        pair = self.pairs.get(dest)
        return pair.transport if pair is not None else "mpi"

    def send(self, dests: list[int], weights: Iterable[tuple[str, torch.Tensor]]) -> Sent:
        """Send every (name, tensor) to each rank in `dests`. The iterator is drained even with no
        destinations: it may be a collective over the TP group."""
        nbytes = mpi_bytes = buckets = 0
        for bucket, final in iter_buckets(weights, self.limit):
            if not dests:
                continue
            mpi_bytes += self._send_bucket(dests, bucket, final)
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket) * len(dests)
            buckets += 1
        return Sent(nbytes, buckets, mpi_bytes)

    def _send_bucket(self, dests: list[int], bucket: Bucket, final: bool) -> int:
        by = {t: [d for d in dests if self.transport(d) == t] for t in ("mpi", "collective", "ipc")}
        sent = 0
        if by["mpi"]:
            body, payload = _mpi_bucket(bucket, final)
            sent += sum(send_message(self.comm, d, "bucket", "mpi", body, payload) for d in by["mpi"])
        if by["collective"]:
            tensors = [t.detach().contiguous() for _, t in bucket]
            for dest in by["collective"]:
                group, sent_join = self._group(dest)
                sent += sent_join
                body = BucketManifest.of(group.rendezvous.group_name, bucket, final).as_dict()
                sent += send_message(self.comm, dest, "bucket", "collective", body)
                with ACTIVITY.waiting(f"broadcast weights to {dest}"):
                    group.broadcast(tensors)
        if by["ipc"]:
            payload, shared = ipc_payload(bucket)
            body = {"final": final, "names": [n for n, _ in bucket]}
            sent += sum(send_message(self.comm, d, "bucket", "ipc", body, payload) for d in by["ipc"])
            for dest in by["ipc"]:
                recv_ints(self.comm, dest, TAG_WEIGHTS_DONE)
            del shared  # every engine holds its copies now
        return sent

    def _group(self, dest: int) -> tuple[PairGroup, int]:
        """The pair's group and the bytes its set-up put on MPI: built the first time (JOIN goes out,
        then both sides connect), reused ever after."""
        if dest in self.groups:
            return self.groups[dest], 0
        pair = self.pairs[dest]
        name = f"yatt-weights-{pair.owner}-{dest}"
        rendezvous, self._stores[dest] = host_pair_store(name, pair.engine_ranks, self.backend)
        sent = send_message(self.comm, dest, "join", "collective", rendezvous.as_dict())
        with ACTIVITY.waiting(f"join weight group {name}"):
            self.groups[dest] = PairGroup.connect(rendezvous, 0, self._stores[dest])
        return self.groups[dest], sent


def _mpi_bucket(bucket: Bucket, final: bool) -> tuple[dict, np.ndarray]:
    entries, offset, chunks = [], 0, []
    for name, tensor in bucket:
        flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        entries.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                        "offset": offset, "nbytes": int(flat.size)})
        chunks.append(flat)
        offset += flat.size
    # a bucket of one tensor (one over the bucket size: a real vocabulary's embedding) goes from its own bytes
    payload = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return {"final": final, "tensors": entries}, payload


def send_message(comm, dest: int, kind: str, transport: str, body: dict, payload: np.ndarray | None = None) -> int:
    """One protocol message; returns the bytes it put on MPI."""
    envelope = np.frombuffer(json.dumps({"kind": kind, "transport": transport, "body": body}).encode(), np.uint8)
    size = 0 if payload is None else payload.size
    DOORBELL.ring(comm, dest)  # a payload larger than eager waits for the receiver to match it
    comm.Send(np.array([envelope.size, size], dtype=np.int64), dest=dest, tag=TAG_WEIGHTS)
    comm.Send(envelope, dest=dest, tag=TAG_WEIGHTS)
    if size:
        comm.Send(payload, dest=dest, tag=TAG_WEIGHTS)
    ACTIVITY.progress("send weights")
    return 16 + envelope.size + size


def recv_message(comm, source: int) -> tuple[dict, np.ndarray]:
    wait_for_message(comm, source, TAG_WEIGHTS)
    sizes = np.empty(2, dtype=np.int64)
    comm.Recv(sizes, source=source, tag=TAG_WEIGHTS)
    envelope = np.empty(int(sizes[0]), dtype=np.uint8)
    comm.Recv(envelope, source=source, tag=TAG_WEIGHTS)
    payload = np.empty(int(sizes[1]), dtype=np.uint8)
    if sizes[1]:
        comm.Recv(payload, source=source, tag=TAG_WEIGHTS)
    return json.loads(envelope.tobytes()), payload


def _unpack_mpi(body: dict, payload: np.ndarray) -> Bucket:
    """The bucket's tensors: each its own copy of its bytes (so aligned for its dtype whatever lies before it),
    except a bucket's only tensor, which is the received buffer itself (no second copy of a 0.3 GB embedding)."""
    raw, alone = torch.from_numpy(payload), len(body["tensors"]) == 1
    bucket = []
    for e in body["tensors"]:
        piece = raw[e["offset"]: e["offset"] + e["nbytes"]]
        bucket.append((e["name"], (piece if alone else piece.clone()).view(_DTYPES[e["dtype"]]).reshape(e["shape"])))
    return bucket


def receive_weights(comm, sources: int | list[int], engine, transport: str) -> int:
    """Load one weight version into `engine` by `transport`, from each of `sources` in turn (a pipelined
    trainer's stage owners, first stage first: each sends its own layers, its last bucket marked final);
    the engine sees one final bucket, the last source's. Returns the buckets taken."""
    sources = [sources] if isinstance(sources, int) else list(sources)
    taken = 0
    for i, source in enumerate(sources):
        taken += _receive_from(comm, source, engine, transport, last=i == len(sources) - 1)
    return taken


def _receive_from(comm, source: int, engine, transport: str, last: bool) -> int:
    buckets = 0
    while True:
        envelope, payload = recv_message(comm, source)
        _expect(envelope, transport, source)
        body = envelope["body"]
        if envelope["kind"] == "join":
            with ACTIVITY.waiting(f"join weight group {body['group_name']}"):
                engine.join_weight_group(Rendezvous.from_dict(body))
            continue
        final = bool(body["final"]) and last
        if transport == "mpi":
            engine.update_weights(_unpack_mpi(body, payload), final=final)
        elif transport == "collective":
            with ACTIVITY.waiting(f"receive weights from {source}"):
                engine.update_weights_from_group(BucketManifest.from_dict(body))
        else:
            engine.update_weights(rebuild_ipc_bucket(payload), final=final)
            send_ints(comm, source, TAG_WEIGHTS_DONE, [len(body["names"])])
        ACTIVITY.progress("receive weights")
        buckets += 1
        if body["final"]:
            return buckets


def _expect(envelope: dict, transport: str, source: int) -> None:
    if envelope["transport"] != transport or envelope["kind"] not in ("join", "bucket"):
        raise RuntimeError(f"weight sync protocol: this engine takes {transport} weights from rank {source}, which "
                           f"sent a {envelope['transport']} {envelope['kind']!r} message; both sides must compute "
                           "the same transport (placement/weight_transport.py)")
