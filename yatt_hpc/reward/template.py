"""The judge prompt: the text a GenRM continues with its verdict, and the verdict it is trained to give.

    build_judge_prompt("reverse abcdab=", "badcba")    # -> "reverse abcdab=badcba\nCorrect? "
    verdict_text(True)                                  # -> "yes"
"""
from __future__ import annotations

# The judge reads the transcript exactly as the policy wrote it (prompt then response), so a judge
# can start from the policy's own weights; the question then asks for the verdict.
JUDGE_TEMPLATE = "{question}{response}\nCorrect? "
VERDICT_YES = "yes"
VERDICT_NO = "no"

def build_judge_prompt(question: str, response: str) -> str:
    """The text the judge continues with its verdict."""
    # Newlines become spaces so that a response cannot forge the template's own verdict line.
    return JUDGE_TEMPLATE.format(question=question, response=response.strip().replace("\n", " "))


def verdict_text(is_correct: bool) -> str:
    """What the judge is trained to answer (kept within the default 4 verdict tokens)."""
    return VERDICT_YES if is_correct else VERDICT_NO
