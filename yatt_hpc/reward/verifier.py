"""The rule verifiers: exact-match scoring against the reference answer, and a response format check.

    from yatt_hpc.reward.verifier import format_score, rule_score
    rule_score("edcba", "edcba")    # 1.0
    rule_score(" edcba\n", "edcba") # 1.0  (surrounding whitespace is not the model's answer)
    rule_score("edcab", "edcba")    # 0.0
    format_score("<think>..</think> 42", r"^<think>.*</think>")   # 1.0

Binary on purpose: the demo judge is trained and measured against exactly this verdict, and a
partial-credit score would let a policy farm reward with almost-right answers.
"""
from __future__ import annotations

import re


def rule_score(response: str, answer: str) -> float:
    """1.0 when `response` equals `answer` after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


def format_score(response: str, pattern: str | re.Pattern) -> float:
    """1.0 when the regex `pattern` is found in `response` (`re.search`; `.` also matches newlines, so
    `^...$` spans the whole response), else 0.0."""
    compiled = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.DOTALL)
    return 1.0 if compiled.search(response) else 0.0
