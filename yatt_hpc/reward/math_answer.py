r"""The `math` reward term: the response's final answer is equivalent to the reference, by math-verify.

    from yatt_hpc.reward.math_answer import math_score
    math_score(r"so the answer is \boxed{\frac{1}{2}}", "0.5")   # 1.0
    math_score("1 + 1 = 2, then 2 + 1 = 3", "3")                  # 1.0  (no \boxed{}: the last number)
    math_score(r"\boxed{4}", "5")                                 # 0.0

The final answer is extracted and compared by Hugging Face's `math-verify` (LaTeX, `\boxed{}`, plain
numbers and expressions; `1/2`, `0.5` and `\frac{1}{2}` are one answer), not by a parser of ours. The
reference is read as a boxed answer unless it holds LaTeX of its own; a reference math-verify cannot
read at all is compared as text with the extracted answer, so it never scores every response 0 silently.
"""
from __future__ import annotations

import threading

# math-verify bounds a parse or comparison with SIGALRM, which only the main thread may use; a call from
# another thread runs without the bound (the GenRM rank scores on its main thread)
_TIMEOUT_S = 5


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_reference(answer: str) -> list:
    from math_verify import parse  # imported here: math-verify pulls in sympy (~1 s)

    text = answer.strip()
    if not text:
        return []
    if "\\boxed" in text or "$" in text:
        return parse(text, parsing_timeout=_timeout())
    return parse(f"\\boxed{{{text}}}", parsing_timeout=_timeout()) or parse(text, parsing_timeout=_timeout())


def math_score(response: str, answer: str) -> float:
    """1.0 when the final answer of `response` (its last `\\boxed{}`, else its last number or expression)
    is mathematically equal to `answer`, else 0.0."""
    from math_verify import parse, verify

    predicted = parse(response, parsing_timeout=_timeout())
    if not predicted:
        return 0.0
    reference = _parse_reference(answer)
    if not reference:  # nothing math-verify can read: the extracted answer's text against the reference's
        return 1.0 if answer.strip() and str(predicted[-1]).strip() == answer.strip() else 0.0
    return 1.0 if verify(reference, predicted, timeout_seconds=_timeout()) else 0.0
