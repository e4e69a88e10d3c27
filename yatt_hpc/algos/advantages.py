"""Advantage estimators: one advantage per response token, from scalar rewards and prompt groups.

    adv = estimate("grpo", rewards, group_ids, response_lens, eps=1e-6, norm_by_std=True, std="sample")
    adv.values          # list of float32 arrays, one per sample, one value per response token
    adv.no_signal       # samples of groups that carry no relative signal (their advantages are exactly 0)

`token_penalties` (a per-token array per sample, e.g. beta x KL when the KL is in the reward) is
subtracted from the reward: per token for reinforce_plus_plus, summed over the sequence for the
others (verl's `token_level_rewards.sum(-1)`).

A group that carries no relative signal gets advantages of exactly 0 under every group estimator
(grpo, Dr.GRPO, rloo, reinforce_plus_plus_baseline): a group of one sample (nothing to compare it
with), and a group whose rewards are all equal (compared exactly, not as a float std below a
threshold: verl's float32 mean of seven 0.7s leaves |A| up to 0.056). reinforce_plus_plus compares
with the whole batch, not the group, so groups do not matter to it.

Batch whitening (the reinforce_plus_plus pair) runs over every response token of the GLOBAL batch:
`reduce(x)` sums a float64 vector across the trainer's data-parallel ranks (identity in one
process), two passes (mean, then the squared deviations). Samples of no-signal groups are left out
of the moments and stay 0 (verl shifts them to -mean/std, a push on responses that carried no signal).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
WHITEN_EPS = 1e-8  # inside the square root, as verl's masked_whiten


def _identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclass
class Advantages:
    values: list[np.ndarray]
    """One float32 array per sample, one advantage per response token."""
    no_signal: int
    """Samples of groups without relative signal (a single sample, or equal rewards): advantage 0."""

    def per_sample(self) -> np.ndarray:
        """The first token's advantage of each sample (what a sequence-level estimator gives every token)."""
        return np.array([v[0] if v.size else 0.0 for v in self.values], np.float32)


def signal_mask(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """True for samples whose group has at least two samples and two different rewards."""
    rewards, group_ids = np.asarray(rewards, np.float64), np.asarray(group_ids)
    out = np.zeros(len(rewards), bool)
    for gid in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == gid)
        out[idx] = len(idx) > 1 and bool(np.any(rewards[idx] != rewards[idx[0]]))
    return out


def grpo(rewards: np.ndarray, group_ids: np.ndarray, *, eps: float = 1e-6, norm_by_std: bool = True,
         std: str = "sample") -> np.ndarray:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean_g) / (std_g + eps), std the sample std
    (ddof 1, `std="sample"`: verl `adv_estimator=grpo`, TRL `scale_rewards="group"`, slime, NeMo-RL) or the
    population std (`std="population"`, ddof 0: larger by sqrt(G/(G-1))). `norm_by_std=False` is Dr.GRPO
    (Liu et al. 2025): A_i = r_i - mean_g (verl `norm_adv_by_std_in_grpo=False`, TRL `scale_rewards="none"`).
    Per sample; computed in float64."""
    rewards = np.asarray(rewards, np.float64)
    adv = np.zeros_like(rewards)
    signal = signal_mask(rewards, group_ids)
    for gid in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == gid)
        if not signal[idx[0]]:
            continue
        r = rewards[idx]
        centered = r - r.mean()
        adv[idx] = centered / (r.std(ddof=1 if std == "sample" else 0) + eps) if norm_by_std else centered
    return adv.astype(np.float32)


def _centered(rewards: np.ndarray, group_ids: np.ndarray, signal: np.ndarray) -> np.ndarray:
    """r_i - mean_g in float64, 0 for samples without signal."""
    out = np.zeros(len(rewards), np.float64)
    for gid in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == gid)
        if signal[idx[0]]:
            out[idx] = rewards[idx] - rewards[idx].mean()
    return out


def rloo(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the group's other G-1 rewards = G/(G-1) (r_i - mean_g)
    (verl `adv_estimator=rloo`, NeMo-RL `use_leave_one_out_baseline`, OpenRLHF `rloo`, TRL RLOOTrainer)."""
    rewards = np.asarray(rewards, np.float64)
    adv = np.zeros_like(rewards)
    signal = signal_mask(rewards, group_ids)
    for gid in np.unique(group_ids):
        idx = np.flatnonzero(group_ids == gid)
        if signal[idx[0]]:
            r = rewards[idx]
            adv[idx] = r - (r.sum() - r) / (len(r) - 1)
    return adv.astype(np.float32)


