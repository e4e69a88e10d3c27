"""Mixing reward terms into one reward: the weighted sum, and the `reward.mode` shorthand of it.

    weighted_sum({"acc": np.array([1., 0.]), "fmt": np.array([1., 1.])}, {"acc": 1.0, "fmt": 0.1})  # -> [1.1, 0.1]
    combine_reward(0.8, 1.0, "rm_with_rule", alpha=0.5, beta=0.5, parse_fail_score=0.0)         # -> 0.9
    judge_agrees(0.8, 1.0)                                                                        # -> True
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

REWARD_MODES = ("rm_only", "rule_only", "rm_with_rule")


def judge_agrees(genrm_score: float | None, rule_score: float) -> bool:
    """Whether a verdict matches the rule verifier: score >= 0.5 exactly when the rule says correct.
    An unparseable verdict never agrees."""
    return genrm_score is not None and (genrm_score >= 0.5) == (rule_score >= 0.5)


def weighted_sum(values: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """The reward of each sample: sum over terms of weight x score (float32; no clipping, a weight may be
    negative)."""
    if not weights:
        raise ValueError("a reward needs at least one term")
    total = sum(float(weights[name]) * np.asarray(values[name], np.float64) for name in weights)
    return np.asarray(total, np.float32)


def combine_reward(genrm_score: float | None, rule_score: float | None, mode: str,
                   alpha: float, beta: float, parse_fail_score: float) -> float:
    """The reward of one response under the shorthand `reward.mode`, the same sum `reward.terms` makes:
    `rm_only` -> genrm; `rule_only` -> rule; `rm_with_rule` -> alpha*genrm + beta*rule. The weights
    only mix the two signals, so single-signal modes are unweighted. An unparseable verdict
    (`genrm_score is None`) counts as `parse_fail_score`.
    """
    if mode not in REWARD_MODES:
        raise ValueError(f"unknown reward mode {mode!r}; valid modes: {', '.join(REWARD_MODES)}")
    genrm = parse_fail_score if genrm_score is None else genrm_score
    if mode != "rm_only" and rule_score is None:
        raise ValueError(f"reward mode {mode!r} needs a rule score, but the row has no reference answer; "
                         f"use reward.mode=rm_only for prompts without answers")
    if mode == "rm_only":
        return float(genrm)
    if mode == "rule_only":
        return float(rule_score)
    return float(alpha * genrm + beta * rule_score)
