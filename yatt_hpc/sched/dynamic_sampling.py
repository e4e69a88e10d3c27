"""Dynamic sampling (DAPO filter + WeChat-YATT v4 refill waves), as a small pure state machine.

    ds = DynamicSampler(target_groups=k, oversampling=1.2, ema_decay=0.9, ema_cap=10, max_waves=3)
    ask = ds.first_wave()                      # prompts to dispatch now
    ds.observe(total_groups, valid_groups)     # after scoring a wave (valid: reward variance > 0)
    ask = ds.next_wave(valid_so_far)           # 0 when the target is met or waves are exhausted
    ds.end_step(mean_expansion_across_dp)      # EMA update with the DP-averaged total/valid ratio

Groups with zero reward variance carry no GRPO signal and are dropped; each refill wave asks for
ceil(gap x ema_expansion x oversampling) prompts. After `max_waves` refills the step is padded
with masked groups. The state (`ema_expansion`) is checkpointed through `state()`/`load_state()`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


def has_signal(rewards) -> bool:
    """A GRPO group is valid when its rewards are not all equal."""
    return max(rewards) - min(rewards) > 1e-9


@dataclass
class DynamicSampler:
    target_groups: int
    oversampling: float = 1.2
    ema_decay: float = 0.9
    ema_cap: float = 10.0
    max_waves: int = 3
    ema_expansion: float = 1.0
    waves: int = 0
    total_groups: int = 0
    valid_groups: int = 0

    def first_wave(self) -> int:
        self.waves, self.total_groups, self.valid_groups = 0, 0, 0
        return self.target_groups

    def observe(self, total: int, valid: int) -> None:
        self.total_groups += total
        self.valid_groups += valid

    def next_wave(self) -> int:
        """Prompts for the next refill wave, or 0 (target met, or no waves left: pad the rest)."""
        gap = self.target_groups - self.valid_groups
        if gap <= 0 or self.waves >= self.max_waves:
            return 0
        self.waves += 1
        return math.ceil(gap * self.ema_expansion * self.oversampling)

    def padded_groups(self) -> int:
        return max(0, self.target_groups - self.valid_groups)

    def step_expansion(self) -> float:
        """This rank's total/valid ratio for the step (the cap when nothing was valid)."""
        if self.valid_groups == 0:
            return self.ema_cap
        return min(self.ema_cap, self.total_groups / self.valid_groups)

    def end_step(self, mean_expansion: float) -> None:
        """EMA update with the expansion averaged across data-parallel ranks."""
        blended = self.ema_decay * self.ema_expansion + (1 - self.ema_decay) * mean_expansion
        self.ema_expansion = min(self.ema_cap, max(1.0, blended))

    def state(self) -> dict[str, float]:
        return {"ema_expansion": self.ema_expansion}

    def load_state(self, state: dict[str, float]) -> None:
        self.ema_expansion = float(state["ema_expansion"])
