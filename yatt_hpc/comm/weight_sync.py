"""Trainer -> engine weight sync in size-bounded buckets, each destination by its pair's transport.

    sender = WeightSender(comm, pairs, bucket_mb=64, device="cuda:0")  # pairs: placement.weight_pairs(...)
    sent = sender.send(dests, policy.hf_weights())    # every TP rank drains the iterator (a TP gather)
    sent.nbytes, sent.mpi_bytes, sent.buckets
    receive_weights(comm, sources, engine, transport) # an engine rank: one weight version, final bucket last

The protocol, per destination, every message on TAG_WEIGHTS from its owner (ipc's answer back on
TAG_WEIGHTS_DONE); `receive_weights` refuses a message of another transport, naming both:

    mpi         per bucket: BUCKET(manifest of names, dtypes, shapes), then each tensor's bytes as a message
    collective  once per pair: JOIN(rendezvous); per bucket: BUCKET(manifest), then one broadcast per
                tensor over the pair's group (`yatt_hpc/device/weight_group.py`)
    ipc         per bucket: BUCKET(manifest, payload = the tensors' CUDA IPC handles) -> DONE from the
                engine once it holds its copies (the owner keeps the bucket alive until then)

A message is an int64 pair (envelope bytes, payload bytes), a JSON envelope {kind, transport, body, pieces}
and the payload as `pieces` messages of those sizes, if any. Tensor data is never pickled: an mpi tensor is its
raw bytes; ipc pickles only the handles (`comm/weight_ipc.py`). An mpi tensor is sent from its own bytes (a
contiguous CPU weight: no copy) and received into a tensor of its dtype and shape, which the engine takes as
its own (`take_weights`): an `hf` engine that gave its weights back for the sync keeps the received tensors as
its parameters. No bucket is packed into one buffer and unpacked again, and no parameter is allocated and
copied into after arriving: at Qwen2.5-0.5B's size (2 GB in fp32) those were three copies of the weights a sync.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
            body, pieces = _mpi_bucket(bucket, final)
            sent += sum(send_message(self.comm, d, "bucket", "mpi", body, pieces) for d in by["mpi"])
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
            sent += sum(send_message(self.comm, d, "bucket", "ipc", body, [payload]) for d in by["ipc"])
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


def _mpi_bucket(bucket: Bucket, final: bool) -> tuple[dict, list[np.ndarray]]:
    """The manifest and each tensor's bytes (a view of a contiguous CPU tensor, not a copy)."""
    entries, pieces = [], []
    for name, tensor in bucket:
        flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        entries.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)})
        pieces.append(flat)
    return {"final": final, "tensors": entries}, pieces


def send_message(comm, dest: int, kind: str, transport: str, body: dict, pieces: Sequence[np.ndarray] = ()) -> int:
    """One protocol message, its payload as one MPI message a piece; returns the bytes it put on MPI."""
    sizes = [int(p.size) for p in pieces]
    envelope = np.frombuffer(json.dumps({"kind": kind, "transport": transport, "body": body,
                                         "pieces": sizes}).encode(), np.uint8)
    DOORBELL.ring(comm, dest)  # a payload larger than eager waits for the receiver to match it
    comm.Send(np.array([envelope.size, sum(sizes)], dtype=np.int64), dest=dest, tag=TAG_WEIGHTS)
    comm.Send(envelope, dest=dest, tag=TAG_WEIGHTS)
    for piece in pieces:
        if piece.size:
            comm.Send(piece, dest=dest, tag=TAG_WEIGHTS)
    ACTIVITY.progress("send weights")
    return 16 + envelope.size + sum(sizes)


def recv_envelope(comm, source: int) -> dict:
    """The next message's envelope; its pieces, if any, follow (`recv_pieces`)."""
    wait_for_message(comm, source, TAG_WEIGHTS)
    sizes = np.empty(2, dtype=np.int64)
    comm.Recv(sizes, source=source, tag=TAG_WEIGHTS)
    envelope = np.empty(int(sizes[0]), dtype=np.uint8)
    comm.Recv(envelope, source=source, tag=TAG_WEIGHTS)
    message = json.loads(envelope.tobytes())
    if sum(message["pieces"]) != int(sizes[1]):
        raise RuntimeError(f"weight sync protocol: rank {source} announced {int(sizes[1])} payload bytes but its "
                           f"envelope lists pieces of {message['pieces']}")
    return message


def recv_pieces(comm, source: int, envelope: dict, buffers: list[np.ndarray]) -> None:
    """Receive the envelope's pieces into `buffers` (uint8 arrays of the announced sizes, in order)."""
    if [int(b.size) for b in buffers] != envelope["pieces"]:
        raise RuntimeError(f"weight sync protocol: rank {source} sends pieces of {envelope['pieces']} bytes, the "
                           f"receiver expected {[int(b.size) for b in buffers]} (the manifest and the payload differ)")
    for buffer in buffers:
        if buffer.size:
            comm.Recv(buffer, source=source, tag=TAG_WEIGHTS)


def _recv_mpi_bucket(comm, source: int, envelope: dict) -> Bucket:
    """The bucket's tensors, each received straight into a tensor of its own dtype and shape."""
    bucket = [(e["name"], torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]])) for e in envelope["body"]["tensors"]]
    recv_pieces(comm, source, envelope, [t.reshape(-1).view(torch.uint8).numpy() for _, t in bucket])
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
        envelope = recv_envelope(comm, source)
        _expect(envelope, transport, source)
        body = envelope["body"]
        if envelope["kind"] == "join":
            with ACTIVITY.waiting(f"join weight group {body['group_name']}"):
                engine.join_weight_group(Rendezvous.from_dict(body))
            continue
        final = bool(body["final"]) and last
        if transport == "mpi":
            engine.take_weights(_recv_mpi_bucket(comm, source, envelope), final=final)
        elif transport == "collective":
            with ACTIVITY.waiting(f"receive weights from {source}"):
                engine.update_weights_from_group(BucketManifest.from_dict(body))
        else:
            payload = np.empty(sum(envelope["pieces"]), dtype=np.uint8)
            recv_pieces(comm, source, envelope, [payload])
            engine.take_weights(rebuild_ipc_bucket(payload), final=final)
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
