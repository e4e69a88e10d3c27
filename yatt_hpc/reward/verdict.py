"""Reading a judge's verdict text as a score: in [0, 1], or None when it holds no verdict.

    parse_verdict("yes") -> 1.0      parse_verdict("... so it is not correct.") -> 0.0      parse_verdict("maybe") -> None
    parse_boxed_score(r"... \\boxed{7}", scale=(0, 10)) -> 0.7      parse_last_number("Score: 3", (1, 5)) -> 0.5
    parser = build_verdict_parser("regex", pattern=r"VERDICT: (\\w+)")     # parser(text) -> float | None

Every parser reads the *final* verdict, so a judge may reason for hundreds of tokens first: the last
verdict word, the last `\\boxed{}`, the last number, the last match. None is kept apart from 0 so that
parse failures are counted and priced (`reward.parse_fail_score`).
"""
from __future__ import annotations

import re
from collections.abc import Callable

VERDICT_PARSERS = ("yes_no", "boxed_score", "last_number", "regex")

_YES_WORDS = {"yes", "correct", "right", "true"}
_NO_WORDS = {"no", "wrong", "incorrect", "false"}
_NEGATIONS = {"not", "isn't", "wasn't", "never"}
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")
_ONLY_NUMBER = re.compile(r"\s*(\d+(?:\.\d+)?)\s*\.?\s*")
# a number, or a fraction of two ("7/10": seven out of ten, whatever the scale)
_NUMBER = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?(?![\w])")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")


def parse_verdict(text: str) -> float | None:
    """`yes_no`: the last verdict word decides: yes/correct/right/true -> 1.0, no/wrong/incorrect/false ->
    0.0, flipped by a `not` just before it ("is not correct" -> 0.0). A verdict that is only a number in
    [0, 1] is that number. Anything else (empty text, no verdict word, numbers out of range) -> None."""
    words = _WORD.findall(text.lower())
    for k in range(len(words) - 1, -1, -1):
        word = words[k]
        if word in _YES_WORDS or word in _NO_WORDS:
            yes = word in _YES_WORDS
            return float(yes != (k > 0 and words[k - 1] in _NEGATIONS))
    only = _ONLY_NUMBER.fullmatch(text)
    if only is not None:
        value = float(only.group(1))
        return value if 0.0 <= value <= 1.0 else None
    return None


def _scaled(text: str, scale: tuple[float, float]) -> float | None:
    """A yes/no word, `N` on `scale` (lo -> 0, hi -> 1) or a fraction `N/M`, as a score; None if out of range."""
    text = text.strip()
    if text.lower() in _YES_WORDS | _NO_WORDS:
        return 1.0 if text.lower() in _YES_WORDS else 0.0
    match = _NUMBER.fullmatch(text.rstrip("."))
    if match is None:
        return None
    value, over = float(match.group(1)), match.group(2)
    if over is not None:
        score = value / float(over) if float(over) > 0 else -1.0
    else:
        lo, hi = scale
        score = (value - lo) / (hi - lo)
    return score if 0.0 <= score <= 1.0 else None


def parse_boxed_score(text: str, scale: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """`boxed_score`: the last `\\boxed{N}`, N on `scale` (`\\boxed{7}` on (0, 10) -> 0.7); `\\boxed{yes}`/
    `\\boxed{no}` -> 1/0. None without a box, or with a number outside the scale."""
    boxes = _BOXED.findall(text)
    return _scaled(boxes[-1], scale) if boxes else None


def parse_last_number(text: str, scale: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """`last_number`: the last number of the text on `scale` (`N/M` reads as N out of M). None without one,
    or when it lies outside the scale."""
    numbers = list(_NUMBER.finditer(text))
    return _scaled(numbers[-1].group(0), scale) if numbers else None


def parse_regex(text: str, pattern: str | re.Pattern, scale: tuple[float, float] = (0.0, 10.0)) -> float | None:
    """`regex`: the last match of `pattern`; its one group holds a yes/no word or a number on `scale`."""
    compiled = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.IGNORECASE)
    matches = list(compiled.finditer(text))
    return _scaled(matches[-1].group(1) or "", scale) if matches else None


def check_pattern(pattern: str) -> re.Pattern:
    """The compiled verdict regex; ValueError unless it compiles with exactly one group."""
    compiled = re.compile(pattern, re.IGNORECASE)  # re.error is a ValueError
    if compiled.groups != 1:
        raise ValueError(f"the verdict pattern {pattern!r} has {compiled.groups} groups; it needs exactly one, "
                         "holding the verdict (yes/no or a number), e.g. 'Verdict: (yes|no)'")
    return compiled


def build_verdict_parser(kind: str = "yes_no", *, scale: tuple[float, float] = (0.0, 10.0),
                         pattern: str | None = None) -> Callable[[str], float | None]:
    """The parser `reward.judge_parser` names, with its scale (and pattern, for `regex`)."""
    if kind == "yes_no":
        return parse_verdict
    if kind == "boxed_score":
        return lambda text: parse_boxed_score(text, scale)
    if kind == "last_number":
        return lambda text: parse_last_number(text, scale)
    if kind == "regex":
        if pattern is None:
            raise ValueError("the regex verdict parser needs a pattern with one group")
        compiled = check_pattern(pattern)
        return lambda text: parse_regex(text, compiled, scale)
    raise ValueError(f"unknown verdict parser {kind!r}; valid parsers: {', '.join(VERDICT_PARSERS)}")
