"""A trainer replica's rows of a sample table: a few of its own scored samples, decoded, for the leader to log.

    if samples_due(cfg, step + 1):
        stats.samples += sample_rows(batch, tokenizer, labels, step=step + 1, table="train", replica=d,
                                     count=cfg.logging.samples_per_replica, image_names=names_of)

Each replica's owner picks the first sample of each of its first `count` prompt groups (sample-id order:
the same rows whatever the timing) and sends them with its step report (`runtime/rank_stats.py`): a few
small dicts per replica, never the batch. The leader gathers them into one table (`metrics/tables.py`).
Rows hold what the samples carry: the decoded prompt (the user's question where the row has one) and
response, the reference answer, the reward, the correctness term's score, the judge's score (its verdict;
`parse failed` when the judge's text gave none), the finish reason and the response length, and the names
of a group's images.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from yatt_hpc.batch import SampleBatch

FINISH = {0: "stop", 1: "length", 2: "abort"}


@dataclass(frozen=True)
class TermLabels:
    """The names a table gives the scores a sample carries: the correctness term and the judge's term."""

    rule: str
    judge: str | None

    @classmethod
    def of(cls, reward_cfg) -> TermLabels:
        terms = reward_cfg.effective_terms()
        rule = next((t.name for t in terms if t.kind in ("exact", "math", "function")), "exact (metric only)")
        judge = next((t.name for t in terms if t.kind == "genrm"), None)
        return cls(rule, judge)


def samples_due(cfg, step: int) -> bool:
    """Whether the training step `step` (1-based) has a sample table: every `logging.samples_every` steps."""
    every = cfg.logging.samples_every
    return every > 0 and step % every == 0


def pick(batch: SampleBatch, count: int) -> np.ndarray:
    """Indices of the first sample of each of the batch's first `count` prompt groups, in sample-id order."""
    if not len(batch):
        return np.zeros(0, np.int64)
    order = np.argsort(batch.sample_id, kind="stable")
    _, first = np.unique(batch.prompt_id[order], return_index=True)
    chosen = order[first]
    return chosen[np.argsort(batch.sample_id[chosen], kind="stable")][:count]


def sample_rows(batch: SampleBatch, tokenizer, labels: TermLabels, *, step: int, table: str, replica: int,
                count: int, image_names: Callable[[int], list[str]] | None = None) -> list[dict]:
    """The table rows of `count` samples of `batch`; `image_names(prompt_id)` names a group's images."""
    index = pick(batch, count)
    if not len(index):
        return []
    part = batch.select(index)
    questions, answers = part.questions(), part.answers()
    prompts, responses, masks = part.ragged("prompt_tokens"), part.ragged("response_tokens"), part.ragged("response_mask")
    rows = []
    for i in range(len(part)):
        terms = {labels.rule: float(part.rule_score[i])}
        verdict = None
        if labels.judge is not None:
            terms[labels.judge] = float(part.genrm_score[i])
            verdict = "parse failed" if part.parse_fail[i] else f"{float(part.genrm_score[i]):g}"
        carries = image_names is not None and part.image_count[i] > 0  # a group's first sample holds its images
        names = image_names(int(part.prompt_id[i])) if carries else []
        rows.append({"step": step, "table": table, "replica": replica, "sample": int(part.sample_id[i]),
                     "prompt": questions[i] or tokenizer.decode(prompts[i].tolist()),
                     "response": transcript(tokenizer, responses[i], masks[i]), "answer": answers[i],
                     "reward": float(part.reward[i]), "terms": terms, "verdict": verdict,
                     "finish": FINISH.get(int(part.finish[i]), str(int(part.finish[i]))),
                     "tokens": int(part.response_len[i]), "images": ", ".join(names) or None})
    return rows


def transcript(tokenizer, tokens: np.ndarray, mask: np.ndarray) -> str:
    """A response as text: each run of model tokens decoded up to its end of turn, each run the model did not
    sample (an agent's tool results) as it is; a single-turn response is one run."""
    cuts = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    return "".join(tokenizer.decode(run.tolist()) for run in np.split(tokens, cuts) if len(run))
