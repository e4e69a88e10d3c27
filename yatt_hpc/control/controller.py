"""What the step loop asks of every group's controller, with the defaults a stateless group needs.

    class RolloutController(BaseController): ...   # override step(), identity, and what differs

A controller runs its group's part of a step and says what of it survives a restart. Rollout and
GenRM ranks only keep their RNG; the trainer overrides the checkpoint hooks with its weights,
optimizer and data position.
"""
from __future__ import annotations

from yatt_hpc.ckpt import RankState, capture_rng, restore_rng


class BaseController:
    shard: dict[str, int] = {}
    routes = None  # this step's Routes; every controller sets its own in __init__

    def set_routes(self, routes) -> None:
        """Take the routes of the coming step (a dynamic split changes them between steps)."""
        self.routes = routes

    @property
    def identity(self) -> str:
        raise NotImplementedError

    def step(self, step: int) -> None:
        raise NotImplementedError

    def checkpoint_state(self, step: int) -> RankState:
        return RankState(self.identity, rng=capture_rng())

    def restore(self, restored) -> None:
        restore_rng(restored.rng)

    def load_weights(self, loaded) -> None:
        """`checkpoint.load_from` weights; only the trainer has any."""

    def after_resume(self, step: int) -> None:
        """Re-establish cross-group state after a restore (e.g. rollout weights)."""

    def rewind_logs(self, step: int) -> None:
        """Forget per-step logs past `step`."""
