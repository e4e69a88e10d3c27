"""Reward functions for the tests of `reward.terms` kind `function` (imported as tests.programs.reward_fns).

    {name: short, kind: function, function: "tests.programs.reward_fns:shortness"}
"""
from __future__ import annotations

CALLS: list[int] = []  # rows per call, so a test can tell batched from per-row calls


def shortness(prompt: str, response: str, answer: str, metadata: dict) -> float:
    """1 / (1 + response length in policy tokens): a length bonus."""
    CALLS.append(1)
    return 1.0 / (1.0 + metadata["response_tokens"])


def answer_in_response(prompts: list[str], responses: list[str], answers: list[str], metadata: list[dict]) -> list[float]:
    """Batched: 1.0 where the reference answer appears in the response."""
    CALLS.append(len(prompts))
    return [1.0 if a and a in r else 0.0 for r, a in zip(responses, answers)]


def fails_on_long_prompts(prompt: str, response: str, answer: str, metadata: dict) -> float:
    if len(prompt) > 12:
        return _divide(len(prompt), 0)
    return 0.5


def _divide(a: int, b: int) -> float:
    return a / b


def returns_text(prompt: str, response: str, answer: str, metadata: dict) -> float:
    return "high"  # type: ignore[return-value]


def returns_too_few(prompts, responses, answers, metadata):
    return [0.0] * (len(prompts) - 1)


def returns_nan(prompts, responses, answers, metadata):
    return [float("nan")] * len(prompts)


NOT_A_FUNCTION = 3
