"""GRPO math: group-normalized advantages, the clipped policy loss, the k3 KL estimate.

    adv = group_advantages(rewards, group_ids)                      # numpy, per sample
    loss, stats = policy_loss(logp, old_logp, adv_tok, mask, clip_low=0.2, clip_high=0.28,
                              ref_logp=ref, kl_coef=0.01, entropy=ent, entropy_coef=0.0,
                              token_count=global_tokens)

Pure functions on tensors; no model, no communication. `token_count` is the number of response
tokens in the *global* batch (all data-parallel ranks), so that summing gradients across ranks
gives the exact token-mean loss of the whole batch, however unevenly samples are spread.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def group_advantages(rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(r - mean_group) / (std_group + eps), std the population std; zero-variance groups give 0."""
    rewards = np.asarray(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    for gid in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == gid)
        r = rewards[idx]
        std = r.std()
        # a zero-variance group carries no signal: its advantages are exactly 0, not 0/eps noise
        adv[idx] = 0.0 if std == 0 else (r - r.mean()) / (std + eps)
    return adv.astype(np.float32)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


@dataclass
class LossStats:
    """Sums over this rank's tokens (divide by the global token count to report means)."""

    pg_loss: float
    kl: float
    entropy: float
    clip_frac: float
    tokens: float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    token_count: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy-gradient loss, token-mean over `token_count` tokens.

    All tensors are [B, T]; `advantages` is already broadcast per token; `mask` is 1 on response
    tokens. Returns this rank's share of the loss (sum over its tokens / token_count).
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    kl_tok = k3_kl(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)
    if kl_coef:
        per_token = per_token + kl_coef * kl_tok
    ent_tok = entropy if entropy is not None else torch.zeros_like(logp)
    if entropy_coef:
        per_token = per_token - entropy_coef * ent_tok
    loss = (per_token * mask).sum() / token_count
    with torch.no_grad():
        clip_hit = ((clipped > unclipped).to(mask.dtype) * mask).sum()
        stats = LossStats(
            pg_loss=float((torch.maximum(unclipped, clipped) * mask).sum()),
            kl=float((kl_tok * mask).sum()),
            entropy=float((ent_tok * mask).sum()),
            clip_frac=float(clip_hit),
            tokens=float(mask.sum()),
        )
    return loss, stats
