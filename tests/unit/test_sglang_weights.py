"""The SGLang adapter's collective path (`rollout/sglang_weights.py`) on CPU, against a stand-in for sglang.Engine.

    .venv/bin/python -m pytest tests/unit/test_sglang_weights.py -q

The adapter makes exactly the calls it makes on `sglang.Engine`; the stand-in (tests/programs/sglang_standin.py)
answers them with two spawned workers that join the pair's Gloo group the way SGLang's TP workers do
(torch's `_new_process_group_helper`) and receive every tensor by broadcast. The trainer owner's side is
yatt_hpc/device/weight_group.py's `PairGroup` on a thread of this process: real groups, real processes.
"""
import threading

import pytest
import torch

from tests.programs.sglang_standin import StandInEngine
from yatt_hpc.device.weight_group import BucketManifest, PairGroup, host_pair_store
from yatt_hpc.rollout.sglang_weights import SGLangWeights

TP = 2


def version(v: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Weight version `v` in three buckets, fp32 and bf16 mixed (seeded: the same on every call)."""
    g = torch.Generator().manual_seed(v)
    return [[("a.weight", torch.randn(16, 8, generator=g)), ("a.bias", torch.randn(8, generator=g).bfloat16())],
            [("b.weight", torch.randn(33, 7, generator=g))],
            [("c.weight", torch.randn(5, 5, generator=g).bfloat16()), ("d.scalar", torch.randn((), generator=g))]]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Owner:
    """The trainer owner's side of the pair, on a thread: hosts the store, connects as rank 0, broadcasts."""

    def __init__(self) -> None:
        self.rendezvous, self._store = host_pair_store("yatt-weights-0-1", engine_ranks=TP, backend="gloo")
        self.group: PairGroup | None = None
        self._thread = threading.Thread(target=self._connect)
        self._thread.start()

    def _connect(self) -> None:
        self.group = PairGroup.connect(self.rendezvous, 0, self._store)

    def joined(self) -> PairGroup:
        self._thread.join(120)
        assert self.group is not None, "the owner's side never formed the group"
        return self.group

    def send(self, bucket) -> threading.Thread:
        thread = threading.Thread(target=self.group.broadcast, args=([t.contiguous() for _, t in bucket],))
        thread.start()
        return thread


@pytest.fixture(scope="module")
def pair():
    engine = StandInEngine(tp_size=TP)
    shapes = {n: tuple(t.shape) for bucket in version(1) for n, t in bucket}
    weights = SGLangWeights(engine, shapes, torch.device("cpu"))
    owner = Owner()
    weights.join_group(owner.rendezvous)  # every worker joins; the owner's connect returns with them
    owner.joined()
    yield engine, weights, owner
    engine.shutdown()


def load(weights: SGLangWeights, owner: Owner, buckets, name="yatt-weights-0-1") -> list[tuple[bool, int]]:
    seen = []
    for i, bucket in enumerate(buckets):
        sending = owner.send(bucket)
        weights.load_from_group(BucketManifest.of(name, bucket, final=i == len(buckets) - 1))
        sending.join(120)
        seen.append((weights.mid_update, weights.version))
    return seen


def test_workers_join_at_rank_offset_with_their_tp_rank(pair):
    engine, weights, owner = pair
    assert owner.rendezvous.world_size == 1 + TP and owner.rendezvous.rank_offset == 1
    assert engine.joined == [f"joined yatt-weights-0-1 as rank {1 + r} of {1 + TP}" for r in range(TP)]
    assert weights.groups == {"yatt-weights-0-1"}


def test_two_versions_arrive_bitwise_flush_once_each_and_bump_the_version(pair):
    engine, weights, owner = pair
    for v in (1, 2):
        flushes, updates = engine.flushes, engine.updates
        seen = load(weights, owner, version(v))
        # mid-update until the final bucket, which flushes SGLang's cache once and bumps the version
        assert seen == [(True, v - 1), (True, v - 1), (False, v)]
        assert (engine.flushes, engine.updates) == (flushes + 1, updates + 3)
        sent = {n: t for bucket in version(v) for n, t in bucket}
        for tp_rank in range(TP):
            held = engine.weights(tp_rank)
            assert held.keys() == sent.keys()
            for name, tensor in sent.items():
                assert held[name].dtype == tensor.dtype and torch.equal(bits(held[name]), bits(tensor)), (v, tp_rank, name)


def test_a_bad_name_or_shape_is_refused_before_sglang_sees_the_bucket(pair):
    engine, weights, _ = pair
    updates = engine.updates
    for bad, match in ((("a.wieght", torch.zeros(16, 8)), "unknown weight name 'a.wieght'.*a.weight"),
                       (("a.weight", torch.zeros(8, 16)), "shape mismatch for 'a.weight'")):
        with pytest.raises(ValueError, match=match):
            weights.load_from_group(BucketManifest.of("yatt-weights-0-1", [bad], final=False))
    with pytest.raises(RuntimeError, match="no weight group 'other'"):
        weights.load_from_group(BucketManifest.of("other", [("a.weight", torch.zeros(16, 8))], final=True))
    assert engine.updates == updates and not weights.mid_update


def test_an_empty_final_bucket_flushes_and_ends_the_version(pair):
    engine, weights, _ = pair
    flushes, before = engine.flushes, weights.version
    weights.load_from_group(BucketManifest.of("yatt-weights-0-1", [], final=True), version=before + 5)
    assert engine.flushes == flushes + 1 and weights.version == before + 5
