"""The DP gradient all-reduce in buckets: the plan, the copy in and out, and bitwise equality with one
all-reduce per parameter across two gloo ranks.

    .venv/bin/python -m pytest tests/unit/test_grad_buckets.py -q
"""
from __future__ import annotations

import datetime
import threading

import pytest
import torch

from yatt_hpc.optim.buckets import allreduce_bucketed, plan_buckets

F32, BF16 = torch.float32, torch.bfloat16


def _tensors(spec):
    return [torch.empty(n, dtype=dtype) for n, dtype in spec]


@pytest.mark.parametrize("spec, limit, expected", [
    pytest.param([(4, F32)] * 5, 40, [[0, 1], [2, 3], [4]], id="fills-each-bucket-up-to-the-limit"),
    pytest.param([(4, F32)] * 3, 48, [[0, 1, 2]], id="exactly-the-limit-fits"),
    pytest.param([(2, F32), (100, F32), (2, F32)], 16, [[0], [1], [2]], id="oversized-tensor-alone"),
    pytest.param([(4, F32), (4, BF16), (4, F32), (4, BF16)], 64, [[0, 2], [1, 3]], id="one-dtype-per-bucket"),
    pytest.param([(4, F32), (8, BF16), (4, F32)], 16, [[0], [1], [2]], id="bytes-not-elements"),
    pytest.param([], 16, [], id="nothing-to-reduce"),
])
def test_plan_buckets(spec, limit, expected):
    tensors = _tensors(spec)
    buckets = plan_buckets(tensors, limit)
    assert buckets == expected
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(tensors)))


class _LoggingReduce:
    """A one-rank collective: records each call and doubles, so a wrong copy-back shows up."""

    def __init__(self):
        self.sizes = []

    def __call__(self, tensor, group=None):
        self.sizes.append(tensor.numel())
        tensor.mul_(2)


def test_bucketed_reduce_writes_every_element_back_to_its_own_tensor(monkeypatch):
    generator = torch.Generator().manual_seed(21)
    shapes = [((3, 5), F32), ((7,), BF16), ((2, 2, 2), F32), ((11,), F32), ((4, 3), BF16)]
    tensors = [torch.randn(*shape, generator=generator).to(dtype) for shape, dtype in shapes]
    expected = [2 * t for t in tensors]
    reduce = _LoggingReduce()
    monkeypatch.setattr(torch.distributed, "all_reduce", reduce)
    allreduce_bucketed(tensors, group=None, limit_bytes=64)
    assert all(torch.equal(t, e) and t.dtype == e.dtype for t, e in zip(tensors, expected, strict=True))
    # 64 bytes hold 16 fp32 or 32 bf16 elements: buckets [0], [1, 4], [2], [3], one call each
    assert reduce.sizes == [15, 7 + 12, 8, 11]


# ---------------------------------------------------------------------------------- two gloo ranks

SHAPES = [((64, 32), F32), ((32,), F32), ((5, 7), BF16), ((300,), F32), ((1,), F32), ((16, 16), BF16)]


def _rank(rank: int, world: int, store, results: dict) -> None:
    group = torch.distributed.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=60))
    generator = torch.Generator().manual_seed(100 + rank)
    grads = [torch.randn(*shape, generator=generator).to(dtype) for shape, dtype in SHAPES]
    one_by_one = [g.clone() for g in grads]
    for g in one_by_one:
        torch.distributed.all_reduce(g, group=group)
    allreduce_bucketed(grads, group, limit_bytes=1024)
    results[rank] = {"bucketed": grads, "per_parameter": one_by_one}


def test_two_rank_bucketed_allreduce_is_bitwise_the_per_parameter_allreduce():
    """Two real gloo ranks as two threads of this process (a process each would only add imports)."""
    assert len(plan_buckets([torch.empty(shape, dtype=dtype) for shape, dtype in SHAPES], 1024)) > 2
    store, results = torch.distributed.HashStore(), {}
    ranks = [threading.Thread(target=_rank, args=(rank, 2, store, results)) for rank in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=120)
    assert sorted(results) == [0, 1], "a rank failed; its traceback is printed above"
    for result in results.values():
        for got, want in zip(result["bucketed"], result["per_parameter"], strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["bucketed"], results[1]["bucketed"], strict=True))
