"""The process group of one weight-sync pair (a trainer owner and one engine) and the manifest of a bucket.

    rendezvous, store = host_pair_store("yatt-weights-0-3", engine_ranks=1, backend="gloo")  # the owner
    ...send rendezvous.as_dict() to the engine over MPI (JSON)...
    group = PairGroup.connect(rendezvous, rank=0, store=store)       # the owner: rank 0 of the pair
    group = PairGroup.connect(rendezvous, rank=rendezvous.rank_offset)  # an HF engine: rank 1
    group.broadcast(tensors)      # rank 0 sends its tensors; every other rank receives into its own

Test it: tests/mpi/test_weight_collective.py (two processes, real Gloo groups) and
tests/unit/test_weight_transport.py (the manifest's wire format).

Why one group per pair, built directly: the default torch.distributed group is Megatron's on a trainer
rank, and a dynamic rollout/GenRM split changes a step's destinations while a pair's membership never
changes. A pair's group is a `TCPStore` the owner hosts on a free port of its host, and one
`ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) over it. SGLang's workers join the same group with
`init_weights_update_group` (ranks rank_offset.. rank_offset+tp-1), which builds theirs through torch's
`_new_process_group_helper` (read: sglang/srt/utils `init_custom_process_group`, torch
distributed_c10d); the store keys only meet if both sides use that key namespace, so `connect`
builds the same prefixes: PrefixStore(name), PrefixStore(name + "/"), PrefixStore(device + "/").
tests/unit/test_sglang_weights.py joins a trainer-side group built here with a worker that goes
through torch's helper, as SGLang's do.

A bucket's tensors never travel over MPI in this path: MPI carries the rendezvous (once per pair) and
each bucket's `BucketManifest` (names, dtypes, shapes, final); the tensors follow by broadcast, one per
tensor in manifest order, the order SGLang's `update_weights_from_distributed` receives them in.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch

DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)}
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default; the health monitor names a stall sooner


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"weight sync carries {', '.join(DTYPES)} tensors, got {name}")
    return name


def host_address() -> str:
    """This host's address as other hosts reach it (its name's address), or loopback without a resolvable name."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def pair_backend(device: str | torch.device) -> str:
    """The pair's collective backend for tensors on `device`: NCCL on CUDA, Gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass(frozen=True)
class Rendezvous:
    """Where a pair's group meets: what the owner sends the engine once, and what SGLang's
    `init_weights_update_group` takes (its argument names)."""

    master_address: str
    master_port: int
    world_size: int  # 1 (the owner) + the engine's ranks
    rank_offset: int  # the engine's first rank in the group (its TP workers follow)
    group_name: str
    backend: str  # "gloo" or "nccl"

    def as_dict(self) -> dict:
        """JSON-ready: the JOIN message's body."""
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, meta: dict) -> Rendezvous:
        return cls(**meta)


@dataclass(frozen=True)
class BucketManifest:
    """One bucket as the engine learns it before the tensors arrive: what SGLang's
    `update_weights_from_distributed` takes (names, dtypes, shapes, group_name) and whether the bucket
    ends a weight version (`final`: SGLang's flush_cache)."""

    group_name: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    final: bool

    @classmethod
    def of(cls, group_name: str, bucket: list[tuple[str, torch.Tensor]], final: bool) -> BucketManifest:
        return cls(group_name, tuple(n for n, _ in bucket), tuple(dtype_name(t.dtype) for _, t in bucket),
                   tuple(tuple(t.shape) for _, t in bucket), final)

    def as_dict(self) -> dict:
        """JSON-ready: the BUCKET message's body."""
        return {"group_name": self.group_name, "names": list(self.names), "dtypes": list(self.dtypes),
                "shapes": [list(s) for s in self.shapes], "final": self.final}

    @classmethod
    def from_dict(cls, meta: dict) -> BucketManifest:
        unknown = sorted(set(meta["dtypes"]) - DTYPES.keys())
        if unknown or not len(meta["names"]) == len(meta["dtypes"]) == len(meta["shapes"]):
            raise ValueError(f"bad weight bucket manifest (dtypes {unknown} unknown, or names/dtypes/shapes of "
                             f"different lengths): {meta}")
        return cls(meta["group_name"], tuple(meta["names"]), tuple(meta["dtypes"]),
                   tuple(tuple(s) for s in meta["shapes"]), bool(meta["final"]))

    @property
    def nbytes(self) -> int:
        return sum(DTYPES[d].itemsize * int(torch.Size(s).numel()) for d, s in zip(self.dtypes, self.shapes))

    def empty(self, device: str | torch.device) -> list[torch.Tensor]:
        """Fresh tensors to receive the bucket into, in manifest order."""
        return [torch.empty(s, dtype=DTYPES[d], device=device) for d, s in zip(self.dtypes, self.shapes)]

    def placeholders(self) -> list[tuple[str, torch.Tensor]]:
        """(name, storage-less tensor of its dtype and shape): for `validate_bucket` before anything arrives."""
        return [(n, torch.empty(s, dtype=DTYPES[d], device="meta")) for n, d, s in zip(self.names, self.dtypes, self.shapes)]


def host_pair_store(group_name: str, engine_ranks: int, backend: str,
                    timeout: datetime.timedelta = GROUP_TIMEOUT) -> tuple[Rendezvous, torch.distributed.Store]:
    """The owner's side: a TCPStore on a free port of this host (the OS picks it: no race) and the
    rendezvous naming it. The store must live as long as the group."""
    from torch.distributed import TCPStore

    world = 1 + engine_ranks
    store = TCPStore(host_address(), 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
    return Rendezvous(host_address(), store.port, world, 1, group_name, backend), store


class PairGroup:
    """A member of one pair's process group; rank 0 is the trainer owner."""

    def __init__(self, rendezvous: Rendezvous, rank: int, store, backend) -> None:
        self.rendezvous, self.rank, self._store, self._backend = rendezvous, rank, store, backend

    @classmethod
    def connect(cls, rendezvous: Rendezvous, rank: int, store=None,
                timeout: datetime.timedelta = GROUP_TIMEOUT) -> PairGroup:
        """Build this rank's member (blocks until every rank of the pair has joined). Rank 0 passes the
        store `host_pair_store` made; the others connect to it as clients."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import BackendConfig

        r = rendezvous
        if store is None:
            store = dist.TCPStore(r.master_address, r.master_port, r.world_size, is_master=False, timeout=timeout)
        # torch's helper registers one backend under the first device of the backend's device map
        device = next(iter(BackendConfig(dist.Backend(r.backend)).get_device_backend_map()))
        keys = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{r.group_name}/", dist.PrefixStore(r.group_name, store)))
        if r.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            options.group_name = r.group_name
            backend = dist.ProcessGroupNCCL(keys, rank, r.world_size, options)
        elif r.backend == "gloo":
            backend = dist.ProcessGroupGloo(keys, rank, r.world_size, timeout)
        else:
            raise ValueError(f"pair group {r.group_name}: backend {r.backend!r} is neither gloo nor nccl")
        backend._set_sequence_number_for_group()  # as torch's helper does on every member
        return cls(rendezvous, rank, store, backend)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """One broadcast per tensor from rank 0, all in flight together, then waited for: rank 0's
        tensors go out (they must be contiguous), every other rank's are overwritten."""
        import torch.distributed as dist

        works = []
        for tensor in tensors:
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = 0, 0
            works.append(self._backend.broadcast([tensor], options))
        for work in works:
            work.wait()
        if tensors and tensors[0].is_cuda:
            torch.cuda.current_stream(tensors[0].device).synchronize()  # the bucket may be freed after this
