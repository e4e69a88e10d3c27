"""Data-parallel load balancing: Karmarkar-Karp (largest differencing) over a FLOPs proxy.

    work = workload(lengths, a=flops_coeff(hidden, layers))   # a*L + L^2 per sample (or plain L)
    groups, work = group_workload(prompt_len, response_len, prompt_id, a, shared_prompts=True)  # per group
    a = balance_coeff(cfg.train, hidden)                      # the `a` train.balance* choose
    parts = balanced_partition(work_per_group, k=dp)         # KK, then moves/swaps: k lists of unit indices

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


def group_workload(prompt_len: np.ndarray, response_len: np.ndarray, group_ids: np.ndarray, a: float | None,
                   shared_prompts: bool) -> tuple[np.ndarray, np.ndarray]:
    """(groups, each group's cost) over its samples, as the trainer computes them.

    Padded rows (`shared_prompts` False): the sum of `workload(P + R)` over the group's samples. With the
    shared-prompt forward (`train/shared_prompt.py`) a group's prompt is computed once: a*P + P^2 for it
    (its tokens; its causal attention) plus a*R + R*(P + R) per sample (its response tokens, each attending
    to the prompt and to the response so far); plain tokens (`a` None) count P + sum(R). Both on
    `workload`'s scale: a per token, one per query-key pair the attention computes.
    """
    groups, first, inverse = np.unique(np.asarray(group_ids), return_index=True, return_inverse=True)
    prompt = np.asarray(prompt_len, dtype=np.float64)
    response = np.asarray(response_len, dtype=np.float64)
    if not shared_prompts:
        return groups, np.bincount(inverse, weights=workload(prompt + response, a), minlength=len(groups))
    p = prompt[first]
    if a is None:
        return groups, p + np.bincount(inverse, weights=response, minlength=len(groups))
    per_sample = a * response + response * (prompt + response)
    return groups, a * p + p**2 + np.bincount(inverse, weights=per_sample, minlength=len(groups))


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


# Pairs of units are exchanged too in parts of at most this many units, when the step has at most
# PAIR_EXCHANGE_MAX_TOTAL units: few units per rank is where single exchanges get stuck, and a round
# costs (ranks - 1) * (units per part)^4 there.
PAIR_EXCHANGE_MAX_UNITS, PAIR_EXCHANGE_MAX_TOTAL = 12, 256


def refine(weights: Sequence[float], parts: list[list[int]], max_moves: int | None = None,
           tolerance: float = 1e-4) -> list[list[int]]:
    """Lower the heaviest part of a partition by exchanging whole units with another part (after KK).

    Each round pairs the heaviest part with every other and tries every exchange of up to two of its
    units against up to two of the other's (none: a plain move; pairs only in parts of <= 12 units and
    steps of <= 256) whose net weight d lies in (0, gap); it applies the one that removes the most from
    the sum of squared part sums (d * (gap - d)). It stops when none is left, when max/mean is within
    `tolerance` of 1 or the heaviest part is down to the largest unit, or after `max_moves` (default
    4 * number of units). Both sums of a pair stay within the pair's old range, so the maximum never
    rises; ties break on indices, so every rank computes the same answer. KK alone leaves a median
    1.044 max/mean at 32 groups over 8 ranks (B3, bench/dp_balance.py).
    """
    w = [float(x) for x in weights]
    parts = [sorted(p) for p in parts]
    sums = [sum(w[i] for i in p) for p in parts]
    limit = 4 * len(w) if max_moves is None else max_moves
    pairs_too = len(w) <= PAIR_EXCHANGE_MAX_TOTAL

    def subsets(part: list[int], smallest: int) -> list[tuple[tuple[int, ...], float]]:
        out = []
        for size in range(smallest, 3 if pairs_too and len(part) <= PAIR_EXCHANGE_MAX_UNITS else 2):
            out.extend((c, sum(w[i] for i in c)) for c in itertools.combinations(part, size))
        return out

    floor = max(sum(sums) / max(len(parts), 1) * (1 + tolerance), max(w, default=0.0))  # no partition goes lower
    for _ in range(limit):
        if max(sums) <= floor:
            break
        order = sorted(range(len(parts)), key=lambda j: (-sums[j], j))
        h = order[0]
        give = subsets(parts[h], 1)  # what the heaviest part can give: the same for every partner
        best = None  # (squares removed, light part, units out of heavy, units out of light, d)
        for lo in order[1:]:
            gap = sums[h] - sums[lo]
            if gap <= 0:
                continue
            take = subsets(parts[lo], 0)
            for out_units, out_w in give:
                for in_units, in_w in take:
                    d = out_w - in_w
                    if 0 < d < gap and (best is None or d * (gap - d) > best[0]):
                        best = (d * (gap - d), lo, out_units, in_units, d)
        if best is None:
            break
        _, lo, out_units, in_units, d = best
        parts[h] = sorted(set(parts[h]) - set(out_units) | set(in_units))
        parts[lo] = sorted(set(parts[lo]) - set(in_units) | set(out_units))
        sums[h] -= d
        sums[lo] += d
    return parts


def balanced_partition(weights: Sequence[float], k: int) -> list[list[int]]:
    """What the trainer balances with: Karmarkar-Karp, then `refine`; parts ordered as KK orders them."""
    parts = refine(weights, karmarkar_karp(weights, k))
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
