"""Move whole GRPO groups between trainer replicas so every replica gets a similar amount of work.

    balancer = Rebalancer(owners_comm, world_comm, owner_world_ranks, a=flops_coeff(h, layers))
    batch, info = balancer.rebalance(batch)     # collective over the replicas' data owners

Only lengths are exchanged collectively (allgather of per-group workloads); the assignment is the
same pure Karmarkar-Karp computation on every rank; then, if that evens the load by at least
`MIN_GAIN`, each group that changes replica travels point to point, once. Groups are never split.
The result is sorted by sample id.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from yatt_hpc.batch import SampleBatch
from yatt_hpc.comm.transport import recv_batch, send_batch
from yatt_hpc.sched.balance import balanced_partition, group_workload, imbalance

TAG_BALANCE = 15
MIN_GAIN = 0.01
"""Groups move only when that lowers the replicas' max/mean workload by at least this much. Moving costs
a transfer every step; measured on the demo (2 replicas, 8 groups each): the replicas were within 0.2%
of even as dealt, and moving 6 groups to reach 0.04% took ~8 ms of a ~0.2 s training phase."""


@dataclass
class BalanceInfo:
    before: float
    after: float
    moved_groups: int


class Rebalancer:
    def __init__(self, owners_comm, world_comm, owner_world_ranks: list[int], a: float | None,
                 shared_prompts: bool = False):
        self.comm, self.world = owners_comm, world_comm
        self.owner_world_ranks = owner_world_ranks  # index = dp rank
        self.a = a
        self.shared_prompts = shared_prompts  # the trainer computes each group's prompt once (group_workload)

    def rebalance(self, batch: SampleBatch) -> tuple[SampleBatch, BalanceInfo]:
        me = self.comm.Get_rank()
        groups, work = self._group_work(batch)
        gathered = self.comm.allgather((groups, work))
        units = [(int(g), float(w), dp) for dp, (gs, ws) in enumerate(gathered) for g, w in zip(gs, ws)]
        units.sort()  # by prompt id: the same unit order on every rank
        weights = [w for _, w, _ in units]
        k = self.comm.Get_size()
        before = [[i for i, u in enumerate(units) if u[2] == dp] for dp in range(k)]
        dest_of = self._assign(balanced_partition(weights, k), before)
        if imbalance(weights, self._parts(dest_of, k)) > imbalance(weights, before) - MIN_GAIN:
            dest_of = [u[2] for u in units]  # not worth a transfer: move nothing
        keep, outgoing = [], {}
        for i, (g, _, src) in enumerate(units):
            if src == me:
                (keep if dest_of[i] == me else outgoing.setdefault(dest_of[i], [])).append(g)
        parts = [batch.select(np.flatnonzero(np.isin(batch.prompt_id, keep)))]
        sources = {src for i, (_, _, src) in enumerate(units) if dest_of[i] == me and src != me}
        # pairwise exchanges in rank order, lower rank sends first: blocking sends cannot deadlock
        for other in sorted(sources | set(outgoing)):
            for action in (("send", "recv") if me < other else ("recv", "send")):
                if action == "send" and other in outgoing:
                    part = batch.select(np.flatnonzero(np.isin(batch.prompt_id, outgoing[other])))
                    send_batch(self.world, self.owner_world_ranks[other], TAG_BALANCE, part)
                elif action == "recv" and other in sources:
                    parts.append(recv_batch(self.world, self.owner_world_ranks[other], TAG_BALANCE)[0])
        after = self._parts(dest_of, k)
        moved = sum(1 for i, u in enumerate(units) if dest_of[i] != u[2])
        info = BalanceInfo(imbalance(weights, before), imbalance(weights, after), moved)
        return SampleBatch.concat(parts).sorted_by_id(), info

    def _group_work(self, batch: SampleBatch) -> tuple[np.ndarray, np.ndarray]:
        return group_workload(batch.prompt_len, batch.response_len, batch.prompt_id, self.a, self.shared_prompts)

    @staticmethod
    def _parts(dest_of: list[int], k: int) -> list[list[int]]:
        return [[i for i, d in enumerate(dest_of) if d == dp] for dp in range(k)]

    @staticmethod
    def _assign(parts: list[list[int]], before: list[list[int]]) -> list[int]:
        """Map each KK part to a replica, greedily keeping the most units in place."""
        dest_of = [0] * sum(len(p) for p in parts)
        pairs = sorted(((len(set(p) & set(b)), -pi, -dp) for pi, p in enumerate(parts) for dp, b in enumerate(before)),
                       reverse=True)
        used_parts, used_ranks = set(), set()
        for _, neg_pi, neg_dp in pairs:
            pi, dp = -neg_pi, -neg_dp
            if pi in used_parts or dp in used_ranks:
                continue
            used_parts.add(pi)
            used_ranks.add(dp)
            for i in parts[pi]:
                dest_of[i] = dp
        return dest_of
