"""A rank of the engine pool of a dynamic split: rollout or GenRM, whichever the step's routes say.

    ctl = PoolController(world, cfg, stats, protocol)    # worker.py builds it for rollout/genrm ranks
    ctl.set_routes(Routes(plan, RoleSplit(rollout=1, next_rollout=2)))      # the loop, every step
    ctl.step(step)     # the role's step (see roles/rollout.py and roles/genrm.py), then next step's weights

It composes the two role controllers unchanged: both are built (a policy engine and a judge); the
policy engine stays released while the rank scores, and the judge while it generates. The rank receives the step's fresh weights
exactly when it generates in the next step (`Routes.next_rollout_ranks`), so a rank that switches
to rollout already holds them, and one that switches away never takes a transfer it would not use.
Its report counts under the role it served (`RankStats.group`), so per-role metrics stay right.
"""
from __future__ import annotations

import logging

from yatt_hpc.config.schema import RunConfig
from yatt_hpc.roles.base import BaseController
from yatt_hpc.roles.colocation import hand_over
from yatt_hpc.roles.genrm import GenRMController
from yatt_hpc.roles.protocol import StepProtocol
from yatt_hpc.roles.rollout import RolloutController
from yatt_hpc.runtime.rank_stats import RankStats

log = logging.getLogger(__name__)


class PoolController(BaseController):
    def __init__(self, world, cfg: RunConfig, stats: RankStats, protocol: StepProtocol):
        self.world, self.stats = world, stats
        self.rollout = RolloutController(world, cfg, stats, protocol)
        self.genrm = GenRMController(world, cfg, stats, protocol)
        self.home = self.rollout if world.group == "rollout" else self.genrm  # identity: the plan's group
        self.routes = self.rollout.routes
        # the step whose generation the engine's weights are for: the initial model is the trainer's
        # step-0 model unless checkpoint.load_from replaces it (then after_resume sends the weights)
        self.weights_for = -1 if cfg.checkpoint.load_from else 0
        self.role = ""

    def set_routes(self, routes) -> None:
        self.routes = routes
        self.rollout.set_routes(routes)
        self.genrm.set_routes(routes)

    def step(self, step: int) -> None:
        role = "rollout" if self.world.rank in self.routes.rollout_ranks() else "genrm"
        if role != self.role:
            self.switch_to(role, step)
        if role == "rollout":
            assert self.weights_for == step, f"rank {self.world.rank} would generate step {step} with the " \
                                             f"weights of step {self.weights_for}"
            self.rollout.generate_waves()
        else:
            self.genrm.step(step)
        self.maybe_receive_weights(step + 1)

    def switch_to(self, role: str, step: int) -> None:
        log.info("step %d: serving %s (was %s)", step, role, self.role or "-")
        self.role = self.stats.group = role
        judge = self.genrm.judge  # None with reward.mode=rule_only
        idle, active = (judge, self.rollout.engine) if role == "rollout" else (self.rollout.engine, judge)
        hand_over(self.stats, idle, active)

    def maybe_receive_weights(self, for_step: int) -> None:
        if self.world.rank in self.routes.next_rollout_ranks():
            self.rollout.receive_weights()
            self.weights_for = for_step

    # ------------------------------------------------------------------ checkpoint hooks

    @property
    def identity(self) -> str:
        return self.home.identity

    def close(self) -> None:
        self.rollout.close()
        self.genrm.close()

    def after_resume(self, step: int) -> None:
        self.maybe_receive_weights(step)  # the loop set routes whose next rollout ranks are step's
