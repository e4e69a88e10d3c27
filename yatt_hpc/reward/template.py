"""The judge prompt: the text a GenRM continues with its verdict, and the verdict it is trained to give.

    build_judge_prompt("reverse abcdab=", "badcba")    # -> "reverse abcdab=badcba\nCorrect? "  (the demo's)
    verdict_text(True)                                  # -> "yes"
    prompt = JudgePrompt(tokenizer, "Q: {question}\nA: {response}\nReference: {reference}\nVerdict?", chat="auto")
    prompt.ids("2+2?", "4", "4")                        # through the judge's chat template if it has one

A configured template (`reward.judge_template`: the text, or a file holding it) has the placeholders
`{question}`, `{response}` and `{reference}`; every other brace stays as written (`\\boxed{}` needs no
escaping). Without one the judge reads the demo's `build_judge_prompt`. With `chat` the rendered text is
the user turn of the judge tokenizer's chat template (with its generation prompt); else it is encoded as
plain text with the BOS the tokenizer adds.
"""
from __future__ import annotations

import re
from pathlib import Path

from yatt_hpc.reward.errors import RewardError

# The judge reads the transcript exactly as the policy wrote it (prompt then response), so a judge
# can start from the policy's own weights; the question then asks for the verdict.
JUDGE_TEMPLATE = "{question}{response}\nCorrect? "
VERDICT_YES = "yes"
VERDICT_NO = "no"
PLACEHOLDERS = ("question", "response", "reference")
_PLACEHOLDER = re.compile(r"\{(question|response|reference)\}")


def build_judge_prompt(question: str, response: str) -> str:
    """The text the demo judge continues with its verdict."""
    # Newlines become spaces so that a response cannot forge the template's own verdict line.
    return JUDGE_TEMPLATE.format(question=question, response=response.strip().replace("\n", " "))


def verdict_text(is_correct: bool) -> str:
    """What the judge is trained to answer (kept within the default 4 verdict tokens)."""
    return VERDICT_YES if is_correct else VERDICT_NO


def fill_template(template: str, question: str, response: str, reference: str) -> str:
    """`template` with its placeholders filled in one pass (a `{response}` inside the question stays text)."""
    values = {"question": question, "response": response, "reference": reference}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def load_judge_template(value: str | None) -> str | None:
    """The template `reward.judge_template` gives: text holding `{response}` is the template itself, any
    other value the path of a file holding it; None keeps the demo prompt."""
    if value is None or "{response}" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise RewardError(f"reward.judge_template={value!r} holds no {{response}} placeholder, so it is read as a "
                          f"file path, and there is no file {path.resolve()}; give the template text (with "
                          "{question}, {response}, {reference}) or the path of a file holding it")
    text = path.read_text(encoding="utf-8")
    if "{response}" not in text:
        raise RewardError(f"reward.judge_template file {value} has no {{response}} placeholder: the judge would "
                          "never see the response; add {response} (and {question}, {reference} as needed)")
    return text


class JudgePrompt:
    """Judge prompt ids of (question, response, reference) for one judge tokenizer."""

    def __init__(self, tokenizer, template: str | None = None, chat: bool | str = "auto") -> None:
        if chat is True and not tokenizer.has_chat_template:
            raise RewardError("reward.judge_chat=true but the judge's tokenizer has no chat template; give the judge "
                              "model dir a tokenizer with one (chat_template in tokenizer_config.json), or set "
                              "reward.judge_chat=auto (plain text without a chat template) or false")
        self.tokenizer = tokenizer
        self.template = template
        self.chat = chat is True or (chat == "auto" and tokenizer.has_chat_template)

    def text(self, question: str, response: str, reference: str = "") -> str:
        """The rendered template (the user turn, with `chat`)."""
        if self.template is None:
            return build_judge_prompt(question, response)
        return fill_template(self.template, question, response.strip(), reference)

    def ids(self, question: str, response: str, reference: str = "") -> list[int]:
        text = self.text(question, response, reference)
        if self.chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode_prompt(text)
