"""Who talks to whom: pure routing of trainer replicas to rollout and GenRM ranks, from the plan.

    r = Routes(plan)
    r.rollout_for(dp=3)            # world rank of the rollout replica that samples replica 3's prompts
    r.replicas_of_rollout(world)   # trainer replicas a rollout rank serves (how many messages to expect)

    Routes(plan, RoleSplit(rollout=1, next_rollout=2))   # a dynamic split's routes for one step

Every rank computes the same routes from the same plan, so message counts are known in advance
and no termination protocol is needed. Trainer replica d is served by rollout replica d mod R and
GenRM replica d mod G; the batch owner is the replica's tensor-parallel rank 0.

With a dynamic split (`placement.dynamic_split`) the rollout and GenRM ranks form one pool: the
step's `RoleSplit` gives its first `rollout` ranks the rollout role and the rest GenRM (moving the
boundary by one switches one rank). Weights go to the ranks that generate in the *next* step.
"""
from __future__ import annotations

from dataclasses import dataclass

from yatt_hpc.placement import Plan


@dataclass(frozen=True)
class RoleSplit:
    """How many pool ranks serve rollout in this step and in the next one (the rest serve GenRM)."""

    rollout: int
    next_rollout: int


@dataclass(frozen=True)
class Routes:
    plan: Plan
    split: RoleSplit | None = None  # None: the plan's groups serve their own role every step

    def __post_init__(self) -> None:
        if self.split is not None:
            pool = len(self.plan.pool_ranks)
            assert self.plan.dynamic_split, "a RoleSplit needs placement.dynamic_split"
            assert 0 < self.split.rollout < pool and 0 < self.split.next_rollout < pool, (self.split, pool)

    @property
    def dp(self) -> int:
        return self.plan.group("trainer").size("dp")

    def trainer_owner(self, dp: int) -> int:
        """World rank of trainer replica `dp`'s data controller (tp=cp=pp=0)."""
        t = self.plan.group("trainer")
        tp, cp = t.size("tp"), t.size("cp")
        return t.rank_start + dp * tp * cp

    def stage_owners(self, dp: int) -> list[int]:
        """World ranks of trainer replica `dp`'s pipeline stage owners (tp=cp=0 of each stage), first stage first:
        each sends its stage's layers to the engines. Without pipeline parallelism, `[trainer_owner(dp)]`."""
        t = self.plan.group("trainer")
        stride = t.size("tp") * t.size("cp") * t.size("dp")
        return [self.trainer_owner(dp) + s * stride for s in range(t.size("pp"))]

    def expert_peers(self, dp: int) -> list[int]:
        """The trainer replicas of `dp`'s expert group (placement.trainer.ep consecutive replicas; Megatron's
        expert ranks run tp fastest, then ep, then expert data parallelism), `dp` among them."""
        ep = self.plan.group("trainer").ep
        return list(range(dp - dp % ep, dp - dp % ep + ep))

    def weight_senders(self, dp: int) -> list[int]:
        """World ranks that send replica `dp`'s weights to an engine, in the order the engine takes them: its
        stage owners (`stage_owners`), then those of the other replicas of its expert group, each with its own
        experts (ep > 1)."""
        return self.stage_owners(dp) + [o for p in self.expert_peers(dp) if p != dp for o in self.stage_owners(p)]

    def trainer_coords(self, world_rank: int) -> dict[str, int]:
        t = self.plan.group("trainer")
        return t.coords(world_rank - t.rank_start)

    def rollout_ranks(self) -> list[int]:
        """World ranks serving rollout this step (the plan's rollout group, or the split's first pool ranks)."""
        if self.split is not None:
            return list(self.plan.pool_ranks[: self.split.rollout])
        r = self.plan.group("rollout")
        return list(range(r.rank_start, r.rank_stop))

    def genrm_ranks(self) -> list[int]:
        """World ranks serving GenRM scoring this step."""
        if self.split is not None:
            return list(self.plan.pool_ranks[self.split.rollout:])
        g = self.plan.group("genrm")
        return list(range(g.rank_start, g.rank_stop))

    def next_rollout_ranks(self) -> list[int]:
        """World ranks that generate in the next step: the ones this step's weight sync updates."""
        if self.split is not None:
            return list(self.plan.pool_ranks[: self.split.next_rollout])
        return self.rollout_ranks()

    def rollout_for(self, dp: int) -> int:
        ranks = self.rollout_ranks()
        return ranks[dp % len(ranks)]

    def genrm_for(self, dp: int) -> int:
        ranks = self.genrm_ranks()
        return ranks[dp % len(ranks)]

    def replicas_of_rollout(self, world_rank: int) -> list[int]:
        return [d for d in range(self.dp) if self.rollout_for(d) == world_rank]

    def replicas_of_genrm(self, world_rank: int) -> list[int]:
        return [d for d in range(self.dp) if self.genrm_for(d) == world_rank]

    def weight_source_for(self, rollout_world_rank: int) -> int:
        """Trainer replica whose TP-rank-0 sends fresh weights to this (next step's) rollout rank."""
        return self.next_rollout_ranks().index(rollout_world_rank) % self.dp

    def weight_targets_of(self, dp: int) -> list[int]:
        return [w for w in self.next_rollout_ranks() if self.weight_source_for(w) == dp]
