"""The generative reward model (GenRM) judge: a causal LM, served by a rollout engine, that writes a
verdict on (question, response).

    from yatt_hpc.reward.judge import GenRMJudge
    judge = GenRMJudge.from_pretrained("models/demo/judge")            # hf engine on CPU, greedy, 4 tokens
    judge = GenRMJudge.from_pretrained(path, engine="sglang", device="cuda:4", tp_size=4, dtype="bfloat16")
    texts = judge.generate_verdicts([("reverse abcdab=", "badcba")])   # -> ["yes"]
    scores = judge.score([("reverse abcdab=", "badcba")])              # -> [1.0]  (None = unparseable)

The judge reads `template.build_judge_prompt(question, response)`; the engine is the same
`rollout.engine.BaseEngine` the rollout group uses (`hf` on CPU or one GPU, `sglang` with tp GPUs),
so release/resume, dtype and device binding are those of the rollout engines. `verdict.parse_verdict`
turns the text into a score; `mixing.combine_reward` makes the reward.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from yatt_hpc.reward.template import build_judge_prompt
from yatt_hpc.reward.verdict import parse_verdict
from yatt_hpc.rollout.engine import BaseEngine, GenerationRequest, build_engine


class GenRMJudge:
    """Batched verdict generation on a `BaseEngine` with the judge's tokenizer."""

    def __init__(self, engine: BaseEngine, tokenizer, *, max_positions: int, max_new_tokens: int = 4,
                 temperature: float = 0.0, batch_size: int = 64, seed: int = 0) -> None:
        if max_new_tokens < 1 or temperature < 0 or batch_size < 1 or max_positions <= max_new_tokens:
            raise ValueError(f"GenRMJudge needs max_new_tokens >= 1, temperature >= 0, batch_size >= 1 and "
                             f"max_positions > max_new_tokens; got {max_new_tokens}, {temperature}, {batch_size}, "
                             f"{max_positions}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.seed = seed
        self.max_prompt_tokens = max_positions - max_new_tokens
        self._calls = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", *, engine: str = "hf", tp_size: int = 1,
                        dtype: str | None = "float32", seed: int = 0, engine_options: dict | None = None,
                        **kwargs) -> GenRMJudge:
        """The judge in HF directory `path` (weights, config.json and its tokenizer) on an `engine`;
        `engine_options` go to the engine's constructor (they override `dtype`)."""
        from transformers import AutoConfig  # imported here: transformers import is slow

        from yatt_hpc.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
        config = AutoConfig.from_pretrained(str(path)).get_text_config()
        opts: dict = {"dtype": dtype, **(engine_options or {})}
        if engine == "hf":
            opts.update(max_batch_size=kwargs.get("batch_size", 64), stop_token_ids=list(tokenizer.eos_ids))
        served = build_engine(engine, str(path), device=device, tp_size=tp_size, seed=seed, **opts)
        return cls(served, tokenizer, max_positions=int(config.max_position_embeddings), seed=seed, **kwargs)

    def release_memory(self) -> None:
        """Full colocation: the engine gives its device memory back (no-op on CPU)."""
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def generate_verdicts(self, pairs: Sequence[tuple[str, str]]) -> list[str]:
        """Verdict text for each (question, response) pair, in order. A question too long for the
        judge gets an empty verdict, which parses as a failure: counted and priced, not a crash."""
        prompts = [self._prompt_ids(q, r) for q, r in pairs]
        fits = [i for i, p in enumerate(prompts) if p is not None]
        out = [""] * len(pairs)
        self._calls += 1
        requests = [GenerationRequest(sample_id=i, prompt_ids=np.asarray(prompts[i], np.int64),
                                      max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                      seed=self._seed_of(i)) for i in fits]
        for result in self.engine.generate(requests):
            out[result.sample_id] = self._decode(result.response_ids)
        return out

    def score(self, pairs: Sequence[tuple[str, str]]) -> list[float | None]:
        """Parsed verdict scores; None where the verdict could not be parsed."""
        return [parse_verdict(text) for text in self.generate_verdicts(pairs)]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _seed_of(self, index: int) -> int | None:
        # greedy verdicts need no seed; sampled ones get one per (call, pair), reproducible per run
        if self.temperature == 0:
            return None
        mixed = np.random.SeedSequence([self.seed & 0xFFFFFFFF, self._calls, index])
        return int(mixed.generate_state(1, dtype=np.uint64)[0] % 2**63)

    def _decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist())

    def _prompt_ids(self, question: str, response: str) -> list[int] | None:
        ids = self.tokenizer.encode(build_judge_prompt(question, response))
        excess = len(ids) - self.max_prompt_tokens
        if excess > 0:
            # An overlong response is cut rather than the question: the judge must still see the task.
            keep = max(0, len(response.strip()) - excess)
            ids = self.tokenizer.encode(build_judge_prompt(question, response.strip()[:keep]))
        return ids if len(ids) <= self.max_prompt_tokens else None
