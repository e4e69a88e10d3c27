"""The rule verifier: exact-match scoring of a response against the reference answer.

    from yatt_hpc.reward.verifier import rule_score
    rule_score("edcba", "edcba")    # 1.0
    rule_score(" edcba\n", "edcba") # 1.0  (surrounding whitespace is not the model's answer)
    rule_score("edcab", "edcba")    # 0.0

Binary on purpose: the demo judge is trained and measured against exactly this verdict, and a
partial-credit score would let a policy farm reward with almost-right answers.
"""
from __future__ import annotations


def rule_score(response: str, answer: str) -> float:
    """1.0 when `response` equals `answer` after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0
