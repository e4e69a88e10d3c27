"""The reward as weighted terms: each term scores every sample, the reward is sum(weight x term).

    terms = RewardTerms(cfg.reward.effective_terms(), judge=judge, parse_fail_score=cfg.reward.parse_fail_score)
    got = terms.score(ScoringRows(prompts, responses, answers, metadata))
    got.reward, got.values["acc"], got.rule_score, got.genrm_score, got.parse_fail

Kinds (a term is any object with `name`, `kind`, `weight`, `pattern`, `function`, `batched`, as
`config.reward.RewardTerm`):

    exact     verifier.rule_score: the response is the answer (after stripping whitespace)
    math      math_answer.math_score: the final answer (\\boxed{} or the last number) equals the answer
    format    verifier.format_score: the regex `pattern` is found in the response
    function  function.FunctionTerm: user code `pkg.mod:fn`, imported only because a term names it
    genrm     the judge's parsed verdict; an unparseable one counts as `parse_fail_score` (and in parse_fail)
    environment  the rewards `agent.environment` gave the trajectory, summed (the rollout rank's `env_reward` column)
    code      the fraction of the row's tests the answer's program passes: run by the rollout side
              (agent/code_runs.py: on the tools group, or the rollout rank's sandbox), read from `code_reward`

Besides the reward, the batch keeps the columns the rest of the system reads: `rule_score` is the first
`exact`, `math`, `function` or `code` term (the correctness check: `reward/accuracy` and the judge agreement
measure it), or the exact verifier as a metric only when no term is one; `genrm_score` is the judge's
score (`parse_fail_score` without a judge).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from yatt_hpc.reward.function import FunctionTerm
from yatt_hpc.reward.math_answer import math_score
from yatt_hpc.reward.mixing import weighted_sum
from yatt_hpc.reward.verifier import format_score, rule_score

TERM_KINDS = ("exact", "math", "format", "function", "genrm", "environment", "code")
RULE_KINDS = ("exact", "math", "function", "code")  # rule_score is the first term of these kinds


@dataclass
class ScoringRows:
    """What the terms see of each sample: the decoded prompt and response, the reference, the metadata."""

    prompts: list[str]
    responses: list[str]
    answers: list[str]
    metadata: list[dict]
    images: list[tuple[bytes, ...]] | None = None
    """Each sample's row images (encoded), for a judge that is a vision-language model; None: no images."""
    env_rewards: list[float] | None = None
    """Each sample's summed `agent.environment` rewards (the `environment` term); None: zeros."""
    code_rewards: list[float] | None = None
    """Each sample's `code` term: the share of its tests its program passed, scored on the rollout side."""

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class TermScores:
    """Per-term scores (unweighted) and the batch columns made from them."""

    values: dict[str, np.ndarray]
    reward: np.ndarray
    rule_score: np.ndarray
    genrm_score: np.ndarray
    parse_fail: np.ndarray


class RewardTerms:
    """The configured terms, built once (user functions imported, patterns compiled), scoring batches."""

    def __init__(self, terms: Sequence, judge=None, parse_fail_score: float = 0.0) -> None:
        if not terms:
            raise ValueError("a reward needs at least one term")
        self.terms = list(terms)
        self.weights = {t.name: float(t.weight) for t in self.terms}
        self.judge, self.parse_fail_score = judge, parse_fail_score
        self._functions = {t.name: FunctionTerm(t.name, t.function, t.batched) for t in self.terms
                           if t.kind == "function"}
        self._patterns = {t.name: re.compile(t.pattern, re.DOTALL) for t in self.terms if t.kind == "format"}
        if any(t.kind == "genrm" for t in self.terms) and judge is None:
            raise ValueError("a genrm reward term needs a judge")
        self.rule_term = next((t.name for t in self.terms if t.kind in RULE_KINDS), None)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    def score(self, rows: ScoringRows) -> TermScores:
        n = len(rows)
        verdicts: list[float | None] = [None] * n
        values: dict[str, np.ndarray] = {}
        for term in self.terms:
            if term.kind == "genrm":
                verdicts = self.judge.score(list(zip(rows.prompts, rows.responses)), references=rows.answers,
                                            images=rows.images)
                values[term.name] = self._priced(verdicts)
            else:
                values[term.name] = np.asarray(self._rule(term, rows), np.float32).reshape(n)
        if self.rule_term is not None:
            rule = values[self.rule_term]
        else:  # no correctness term: the exact verifier, as a metric only (it is not in the reward)
            rule = np.array([rule_score(r, a) for r, a in zip(rows.responses, rows.answers)], np.float32)
        return TermScores(values=values, reward=weighted_sum(values, self.weights), rule_score=rule,
                          genrm_score=self._priced(verdicts),
                          parse_fail=np.array([self.judge is not None and v is None for v in verdicts], np.int8))

    def _priced(self, verdicts: Sequence[float | None]) -> np.ndarray:
        return np.array([self.parse_fail_score if v is None else v for v in verdicts], np.float32)

    def _rule(self, term, rows: ScoringRows) -> list[float]:
        if term.kind == "exact":
            return [rule_score(r, a) for r, a in zip(rows.responses, rows.answers)]
        if term.kind == "math":
            return [math_score(r, a) for r, a in zip(rows.responses, rows.answers)]
        if term.kind == "format":
            return [format_score(r, self._patterns[term.name]) for r in rows.responses]
        if term.kind == "function":
            return self._functions[term.name](rows.prompts, rows.responses, rows.answers, rows.metadata)
        if term.kind == "environment":
            return list(rows.env_rewards) if rows.env_rewards is not None else [0.0] * len(rows.responses)
        if term.kind == "code":
            if rows.code_rewards is None:
                raise ValueError(f"reward term {term.name!r} (kind code) needs the rollout side's code_reward column")
            return list(rows.code_rewards)
        raise ValueError(f"unknown reward term kind {term.kind!r}; valid kinds: {', '.join(TERM_KINDS)}")
