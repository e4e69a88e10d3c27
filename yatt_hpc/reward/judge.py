"""The generative reward model (GenRM) engine: a causal LM that writes a verdict on (question, response).

    from yatt_hpc.reward.judge import GenRMJudge
    judge = GenRMJudge.from_pretrained("models/demo/judge")            # greedy, 4 verdict tokens
    texts = judge.generate_verdicts([("reverse abcdab=", "badcba")])   # -> ["yes"]
    scores = judge.score([("reverse abcdab=", "badcba")])              # -> [1.0]  (None = unparseable)

The judge reads `template.build_judge_prompt(question, response)` and generates text;
`verdict.parse_verdict` turns the text into a score; `mixing.combine_reward` makes the reward. The
engine runs on CPU or on whatever device the model is on.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from yatt_hpc.demo.char_tokenizer import CharTokenizer
from yatt_hpc.offload import HostParking
from yatt_hpc.reward.template import build_judge_prompt
from yatt_hpc.reward.verdict import parse_verdict


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