def discounted_returns(token_rewards: np.ndarray, gamma: float) -> np.ndarray:
    """G_t = sum_k gamma^k r_{t+k} over one response's tokens (float64)."""
    out = np.zeros(len(token_rewards), np.float64)
    running = 0.0
    for t in range(len(token_rewards) - 1, -1, -1):
        running = float(token_rewards[t]) + gamma * running
        out[t] = running
    return out


def whiten(values: Sequence[np.ndarray], include: np.ndarray,
           reduce: Callable[[np.ndarray], np.ndarray] = _identity) -> list[np.ndarray]:
    """(x - mean) / sqrt(var + 1e-8) over every token of the included samples of the global batch, var
    with Bessel's correction (verl `masked_whiten`); excluded samples and an all-equal batch give 0."""
    kept = [np.asarray(v, np.float64) for v, keep in zip(values, include) if keep]
    flat = np.concatenate(kept) if kept else np.zeros(0)
    count, total = reduce(np.array([flat.size, flat.sum()], np.float64))
    mean = total / count if count else 0.0
    squares, spread = reduce(np.array([((flat - mean) ** 2).sum(), float(np.any(flat != mean))], np.float64))
    scale = 0.0 if count < 2 or spread == 0 else 1.0 / np.sqrt(squares / (count - 1) + WHITEN_EPS)
    return [((np.asarray(v, np.float64) - mean) * scale).astype(np.float32) if keep
            else np.zeros(len(v), np.float32) for v, keep in zip(values, include)]


def estimate(name: str, rewards: np.ndarray, group_ids: np.ndarray, response_lens: np.ndarray, *,
             token_penalties: Sequence[np.ndarray] | None = None, eps: float = 1e-6, norm_by_std: bool = True,
             std: str = "sample", gamma: float = 1.0,
             reduce: Callable[[np.ndarray], np.ndarray] = _identity) -> Advantages:
    """The advantages of `name` (an entry of ESTIMATORS but gae, which takes the critic's values: `algos/gae.py`).

    reinforce_plus_plus (Hu 2025, REINFORCE++): per-token returns of the reward on the last token (less the
    token penalties), discounted by `gamma`, whitened over the global batch (verl `reinforce_plus_plus`,
    OpenRLHF `reinforce`). reinforce_plus_plus_baseline: r_i - mean_g on every token, whitened over the
    global batch (verl `reinforce_plus_plus_baseline`, OpenRLHF `reinforce_baseline`)."""
    rewards = np.asarray(rewards, np.float64)
    lens = np.asarray(response_lens, np.int64)
    penalties = [np.zeros(n) for n in lens] if token_penalties is None else \
        [np.asarray(p, np.float64) for p in token_penalties]
    if name == "gae":
        raise ValueError("adv_estimator=gae needs the critic's values: it is algos/gae.estimate_gae, not this function")
    if name == "reinforce_plus_plus":
        returns = []
        for r, n, pen in zip(rewards, lens, penalties):
            token_rewards = -pen.copy()
            if n:
                token_rewards[-1] += r
            returns.append(discounted_returns(token_rewards, gamma))
        return Advantages(whiten(returns, np.ones(len(returns), bool), reduce), 0)
    rewards = rewards - np.array([p.sum() for p in penalties]) if token_penalties is not None else rewards
    signal = signal_mask(rewards, group_ids)
    if name == "grpo":
        per_sample = grpo(rewards, group_ids, eps=eps, norm_by_std=norm_by_std, std=std)
    elif name == "rloo":
        per_sample = rloo(rewards, group_ids)
    elif name == "reinforce_plus_plus_baseline":
        centered = _centered(rewards, group_ids, signal)
        tokens = whiten([np.full(n, c) for c, n in zip(centered, lens)], signal, reduce)
        return Advantages(tokens, int((~signal).sum()))
    else:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {', '.join(ESTIMATORS)}")
    return Advantages([np.full(n, a, np.float32) for a, n in zip(per_sample, lens)], int((~signal).sum()))
