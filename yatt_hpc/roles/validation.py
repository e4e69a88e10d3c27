"""Validation's prompts and numbers: which held-out prompts a trainer replica owns, and their metrics.

    held_out = HeldOut.build(cfg, tokenizer, images, dp_rank, dp)
    ids, rows, prompts = held_out.share()            # this replica's prompts of every eval source
    sums = held_out.sums(scored)                     # per source: counts and sums, to add over replicas
    scalars = held_out.scalars(total)                # the leader: val/<source>/... from the global sums

Each replica owns the held-out positions p = d, d + dp, ... of each source (the first `eval.max_prompts`
of the source's order), exactly as it owns training positions: no driver holds the eval set. A
prompt's id is EVAL_ID_BASE + (source index << 32) + p, apart from every training prompt id (and so are
its samples' sampling seeds, the same at every validation: rounds compare the policy, not the dice).
A sample is correct when its rule score is at least 0.5 (the first exact/math/function/code reward term,
else the exact verifier). pass@k is the unbiased estimator (`yatt_hpc/algos/passk.py`) for k = 1, 2, 4, ...
up to n and n; mean@n is the mean reward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from yatt_hpc.algos.passk import pass_at_k
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config.schema import eval_name
from yatt_hpc.data.prompts import build_prompt_source
from yatt_hpc.roles.base import prompt_tools

EVAL_ID_BASE = 1 << 40
CORRECT = 0.5
LENGTH_FINISH = 1
_FIXED = ("prompts", "samples", "reward", "correct", "response_tokens", "truncated")


def ks_of(n: int) -> list[int]:
    """The k of pass@k reported for n samples: 1, 2, 4, ... below n, and n."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})


@dataclass
class HeldOut:
    names: list[str]
    sources: list
    counts: list[int]
    n: int
    dp_rank: int
    dp: int

    @classmethod
    def build(cls, cfg, tokenizer, images, dp_rank: int, dp: int) -> HeldOut:
        sources, counts = [], []
        for src in cfg.eval.sources:
            stream = build_prompt_source(cfg.data.model_copy(update={"source": src}), tokenizer,
                                         require_answer=cfg.reward.needs_answer, images=images,
                                         tools=prompt_tools(cfg))
            sources.append(stream)
            counts.append(min(len(stream), cfg.eval.max_prompts or len(stream)))
        return cls([eval_name(s) for s in cfg.eval.sources], sources, counts, cfg.eval.samples_per_prompt,
                   dp_rank, dp)

    def share(self) -> tuple[np.ndarray, list[dict], list[np.ndarray]]:
        """This replica's held-out prompt ids, rows and encoded prompts, every source in order."""
        ids, rows, prompts = [], [], []
        for i, (stream, count) in enumerate(zip(self.sources, self.counts)):
            for p in range(self.dp_rank, count, self.dp):
                row = stream.row_at(p)
                ids.append(EVAL_ID_BASE + (i << 32) + p)
                rows.append(row)
                prompts.append(np.asarray(stream.encode(row), np.int32))
        return np.asarray(ids, np.int64), rows, prompts

    def row_of(self, prompt_id: int) -> dict:
        """The held-out row behind a validation prompt id."""
        offset = prompt_id - EVAL_ID_BASE
        return self.sources[offset >> 32].row_at(offset & 0xFFFFFFFF)

    def by_source(self, scored: SampleBatch) -> list[tuple[str, SampleBatch]]:
        """(source name, its samples) of a scored validation batch."""
        source_of = (scored.prompt_id - EVAL_ID_BASE) >> 32
        return [(name, scored.select(np.flatnonzero(source_of == i))) for i, name in enumerate(self.names)]

    def width(self) -> int:
        return len(_FIXED) + len(ks_of(self.n))

    def sums(self, scored: SampleBatch) -> np.ndarray:
        """[sources, width] counts and sums of this replica's scored held-out samples."""
        out = np.zeros((len(self.names), self.width()), np.float64)
        source_of = (scored.prompt_id - EVAL_ID_BASE) >> 32
        correct = scored.rule_score >= CORRECT
        for i in range(len(self.names)):
            rows = np.flatnonzero(source_of == i)
            groups = np.unique(scored.prompt_id[rows])
            out[i, :len(_FIXED)] = (len(groups), len(rows), scored.reward[rows].sum(), correct[rows].sum(),
                                    scored.response_len[rows].sum(), (scored.finish[rows] == LENGTH_FINISH).sum())
            for g in groups:
                c = int(correct[scored.prompt_id == g].sum())
                out[i, len(_FIXED):] += [pass_at_k(self.n, c, k) for k in ks_of(self.n)]
        return out

    def scalars(self, total: np.ndarray) -> dict[str, float]:
        """val/<source>/... of the global sums (every replica's `sums` added)."""
        out: dict[str, float] = {}
        for name, row in zip(self.names, total):
            prompts, samples, reward, correct, tokens, truncated = row[:len(_FIXED)]
            samples_, prompts_ = max(samples, 1.0), max(prompts, 1.0)
            out.update({f"val/{name}/reward_mean": reward / samples_, f"val/{name}/accuracy": correct / samples_,
                        f"val/{name}/mean@{self.n}": reward / samples_,
                        f"val/{name}/response_len_mean": tokens / samples_,
                        f"val/{name}/truncated_frac": truncated / samples_, f"val/{name}/prompts": prompts})
            for k, passed in zip(ks_of(self.n), row[len(_FIXED):]):
                out[f"val/{name}/pass@{k}"] = passed / prompts_
        return out
