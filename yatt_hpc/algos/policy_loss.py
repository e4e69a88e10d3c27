"""Per-token policy-gradient losses (before aggregation, `aggregate.py`), on [B, T] tensors.

    loss_tok, clipped = token_loss("vanilla", logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)

`logp` carries the gradient; `old_logp` is the behavior policy's (the rollout's) log-probability of
each token, `adv` the per-token advantage, `mask` 1 on the tokens that count. `clipped` marks the
tokens whose gradient the clip changed (the clip fraction's numerator). Every bound is an interval
on one named ratio: rho = pi_theta / pi_old in [1 - clip_low, 1 + clip_high].
"""
from __future__ import annotations

import torch

LOSS_MODES = ("vanilla", "gspo", "cispo")
LOG_RATIO_LIMIT = 20.0  # |log rho| beyond this is clamped before exp (verl's bound): no inf from a bad token
GSPO_LOG_RATIO_MAX = 10.0  # verl clamps GSPO's token log-ratio from above at 10


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return torch.clamp(logp - old_logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def clipped_ratio_loss(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
                       clip_ratio_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017) max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)),
    clip-higher when clip_high > clip_low (DAPO, Yu et al. 2025); with `clip_ratio_c` the dual clip
    (Ye et al. 2020) caps a negative advantage's loss at -A c (verl `clip_ratio_c`, default 3 there).
    verl `loss_mode=vanilla`, TRL's default clipped objective."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    hit = clipped > unclipped
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        hit = hit | dual
    return loss, hit


def token_loss(mode: str, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
               clip_low: float, clip_high: float,
               clip_ratio_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss of `mode` and the tokens it clipped.

    vanilla: `clipped_ratio_loss` of rho = exp(log pi - log pi_old).
    gspo (Zheng et al. 2025, GSPO): the sequence ratio s_i = exp(mean over the response of log pi - log pi_old)
      enters every token as sg(s_i) pi / sg(pi) (its value s_i, the token's own gradient), clipped like the PPO
      ratio; aggregated by sequence (seq-mean-token-mean) it is GSPO's sequence objective. verl `loss_mode=gspo`,
      TRL `importance_sampling_level="sequence"`.
    cispo (MiniMax 2025, CISPO): -sg(clip(rho, 1 - clip_low, 1 + clip_high)) A log pi: the importance weight is
      clipped and detached, so every token keeps a gradient. verl `loss_mode=cispo`; TRL's `epsilon_high` there
      is an absolute cap on the weight, ours bounds rho like every other mode."""
    mask = mask.to(logp.dtype)
    if mode == "vanilla":
        return clipped_ratio_loss(torch.exp(_log_ratio(logp, old_logp)), adv, clip_low, clip_high, clip_ratio_c)
    if mode == "gspo":
        log_ratio = _log_ratio(logp, old_logp) * mask
        seq = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)
        token = torch.clamp(logp - logp.detach() + seq.detach()[:, None], max=GSPO_LOG_RATIO_MAX)
        return clipped_ratio_loss(torch.exp(token), adv, clip_low, clip_high)
    if mode == "cispo":
        rho = torch.exp(_log_ratio(logp, old_logp)).detach()
        weight = torch.clamp(rho, 1.0 - clip_low, 1.0 + clip_high)
        return -adv * weight * logp, weight != rho
    raise ValueError(f"unknown policy loss mode {mode!r}; choose one of {', '.join(LOSS_MODES)}")
