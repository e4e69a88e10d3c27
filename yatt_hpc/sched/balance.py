"""Data-parallel load balancing: Karmarkar-Karp (largest differencing) over a FLOPs proxy.

    work = workload(lengths, a=flops_coeff(hidden, layers))   # a*L + L^2 per sample (or plain L)
    a = balance_coeff(cfg.train, hidden)                      # the `a` train.balance* choose
    parts = karmarkar_karp(work_per_group, k=dp)             # list of k lists of unit indices

Units are GRPO groups (all samples of one prompt), so a group is never split across ranks.
Every rank runs the same pure computation on the same allgathered lengths and gets the same
answer; only the samples that change rank then move, point to point.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np


def flops_coeff(hidden_size: int, num_layers: int) -> float:
    """`a` in a*L + L^2: the linear (MLP/projection) cost per token relative to attention's L^2.

    Per layer a token costs ~24*h^2 FLOPs in the dense parts and ~4*h*L in attention, so the
    ratio of the linear term to the quadratic one is 6*h (verl's 24576 for h=4096).
    """
    return 6.0 * hidden_size


def balance_coeff(train, hidden_size: int) -> float | None:
    """`a` of the workload `train.balance` evens out (a `TrainConfig`; `none` balances nothing):
    None (plain token counts) for `tokens`; for `flops`, `train.balance_flops_coeff`, or
    `flops_coeff(hidden_size, 1)` when that is null."""
    assert train.balance != "none", "train.balance=none builds no balancer"
    if train.balance == "tokens":
        return None
    return train.balance_flops_coeff if train.balance_flops_coeff is not None else flops_coeff(hidden_size, 1)


def workload(lengths: np.ndarray, a: float | None) -> np.ndarray:
    """Per-sample cost: a*L + L^2, or L itself when `a` is None (plain token count)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths if a is None else a * lengths + lengths**2


def karmarkar_karp(weights: Sequence[float], k: int) -> list[list[int]]:
    """Partition unit indices into k sets with near-equal weight sums (largest differencing method).

    Each heap entry is a k-way partial partition (k subset sums, sorted descending) keyed by its
    spread; the two largest-spread entries are merged by pairing the heaviest subset of one with
    the lightest of the other, until one partition remains. Deterministic: ties break on an id.
    """
    if k < 1:
        raise ValueError(f"k={k}: need at least one partition")
    counter = itertools.count()
    heap = []
    for index, w in enumerate(weights):
        sets = [(float(w), [index])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-float(w), next(counter), sets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    parts = [sorted(indices) for _, indices in heap[0][2]]
    return sorted(parts, key=lambda p: (p[0] if p else float("inf")))


def contiguous_split(n: int, k: int) -> list[list[int]]:
    """Baseline: equal-count contiguous chunks (what an unbalanced loader gives)."""
    bounds = np.linspace(0, n, k + 1).round().astype(int)
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


def sorted_stride_split(weights: Sequence[float], k: int) -> list[list[int]]:
    """Baseline: sort by weight, deal round-robin."""
    order = np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable")
    return [sorted(order[i::k].tolist()) for i in range(k)]


def imbalance(weights: Sequence[float], parts: list[list[int]]) -> float:
    """max/mean of the partition sums (1.0 is perfect)."""
    w = np.asarray(weights, dtype=np.float64)
    sums = np.array([w[p].sum() for p in parts])
    return float(sums.max() / sums.mean()) if sums.mean() > 0 else 1.0
