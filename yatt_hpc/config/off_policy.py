"""The `train.off_policy:` section: the decoupled PPO objective and the importance-weight correction of the gap
between the engine that sampled (the behavior policy) and the trainer.

    train:
      off_policy: {proximal: recompute, correction: token_truncate, cap: 2.0}

Part of the typed configuration (`yatt_hpc.config.schema.TrainConfig.off_policy`); the formulas are
`yatt_hpc/algos/off_policy.py`, the guide docs/recipes.md ("Off-policy correction").
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from yatt_hpc.config.section import Section


class OffPolicyConfig(Section):
    """What the policy ratio is taken against, and how the engine/trainer gap is corrected."""

    proximal: Literal["engine", "recompute"] = "engine"
    """The ratio's old policy. `engine`: the engine's log-probabilities of the sampled tokens (the behavior
    policy; on-policy GRPO as today). `recompute`: the trainer's own log-probabilities under the weights before
    the update, computed in a forward pass over the step's samples (the proximal policy of decoupled PPO, AReaL
    `use_decoupled_loss`); the engine's are then used only for the importance weight of `correction`."""
    correction: Literal["none", "token_truncate", "sequence_truncate", "token_mask", "sequence_mask"] = "none"
    """The importance weight w = pi_proximal / pi_behavior on each token's policy-gradient term (not on the KL or
    entropy terms); TRL's `vllm_importance_sampling_mode` names. `token_truncate`: w_t capped at `cap` (TIS);
    `sequence_truncate`: the sequence's w = exp(sum_t log w_t), capped, on all its tokens; `token_mask`: w_t
    where it lies in [mask_low, mask_high], else 0 (IcePop); `sequence_mask`: the sequence's w, or 0 for every
    token when it lies outside. Needs `proximal: recompute`."""
    cap: float = Field(2.0, gt=0)
    """The truncation cap of `token_truncate` and `sequence_truncate` (verl, slime and WeChat-YATT use 2, TRL 3)."""
    mask_low: float = Field(0.5, ge=0)
    """The lower bound of w kept by `token_mask` and `sequence_mask`."""
    mask_high: float = Field(2.0, gt=0)
    """The upper bound of w kept by `token_mask` and `sequence_mask`."""

    @model_validator(mode="after")
    def _fields_agree(self) -> OffPolicyConfig:
        default = OffPolicyConfig.model_fields
        if self.correction != "none" and self.proximal != "recompute":
            raise ValueError(f"train.off_policy.correction={self.correction} weighs tokens by pi_proximal / "
                             "pi_behavior, and the proximal log-probabilities are the trainer's recomputed ones; set "
                             "train.off_policy.proximal=recompute, or train.off_policy.correction=none")
        truncate, mask = self.correction.endswith("truncate"), self.correction.endswith("mask")
        if self.cap != default["cap"].default and not truncate:
            raise ValueError(f"train.off_policy.cap={self.cap:g} caps a truncating correction, but "
                             f"train.off_policy.correction={self.correction}; use token_truncate or sequence_truncate, "
                             "or drop train.off_policy.cap")
        for f in ("mask_low", "mask_high"):
            if getattr(self, f) != default[f].default and not mask:
                raise ValueError(f"train.off_policy.{f}={getattr(self, f):g} bounds a masking correction, but "
                                 f"train.off_policy.correction={self.correction}; use token_mask or sequence_mask, "
                                 f"or drop train.off_policy.{f}")
        if not self.mask_low <= 1.0 <= self.mask_high:
            raise ValueError(f"train.off_policy.mask_low={self.mask_low:g} and mask_high={self.mask_high:g} must hold "
                             "w = 1 (the on-policy weight) between them: mask_low <= 1 <= mask_high")
        return self
