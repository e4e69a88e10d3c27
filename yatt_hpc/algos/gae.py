"""PPO's critic formulas: generalized advantage estimation, the clipped value loss, explained variance.

    gae = estimate_gae(rewards, values, gamma=1.0, lam=0.95, token_penalties=None, whiten_advantages=True)
    gae.advantages, gae.returns      # one float32 array per sample, one entry per response token
    loss, clipped = value_loss(v_new, v_old, returns, clip=0.5)      # per token, before aggregation
    ev = explained_variance(sums)    # from `value_sums` over the global batch

Token level: a response of n tokens is n actions; the state of token t is the prompt and the tokens before it,
V_t the critic's value there (the position whose logit samples token t, as the log-probabilities are aligned).
The scalar reward sits on the last token, less the per-token penalties (beta x KL when the KL is in the reward).
Each sample is its own ragged array, so there is no padding to leak into a recursion or a mean (verl's padded
GAE leaves values on padded positions, docs/recipes.md). Pure numpy and torch: no model, no process group;
whitening over the global batch takes `reduce` (a sum over the data-parallel ranks) like `advantages.whiten`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from yatt_hpc.algos.advantages import whiten


def _identity(x: np.ndarray) -> np.ndarray:
    return x


@dataclass
class GAE:
    advantages: list[np.ndarray]
    """One float32 array per sample (whitened over the global batch when asked)."""
    returns: list[np.ndarray]
    """The value targets A_t + V_t (before any whitening of A), float32."""


def gae_one(token_rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float,
            sampled: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """GAE (Schulman et al. 2016, arXiv 1506.02438) over one response, in float64:
    delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0: the episode ends there),
    A_t = delta_t + gamma lam A_{t+1}, returns R_t = A_t + V_t. verl `compute_gae_advantage_return` and TRL's
    PPOTrainer compute the same recursion on padded rows.

    `sampled` (multi-turn: 0 on the tool results' tokens the model did not sample) skips those tokens: the
    recursion runs over the model's tokens only, as if the observations were not there, so V_{t+1} is the value
    at the next token the model sampled (verl's multi-turn GAE carries `nextvalues` and `lastgaelam` over
    observation tokens the same way). A skipped token gets A = 0 and R = V: no advantage, no value error."""
    r, v = np.asarray(token_rewards, np.float64), np.asarray(values, np.float64)
    adv, ret = np.zeros(len(r), np.float64), v.copy()
    running, next_value = 0.0, 0.0
    for t in range(len(r) - 1, -1, -1):
        if sampled is not None and not sampled[t]:
            continue
        delta = r[t] + gamma * next_value - v[t]
        running = delta + gamma * lam * running
        adv[t], ret[t], next_value = running, running + v[t], v[t]
    return adv, ret


def turn_spans(sampled: np.ndarray) -> list[tuple[int, int]]:
    """The model turns of one response: [start, end) of each run of tokens the model sampled."""
    m = np.concatenate([[0], (np.asarray(sampled) > 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def value_positions(sampled: np.ndarray, level: str) -> np.ndarray:
    """Where the value loss and the critic's metrics look: the tokens the model sampled (`token`), or the first
    token of each model turn (`turn`)."""
    mask = np.asarray(sampled) > 0
    if level == "token":
        return mask
    out = np.zeros(len(mask), bool)
    out[[start for start, _ in turn_spans(mask)]] = True
    return out


def gae_turns(token_rewards: np.ndarray, values: np.ndarray, sampled: np.ndarray, gamma: float,
              lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Turn-level GAE over one response (`train.critic.level: turn`): turn k's reward is the sum of its tokens'
    rewards, its value V at its first token; `gae_one` runs over the turns, every token of turn k takes A_k, and
    R_k = A_k + V_k sits at the turn's first token (R = V elsewhere: no value error there)."""
    v = np.asarray(values, np.float64)
    spans = turn_spans(sampled)
    r = np.array([np.sum(token_rewards[a:b]) for a, b in spans], np.float64)
    starts = np.array([a for a, _ in spans], np.int64)
    turn_adv, turn_ret = gae_one(r, v[starts], gamma, lam)
    adv, ret = np.zeros(len(v), np.float64), v.copy()
    for (a, b), a_k, r_k in zip(spans, turn_adv, turn_ret):
        adv[a:b], ret[a] = a_k, r_k
    return adv, ret


def estimate_gae(rewards: np.ndarray, values: Sequence[np.ndarray], *, gamma: float, lam: float,
                 token_penalties: Sequence[np.ndarray] | None = None, whiten_advantages: bool = True,
                 reduce: Callable[[np.ndarray], np.ndarray] = _identity,
                 sampled: Sequence[np.ndarray] | None = None, level: str = "token") -> GAE:
    """Token-level GAE of every sample: the reward on its last token less `token_penalties` per token, `values`
    the critic's V_t per response token. `whiten_advantages` whitens A over every response token of the global
    batch (verl and TRL's PPOTrainer always whiten GAE's advantages, `masked_whiten`); returns are not.

    `sampled` (an agent's `response_mask`): the recursion skips the tokens the model did not sample (`gae_one`),
    the reward sits on the last token the model sampled (a trajectory cut after a tool result still rewards the
    model's last turn; verl puts it on the last token, where an observation token would drop it), and the
    whitening counts the model's tokens only."""
    advantages, returns = [], []
    for i, (reward, v) in enumerate(zip(np.asarray(rewards, np.float64), values)):
        token_rewards = np.zeros(len(v), np.float64)
        if token_penalties is not None:
            token_rewards -= np.asarray(token_penalties[i], np.float64)
        mask = None if sampled is None else np.asarray(sampled[i]) > 0
        model_tokens = np.arange(len(v)) if mask is None else np.flatnonzero(mask)
        if len(model_tokens):
            token_rewards[model_tokens[-1]] += reward
        if level == "turn":
            adv, ret = gae_turns(token_rewards, v, np.ones(len(v), bool) if mask is None else mask, gamma, lam)
        else:
            adv, ret = gae_one(token_rewards, v, gamma, lam, mask)
        advantages.append(adv)
        returns.append(ret.astype(np.float32))
    if not whiten_advantages:
        return GAE([a.astype(np.float32) for a in advantages], returns)
    if sampled is None:
        return GAE(whiten(advantages, np.ones(len(advantages), bool), reduce), returns)
    masks = [np.asarray(m) > 0 for m in sampled]
    model_only = whiten([a[m] for a, m in zip(advantages, masks)], np.ones(len(advantages), bool), reduce)
    whitened = [np.zeros(len(a), np.float32) for a in advantages]
    for out, w, m in zip(whitened, model_only, masks):
        out[m] = w
    return GAE(whitened, returns)


def value_loss(v_new: torch.Tensor, v_old: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token, 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), and where the
    clipped term was the larger (the value-clip fraction). verl `compute_value_loss` (`cliprange_value`), TRL
    PPOTrainer (`cliprange_value`, its 0.5 x masked mean), OpenRLHF `ValueLoss` (`value_clip`). `clip=None`: the
    plain 0.5 (V - R)^2."""
    plain = (v_new - returns) ** 2
    if clip is None:
        return 0.5 * plain, torch.zeros_like(plain, dtype=torch.bool)
    clipped = (v_old + (v_new - v_old).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), clipped > plain


VALUE_SUMS = ("tokens", "value", "ret", "ret_sq", "err", "err_sq")


def value_sums(values: Sequence[np.ndarray], returns: Sequence[np.ndarray],
               positions: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """This replica's sums over its response tokens (`VALUE_SUMS`): count, sum V, sum R, sum R^2, sum (R - V),
    sum (R - V)^2; summed over the replicas they give the global batch's `explained_variance` and value mean.
    With `positions` (`value_positions`: the tokens the value loss covers) over those only."""
    if positions is not None:
        masks = [np.asarray(m) > 0 for m in positions]
        values = [np.asarray(x)[m] for x, m in zip(values, masks)]
        returns = [np.asarray(x)[m] for x, m in zip(returns, masks)]
    v = np.concatenate([np.asarray(x, np.float64) for x in values]) if len(values) else np.zeros(0)
    r = np.concatenate([np.asarray(x, np.float64) for x in returns]) if len(returns) else np.zeros(0)
    e = r - v
    return np.array([v.size, v.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()], np.float64)


def explained_variance(sums: np.ndarray) -> float:
    """1 - Var(R - V) / Var(R) over the tokens the `value_sums` cover (population variances; TRL's and verl's
    `explained_variance` metric). 1 is a perfect critic, 0 one no better than the mean return; an all-equal R
    has no variance to explain (0 returned)."""
    n, _, ret, ret_sq, err, err_sq = (float(x) for x in sums)
    if n < 1:
        return 0.0
    var_ret = ret_sq / n - (ret / n) ** 2
    var_err = err_sq / n - (err / n) ** 2
    return 0.0 if var_ret <= 1e-12 else 1.0 - var_err / var_ret
