"""Which rollout rank generates which prompt group of a wave (`rollout.routing`).

    router = build_router(cfg.rollout.routing, owners_comm, dp_rank)   # trainer owners
    ranks = router.assign(routes, group_loads)  # world rank per group of this replica (collective for least_loaded)
    router.destinations(routes)               # rollout ranks that get one prompt message (maybe empty)
    router.spread                             # max/mean load over rollout ranks of the last wave (1.0 = even)
    expected_prompt_messages(kind, routes, world_rank)   # what a rollout rank waits for per wave

`static`: replica d's groups all go to `routes.rollout_for(d)` (d mod R), one message.
`least_loaded`: the owners allgather their groups' load estimates (numbers, never prompts) and
each computes the same longest-processing-time assignment over all groups of all replicas, every
group to the least-loaded rollout rank; a group (the n samples of one prompt) is never split.
Each owner then sends one (maybe empty) prompt message to every rollout rank, so message counts
stay known in advance. The load of a group is n x (prompt length + expected response length).
Routers take the step's `Routes` on every call and keep none: a dynamic split changes them per step.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from yatt_hpc.sched.routing import Routes


def assign_least_loaded(loads: Sequence[Sequence[float]], n_ranks: int) -> list[list[int]]:
    """LPT: for loads[replica][group], the rank index (0..n_ranks-1) of every group.

    Heaviest group first, each to the currently least-loaded rank; ties break on (replica, group)
    and on the rank index, so every caller with the same loads gets the same answer.
    """
    items = sorted(((-float(w), d, g) for d, row in enumerate(loads) for g, w in enumerate(row)))
    heap = [(0.0, r) for r in range(n_ranks)]
    out = [[0] * len(row) for row in loads]
    for neg, d, g in items:
        total, r = heapq.heappop(heap)
        out[d][g] = r
        heapq.heappush(heap, (total - neg, r))
    return out


def rank_loads(loads: Sequence[Sequence[float]], assignment: list[list[int]], n_ranks: int) -> np.ndarray:
    totals = np.zeros(n_ranks)
    for row, ranks in zip(loads, assignment):
        np.add.at(totals, np.asarray(ranks, np.int64), np.asarray(row, np.float64))
    return totals


def spread(totals: np.ndarray) -> float:
    """max/mean of the per-rank loads (1.0 when even or when there is nothing)."""
    return float(totals.max() / totals.mean()) if totals.size and totals.mean() > 0 else 1.0


class StaticRouter:
    def __init__(self, dp_rank: int):
        self.dp_rank, self.spread = dp_rank, 1.0

    def assign(self, routes: Routes, group_loads: Sequence[float]) -> list[int]:
        return [routes.rollout_for(self.dp_rank)] * len(group_loads)

    def destinations(self, routes: Routes) -> list[int]:
        """Rollout ranks that get a prompt message (maybe empty) from this replica every wave."""
        return [routes.rollout_for(self.dp_rank)]


class LeastLoadedRouter(StaticRouter):
    def __init__(self, dp_rank: int, owners_comm):
        super().__init__(dp_rank)
        self.owners_comm = owners_comm

    def assign(self, routes: Routes, group_loads: Sequence[float]) -> list[int]:
        gathered = dict(self.owners_comm.allgather((self.dp_rank, [float(w) for w in group_loads])))
        loads = [gathered[d] for d in range(routes.dp)]
        ranks = routes.rollout_ranks()
        assignment = assign_least_loaded(loads, len(ranks))
        self.spread = spread(rank_loads(loads, assignment, len(ranks)))
        return [ranks[i] for i in assignment[self.dp_rank]]

    def destinations(self, routes: Routes) -> list[int]:
        return routes.rollout_ranks()


def build_router(kind: str, owners_comm, dp_rank: int) -> StaticRouter:
    if kind == "least_loaded":
        return LeastLoadedRouter(dp_rank, owners_comm)
    assert kind == "static", kind
    return StaticRouter(dp_rank)


def expected_prompt_messages(kind: str, routes: Routes, world_rank: int) -> int:
    """Prompt messages a rollout rank receives per wave: from its own replicas, or from every replica."""
    return routes.dp if kind == "least_loaded" else len(routes.replicas_of_rollout(world_rank))
