"""The generative reward model (GenRM) judge: a causal LM, served by a rollout engine, that writes a
verdict on (question, response[, reference]).

    from yatt_hpc.reward.judge import GenRMJudge
    judge = GenRMJudge.from_pretrained("models/demo/judge")            # hf engine on CPU, greedy, 4 tokens
    judge = GenRMJudge.from_pretrained(path, engine="sglang", device="cuda:4", tp_size=4, dtype="bfloat16",
                                       template=text, parser=build_verdict_parser("boxed_score"), max_new_tokens=512)
    texts = judge.generate_verdicts([("reverse abcdab=", "badcba")])   # -> ["yes"]
    scores = judge.score([("reverse abcdab=", "badcba")], references=["badcba"])   # -> [1.0]  (None = unparseable)

The judge reads a `template.JudgePrompt` (the demo's `build_judge_prompt` text by default; a configured
template through the judge's chat template when it has one); the engine is the same
`rollout.engine.BaseEngine` the rollout group uses (`hf` on CPU or one GPU, `sglang` with tp GPUs), so
release/resume, dtype and device binding are those of the rollout engines. The parser (`verdict.py`)
turns the text into a score; `terms.RewardTerms` makes the reward.

A prompt over the judge's context is cut in tokens of the judge's tokenizer, from the end of the
response (never the question or the reference: the judge must still see the task).

Images (`score(..., images=[(png bytes, ...), ...])`): a judge that is a vision-language model
(Qwen2-VL) sees each sample's images where the question has `<image>` (or before it), as the policy
did, and gets the encoded bytes in its requests; a text judge reads the question with its `<image>`
placeholders dropped, so text judges keep working on image rows.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from yatt_hpc.reward.template import JudgePrompt
from yatt_hpc.reward.verdict import parse_verdict
from yatt_hpc.rollout.engine import BaseEngine, GenerationRequest, build_engine
from yatt_hpc.vision.processor import IMAGE_PLACEHOLDER, ImageProcessor, image_size, is_vision_model, mark_images

_CUT_PASSES = 4  # a cut response can tokenize differently where it meets the template; a few passes settle it


class GenRMJudge:
    """Batched verdict generation on a `BaseEngine` with the judge's tokenizer."""

    def __init__(self, engine: BaseEngine, tokenizer, *, max_positions: int, max_new_tokens: int = 4,
                 temperature: float = 0.0, batch_size: int = 64, seed: int = 0, template: str | None = None,
                 chat: bool | str = "auto", parser: Callable[[str], float | None] = parse_verdict,
                 images: ImageProcessor | None = None) -> None:
        if max_new_tokens < 1 or temperature < 0 or batch_size < 1 or max_positions <= max_new_tokens:
            raise ValueError(f"GenRMJudge needs max_new_tokens >= 1, temperature >= 0, batch_size >= 1 and "
                             f"max_positions > max_new_tokens; got {max_new_tokens}, {temperature}, {batch_size}, "
                             f"{max_positions}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompt = JudgePrompt(tokenizer, template, chat)
        self.parser = parser
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.seed = seed
        self.max_prompt_tokens = max_positions - max_new_tokens
        self.images = images  # a vision-language judge's image processor; None for a text judge
        self._calls = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", *, engine: str = "hf", tp_size: int = 1,
                        dtype: str | None = "float32", seed: int = 0, engine_options: dict | None = None,
                        **kwargs) -> GenRMJudge:
        """The judge in HF directory `path` (weights, config.json and its tokenizer) on an `engine`;
        `engine_options` go to the engine's constructor (they override `dtype`)."""
        from yatt_hpc.data.tokenizer import load_tokenizer
        from yatt_hpc.models.hf_config import load_hf_config  # transformers only for what config.json leaves out

        tokenizer = load_tokenizer(path)
        config = load_hf_config(path).get_text_config()
        opts: dict = {"dtype": dtype, **(engine_options or {})}
        if engine == "hf":
            opts.update(max_batch_size=kwargs.get("batch_size", 64), stop_token_ids=list(tokenizer.eos_ids))
        served = build_engine(engine, str(path), device=device, tp_size=tp_size, seed=seed, **opts)
        images = ImageProcessor.from_model_dir(path) if is_vision_model(path) else None
        return cls(served, tokenizer, max_positions=int(config.max_position_embeddings), seed=seed, images=images,
                   **kwargs)

    def release_memory(self) -> None:
        """Full colocation: the engine gives its device memory back (no-op on CPU)."""
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def generate_verdicts(self, pairs: Sequence[tuple[str, str]], references: Sequence[str] | None = None,
                          images: Sequence[tuple[bytes, ...]] | None = None) -> list[str]:
        """Verdict text for each (question, response) pair, in order, asked `batch_size` at a time. A
        question too long for the judge gets an empty verdict, which parses as a failure: counted and
        priced, not a crash."""
        refs = list(references) if references is not None else [""] * len(pairs)
        shown = list(images) if images is not None and self.images is not None else [()] * len(pairs)
        prompts = [self._prompt_ids(self._question(q, pics), r, ref, pics)
                   for (q, r), ref, pics in zip(pairs, refs, shown, strict=True)]
        fits = sorted((i for i, p in enumerate(prompts) if p is not None), key=lambda i: len(prompts[i]))
        out = [""] * len(pairs)
        self._calls += 1
        requests = [GenerationRequest(sample_id=i, prompt_ids=np.asarray(prompts[i], np.int64),
                                      max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                      seed=self._seed_of(i), images=shown[i]) for i in fits]
        for start in range(0, len(requests), self.batch_size):  # similar lengths together: less padding
            for result in self.engine.generate(requests[start:start + self.batch_size]):
                out[result.sample_id] = self._decode(result.response_ids)
        return out

    def score(self, pairs: Sequence[tuple[str, str]], references: Sequence[str] | None = None,
              images: Sequence[tuple[bytes, ...]] | None = None) -> list[float | None]:
        """Parsed verdict scores; None where the verdict could not be parsed."""
        return [self.parser(text) for text in self.generate_verdicts(pairs, references, images)]

    def _question(self, question: str, images: tuple[bytes, ...]) -> str:
        """The question as this judge reads it: its images marked (a vision judge), or their placeholders
        dropped (a text judge, or a row without images)."""
        return mark_images(question, len(images)) if images else question.replace(IMAGE_PLACEHOLDER, "")

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _seed_of(self, index: int) -> int | None:
        # greedy verdicts need no seed; sampled ones get one per (call, pair), reproducible per run
        if self.temperature == 0:
            return None
        mixed = np.random.SeedSequence([self.seed & 0xFFFFFFFF, self._calls, index])
        return int(mixed.generate_state(1, dtype=np.uint64)[0] % 2**63)

    def _expanded(self, ids: list[int], images: tuple[bytes, ...]) -> list[int]:
        if not images:
            return ids
        return self.images.expand(ids, [image_size(b, "a judged sample's image") for b in images])

    def _decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist())

    def _prompt_ids(self, question: str, response: str, reference: str = "",
                    images: tuple[bytes, ...] = ()) -> list[int] | None:
        """The judge prompt, its response cut by tokens of the judge's tokenizer to fit; None if even an
        empty response does not fit."""
        ids = self._expanded(self.prompt.ids(question, response, reference), images)
        excess = len(ids) - self.max_prompt_tokens
        if excess <= 0:
            return ids
        # An overlong response is cut rather than the question: the judge must still see the task.
        response_ids = self.tokenizer.encode(response.strip())
        keep = len(response_ids)
        for _ in range(_CUT_PASSES):
            keep = max(0, keep - excess)
            ids = self._expanded(self.prompt.ids(question, self.tokenizer.decode(response_ids[:keep]), reference),
                                 images)
            excess = len(ids) - self.max_prompt_tokens
            if excess <= 0:
                return ids
            if keep == 0:
                return None
        return None
