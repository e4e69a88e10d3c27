"""The generative reward model (GenRM): a causal LM that writes a verdict on (question, response).

    from yatt_hpc.reward.genrm import GenRMJudge, combine_reward
    judge = GenRMJudge.from_pretrained("models/demo/judge")            # greedy, 4 verdict tokens
    texts = judge.generate_verdicts([("reverse abcdab=", "badcba")])   # -> ["yes"]
    scores = judge.score([("reverse abcdab=", "badcba")])              # -> [1.0]  (None = unparseable)
    combine_reward(scores[0], 1.0, "rm_with_rule", alpha=0.5, beta=0.5, parse_fail_score=0.0)

The judge reads `build_judge_prompt(question, response)` and generates text; `parse_verdict` turns
the text into a score in [0, 1], or None when it is not a verdict, so that parse failures can be
counted and priced (`parse_fail_score`) instead of silently becoming 0. The engine runs on CPU or on
whatever device the model is on; the GPU path of the library swaps it for an SGLang engine that
uses the same template and parser.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from yatt_hpc.data.tokenizer import CharTokenizer
from yatt_hpc.offload import HostParking

# The judge reads the transcript exactly as the policy wrote it (prompt then response), so a judge
# can start from the policy's own weights; the question then asks for the verdict.
JUDGE_TEMPLATE = "{question}{response}\nCorrect? "
VERDICT_YES = "yes"
VERDICT_NO = "no"
REWARD_MODES = ("rm_only", "rule_only", "rm_with_rule")

_YES_WORDS = {"yes", "correct", "right", "true"}
_NO_WORDS = {"no", "wrong", "incorrect", "false"}
_FIRST_WORD = re.compile(r"\s*([a-z]+|\d+(?:\.\d+)?)")


def build_judge_prompt(question: str, response: str) -> str:
    """The text the judge continues with its verdict."""
    # Newlines become spaces so that a response cannot forge the template's own verdict line.
    return JUDGE_TEMPLATE.format(question=question, response=response.strip().replace("\n", " "))


def verdict_text(is_correct: bool) -> str:
    """What the judge is trained to answer (kept within the default 4 verdict tokens)."""
    return VERDICT_YES if is_correct else VERDICT_NO


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


def judge_agrees(genrm_score: float | None, rule_score: float) -> bool:
    """Whether a verdict matches the rule verifier: score >= 0.5 exactly when the rule says correct.
    An unparseable verdict never agrees."""
    return genrm_score is not None and (genrm_score >= 0.5) == (rule_score >= 0.5)


def combine_reward(genrm_score: float | None, rule_score: float | None, mode: str,
                   alpha: float, beta: float, parse_fail_score: float) -> float:
    """The reward of one response, clipped to [0, 1].

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
        value = genrm
    elif mode == "rule_only":
        value = rule_score
    else:
        value = alpha * genrm + beta * rule_score
    return min(1.0, max(0.0, float(value)))


class GenRMJudge:
    """Batched verdict generation with a Hugging Face causal LM and a yatt-hpc character tokenizer."""

    def __init__(self, model: torch.nn.Module, tokenizer: CharTokenizer, *, max_new_tokens: int = 4,
                 temperature: float = 0.0, batch_size: int = 64) -> None:
        if max_new_tokens < 1 or temperature < 0 or batch_size < 1:
            raise ValueError(f"GenRMJudge needs max_new_tokens >= 1, temperature >= 0, batch_size >= 1; got "
                             f"{max_new_tokens}, {temperature}, {batch_size}")
        self.model = model.eval()
        self.device = next(model.parameters()).device  # where it runs; release_memory parks it on the host
        self._parking = HostParking()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        max_positions = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
        self.max_prompt_tokens = max_positions - max_new_tokens

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", **kwargs) -> GenRMJudge:
        """Load a judge saved with `save_pretrained` plus `CharTokenizer.save` in the same directory."""
        from transformers import AutoModelForCausalLM  # imported here: transformers import is slow

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
        return cls(model, CharTokenizer.load(path), **kwargs)

    def release_memory(self) -> None:
        """Full colocation: weights to host memory and the cached blocks back to CUDA (no-op on CPU)."""
        if self.device.type == "cuda":
            self._parking.release([self.model])

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self._parking.resume([self.model], None, self.device)

    def generate_verdicts(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        """Verdict text for each (question, response) pair, in order. A question too long for the
        judge gets an empty verdict, which parses as a failure: counted and priced, not a crash."""
        prompts = [self._prompt_ids(q, r) for q, r in pairs]
        fits = [i for i, p in enumerate(prompts) if p is not None]
        out = [""] * len(pairs)
        for start in range(0, len(fits), self.batch_size):
            chunk = fits[start:start + self.batch_size]
            for i, text in zip(chunk, self._generate([prompts[i] for i in chunk])):
                out[i] = text
        return out

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float | None]:
        """Parsed verdict scores; None where the verdict could not be parsed."""
        return [parse_verdict(text) for text in self.generate_verdicts(pairs)]

    def _prompt_ids(self, question: str, response: str) -> list[int] | None:
        ids = self.tokenizer.encode(build_judge_prompt(question, response))
        excess = len(ids) - self.max_prompt_tokens
        if excess > 0:
            # An overlong response is cut rather than the question: the judge must still see the task.
            keep = max(0, len(response.strip()) - excess)
            ids = self.tokenizer.encode(build_judge_prompt(question, response.strip()[:keep]))
        return ids if len(ids) <= self.max_prompt_tokens else None

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]]) -> list[str]:
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_id
        # Left padding keeps every prompt's last token at the same column; generate derives the
        # position ids from the attention mask, so padded and unpadded prompts score the same.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        device = next(self.model.parameters()).device
        sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0} if self.temperature > 0 \
            else {"do_sample": False}
        tokens = self.model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                     max_new_tokens=self.max_new_tokens, pad_token_id=pad,
                                     eos_token_id=self.tokenizer.eos_id, **sampling)
        return [self.tokenizer.decode_generated(row) for row in tokens[:, width:].tolist()]
