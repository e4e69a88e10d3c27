"""Importance weights for the engine/trainer gap: pi_proximal / pi_behavior per token, truncated or masked.

    weights, stats = importance_weights(proximal, behavior, "token_truncate", cap=2.0)
    advantages = [a * w for a, w in zip(advantages, weights)]      # the policy-gradient term, weighted

`proximal` and `behavior` are one array per sample of the log-probabilities of its response tokens: the
trainer's under the weights before the update (decoupled PPO's proximal policy, AReaL) and the engine's that
sampled them. log w_t = proximal_t - behavior_t; a sequence's w = exp(sum_t log w_t) (the product of its
tokens' ratios). The modes are TRL's `vllm_importance_sampling_mode`:

    token_truncate      w_t <- min(w_t, cap)                               TIS (verl/slime/YATT cap 2)
    sequence_truncate   every token <- min(w_seq, cap)
    token_mask          w_t, or 0 where w_t is outside [low, high]          IcePop
    sequence_mask       every token <- w_seq, or 0 if w_seq is outside [low, high]

Scaling a token's advantage by w > 0 scales its clipped-ratio loss by w exactly (min(rho wA, clip(rho) wA) =
w min(rho A, clip(rho) A), the dual clip and CISPO likewise), so the weight is applied to the advantages and the
losses stay as they are; the KL and entropy terms are not weighted. A masked token keeps its place in the
aggregation's counts (a zero weight, as TRL's masking does), so masking never changes the loss's denominators.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("none", "token_truncate", "sequence_truncate", "token_mask", "sequence_mask")


@dataclass
class WeightStats:
    """Sums over the samples given, for the step's metrics (the raw weights, before truncation or masking)."""

    tokens: float = 0.0
    weight_sum: float = 0.0       # of the raw per-token w
    weight_max: float = 0.0       # of the raw per-token w (the sequence's w in the sequence modes)
    truncated: float = 0.0        # tokens whose weight was capped
    masked: float = 0.0           # tokens whose weight was set to 0
    abs_log_ratio_max: float = 0.0  # max |proximal - behavior|: the engine/trainer gap before the update

    def as_array(self) -> np.ndarray:
        return np.array([self.tokens, self.weight_sum, self.weight_max, self.truncated, self.masked,
                         self.abs_log_ratio_max], np.float64)


def importance_weights(proximal: list[np.ndarray], behavior: list[np.ndarray], mode: str, cap: float = 2.0,
                       low: float = 0.5, high: float = 2.0) -> tuple[list[np.ndarray], WeightStats]:
    """One float32 array of weights per sample, and their statistics."""
    if mode not in MODES:
        raise ValueError(f"importance-weight mode {mode!r} is not one of {', '.join(MODES)}")
    stats, out = WeightStats(), []
    for prox, behav in zip(proximal, behavior, strict=True):
        log_w = np.asarray(prox, np.float64) - np.asarray(behav, np.float64)
        raw = np.exp(log_w)
        n = len(log_w)
        stats.tokens += n
        stats.weight_sum += float(raw.sum())
        stats.abs_log_ratio_max = max(stats.abs_log_ratio_max, float(np.abs(log_w).max(initial=0.0)))
        if mode.startswith("sequence"):
            seq = float(np.exp(log_w.sum()))
            stats.weight_max = max(stats.weight_max, seq)
            if mode == "sequence_truncate":
                w = np.full(n, min(seq, cap))
                stats.truncated += n if seq > cap else 0
            else:
                inside = low <= seq <= high
                w = np.full(n, seq if inside else 0.0)
                stats.masked += 0 if inside else n
        else:
            stats.weight_max = max(stats.weight_max, float(raw.max(initial=0.0)))
            if mode == "token_truncate":
                w = np.minimum(raw, cap)
                stats.truncated += float((raw > cap).sum())
            elif mode == "token_mask":
                inside = (raw >= low) & (raw <= high)
                w = np.where(inside, raw, 0.0)
                stats.masked += float((~inside).sum())
            else:
                w = np.ones(n)
        out.append(w.astype(np.float32))
    return out, stats
