"""The dynamic rollout/GenRM split of `partial` placement: pure decisions, no MPI.

    decision = decide_split(current=2, pool=3, replicas=2, rollout_busy_s=1.0, genrm_busy_s=6.0)
    decision.rollout                       # -> 1: one pool rank generates, two score
    schedule = SplitSchedule.from_config(cfg, plan)      # the loop's per-step state (see loop.py)

Load: the busy seconds each role spent last step, summed over its ranks ("rollout" phases of the
rollout ranks, "reward" phases of the GenRM ranks): replica-seconds of work, which do not depend
on how many replicas shared them. Trainer replica d is routed to the (d mod n)-th rank of a role,
so with `replicas` trainer replicas the busiest rank of a role with n ranks does ceil(replicas/n)
replicas' share; `predicted_busy_s` is the larger of the two roles' busiest ranks. The rule takes
the split that minimises it (ties: the fewest switches, then the proportional share
pool * rollout/(rollout+genrm)), within [min_replicas, pool - min_replicas], and only if it beats
the current split by the `hysteresis` fraction, so noise does not make ranks flip back and forth.

Timing: step t's weights go to the ranks that generate in step t+1 at the end of step t, before
step t's load is known to the leader, so the split of step t+2 is decided from step t's load (one
step of lag, and a rank never needs a second weight transfer when it switches to rollout).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from yatt_hpc.sched.routing import RoleSplit


@dataclass(frozen=True)
class SplitDecision:
    rollout: int  # rollout replicas chosen (the pool's others serve GenRM)
    predicted_busy_s: float  # busiest replica at that split, from the measured load
    current_busy_s: float  # busiest replica had the split stayed
    reason: str


def predicted_busy_s(rollout: int, pool: int, replicas: int, rollout_busy_s: float, genrm_busy_s: float) -> float:
    """Busy seconds of the busiest engine replica when `rollout` of `pool` replicas generate."""
    per_rollout, per_genrm = rollout_busy_s / replicas, genrm_busy_s / replicas
    return max(math.ceil(replicas / rollout) * per_rollout, math.ceil(replicas / (pool - rollout)) * per_genrm)


def decide_split(current: int, pool: int, replicas: int, rollout_busy_s: float, genrm_busy_s: float,
                 min_replicas: int = 1, hysteresis: float = 0.1) -> SplitDecision:
    """The next split (rollout replicas) from the last measured load; deterministic for equal inputs."""
    low, high = min_replicas, pool - min_replicas
    assert 1 <= low <= high and replicas >= 1, (low, high, replicas)
    current = min(max(current, low), high)
    total = rollout_busy_s + genrm_busy_s
    if total <= 0:
        return SplitDecision(current, 0.0, 0.0, "no load measured: keep")
    share = pool * rollout_busy_s / total

    def cost(n: int) -> float:
        return predicted_busy_s(n, pool, replicas, rollout_busy_s, genrm_busy_s)

    best = min(range(low, high + 1), key=lambda n: (cost(n), abs(n - current), abs(n - share), n))
    now = cost(current)
    if best == current:
        return SplitDecision(current, now, now, "already the best split")
    if cost(best) > (1.0 - hysteresis) * now:
        return SplitDecision(current, now, now, f"{best} predicts {cost(best):.3g}s vs {now:.3g}s: within "
                                                f"hysteresis {hysteresis:.0%}, keep")
    return SplitDecision(best, cost(best), now, f"{best} predicts {cost(best):.3g}s vs {now:.3g}s")


def role_busy_s(reports: list[dict]) -> tuple[float, float]:
    """(rollout, GenRM) busy seconds of one step, summed over the ranks that served each role."""
    rollout = sum(r["times"].get("rollout", 0.0) for r in reports if r["group"] == "rollout")
    genrm = sum(r["times"].get("reward", 0.0) for r in reports if r["group"] == "genrm")
    return rollout, genrm


@dataclass
class SplitSchedule:
    """Between steps: `current` is the split of the step about to run (known to every rank) and
    `pending` the one after it (decided by the leader; the others learn it at the step's agreement)."""

    pool: int
    replicas: int
    min_replicas: int
    hysteresis: float
    current: int
    pending: int
    ran: int = 0  # the split of the step that just ended (for its metrics)
    busy: tuple[float, float] = (0.0, 0.0)
    decision: SplitDecision | None = None

    @classmethod
    def from_config(cls, cfg, plan) -> SplitSchedule:
        first = plan.group("rollout").tasks
        ds = cfg.placement.dynamic_split
        return cls(len(plan.pool_ranks), plan.group("trainer").size("dp"), ds.min_replicas, ds.hysteresis,
                   first, first)

    def agreed(self, pending: int) -> RoleSplit:
        """The step's routes once every rank holds the leader's `pending`."""
        self.pending = pending
        return RoleSplit(self.current, pending)

    def end_step(self, reports: list[dict] | None) -> None:
        """Every rank: move on one step. The leader (the one with `reports`) decides the step after next."""
        self.ran, self.current = self.current, self.pending
        if reports is None:
            return
        self.busy = role_busy_s(reports)
        self.decision = decide_split(self.current, self.pool, self.replicas, *self.busy,
                                     min_replicas=self.min_replicas, hysteresis=self.hysteresis)
        self.pending = self.decision.rollout

    def scalars(self) -> dict[str, float]:
        """Metrics of the step that just ended (leader, after `end_step`)."""
        d = self.decision
        return {"placement/rollout_replicas": float(self.ran), "placement/genrm_replicas": float(self.pool - self.ran),
                "placement/rollout_busy_s": self.busy[0], "placement/genrm_busy_s": self.busy[1],
                "placement/decided_rollout_replicas": float(self.pending),
                "placement/predicted_busy_s": d.predicted_busy_s if d else 0.0}

    def counters(self) -> dict[str, int]:
        """Checkpoint counters (the leader's copy is saved)."""
        return {"split_rollout": self.current, "split_rollout_next": self.pending}

    def restore(self, counters: dict[str, int]) -> bool:
        """Take a checkpoint's split; False (and keep the configured one) if it has none or it no longer fits."""
        now, nxt = counters.get("split_rollout"), counters.get("split_rollout_next")
        fits = lambda n: n is not None and self.min_replicas <= n <= self.pool - self.min_replicas  # noqa: E731
        if not (fits(now) and fits(nxt)):
            return False
        self.current, self.pending = int(now), int(nxt)
        return True
