"""Reading a judge's verdict text as a score: in [0, 1], or None when it is not a verdict.

    parse_verdict("yes")  -> 1.0     parse_verdict("0.7") -> 0.7     parse_verdict("maybe") -> None

None is kept apart from 0 so that parse failures are counted and priced (`reward.parse_fail_score`).
"""
from __future__ import annotations

import re

_YES_WORDS = {"yes", "correct", "right", "true"}
_NO_WORDS = {"no", "wrong", "incorrect", "false"}
_FIRST_WORD = re.compile(r"\s*([a-z]+|\d+(?:\.\d+)?)")



def parse_verdict(text: str) -> float | None:
    """Score of a verdict from its first word: yes/correct -> 1.0, no/wrong -> 0.0, a number in
    [0, 1] -> that number; anything else (empty text, other words, numbers out of range) -> None."""
    match = _FIRST_WORD.match(text.lower())
    if match is None:
        return None
    word = match.group(1)
    if word in _YES_WORDS:
        return 1.0
    if word in _NO_WORDS:
        return 0.0
    if word[0].isdigit():
        value = float(word)
        return value if 0.0 <= value <= 1.0 else None
    return None
