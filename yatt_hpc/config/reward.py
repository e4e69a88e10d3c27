"""The `reward:` section of a run's config: the reward mode or its terms, and the GenRM judge's settings.

Part of the typed configuration (`yatt_hpc.config.schema` re-exports it); `yatt_hpc.reward` builds
the terms and the judge from it.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from yatt_hpc.config.section import Section


class RewardTerm(Section):
    """One weighted term of the reward (an item of `reward.terms`)."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_]*$")
    """The term's name (letters, digits, `_`), unique in `reward.terms`; its metric is `reward/<name>/mean`."""
    kind: Literal["exact", "math", "format", "function", "genrm", "environment", "code"]
    """`exact` (response == reference after stripping), `math` (final answer equivalent to the reference, by
    math-verify), `format` (`pattern` found in the response), `function` (user code), `genrm` (the judge),
    `environment` (the rewards `agent.environment` gave the trajectory, summed), `code` (the fraction of the row's
    `tests` the answer's last ```python block passes, run in the sandbox on the tools group or the rollout rank;
    docs/agentic.md). With `agent:` tools the terms read a response's last model turn (its answer), not the tool
    turns before it."""
    weight: float = 1.0
    """The term's weight: the reward is the sum of weight x term (no clipping; a negative weight is a penalty)."""
    pattern: str | None = None
    """`format` only (and needed there): the regex, found with `re.search`, `.` matching newlines too (anchor
    with `^...$` to cover the whole response)."""
    function: str | None = None
    """`function` only (and needed there): `package.module:function`, importable on the GenRM ranks; called
    `fn(prompt: str, response: str, answer: str, metadata: dict) -> float` per row (see `batched`)."""
    batched: bool = False
    """`function` only: call `fn(prompts, responses, answers, metadata)` with lists once per scored batch;
    it returns a list of floats, one per row."""
    all_or_nothing: bool = False
    """`code` only: score 1 when every test passes, else 0 (false: the fraction of tests passed)."""

    @model_validator(mode="after")
    def _fields_of_the_kind(self) -> RewardTerm:
        where = f"reward.terms item {self.name!r} (kind {self.kind})"
        given = {"pattern": self.pattern is not None, "function": self.function is not None, "batched": self.batched,
                 "all_or_nothing": self.all_or_nothing}
        owner = {"pattern": "format", "function": "function", "batched": "function", "all_or_nothing": "code"}
        for key, is_set in given.items():
            if is_set and owner[key] != self.kind:
                raise ValueError(f"{where} sets {key}, which only a {owner[key]} term reads; remove {key} or use "
                                 f"kind: {owner[key]}")
        if self.kind == "format":
            if self.pattern is None:
                raise ValueError(f"{where} needs a pattern: the regex the response must match, e.g. "
                                 "pattern: '^<think>.*</think>'")
            try:
                re.compile(self.pattern)
            except re.error as err:
                raise ValueError(f"{where}: pattern {self.pattern!r} is not a valid regex ({err}); fix it") from None
        if self.kind == "function" and (self.function is None or not _FUNCTION_SPEC.match(self.function)):
            raise ValueError(f"{where}: function={self.function!r} must name package.module:function (the code "
                             "is imported only because this term names it)")
        return self


_FUNCTION_SPEC = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
_JUDGE_FIELDS = ("judge_template", "judge_chat", "judge_parser", "judge_score_min", "judge_score_max",
                 "judge_pattern", "judge_dtype", "judge_batch_size")


class RewardConfig(Section):
    """Scoring: weighted reward terms (rule verifiers, user functions, a generative reward model judge)."""

    mode: Literal["rm_only", "rule_only", "rm_with_rule"] = "rm_with_rule"
    """How rewards combine: GenRM alone, rule verifier alone, or alpha*GenRM + beta*rule (the shorthand of
    `terms`). With `terms` it follows from them (`rule_only` without a genrm term, `rm_only` with only one,
    else `rm_with_rule`); a different value is refused."""
    overlong_buffer_len: int | None = Field(None, ge=1)
    """DAPO's soft overlong punishment (verl `overlong_buffer.len`): a response longer than rollout.max_new_tokens
    minus this many tokens loses (length - that) / this x `overlong_penalty_factor` from its reward, so one at
    the cap loses the whole factor (metric `reward/overlong/mean`). null: off."""
    overlong_penalty_factor: float = Field(1.0, gt=0)
    """The penalty of a response at the cap (verl `overlong_buffer.penalty_factor`); needs overlong_buffer_len."""
    genrm_path: str = "models/demo/judge"
    """Directory of the GenRM judge model in Hugging Face layout."""
    alpha: float = Field(0.5, ge=0)
    """Weight of the GenRM score in `rm_with_rule` mode (with `terms` each term has its weight: other values
    are refused)."""
    beta: float = Field(0.5, ge=0)
    """Weight of the rule score in `rm_with_rule` mode (with `terms` each term has its weight: other values
    are refused)."""
    terms: list[RewardTerm] | None = None
    """The reward as weighted terms, summed, e.g. `[{name: acc, kind: math}, {name: fmt, kind: format, pattern:
    "</think>", weight: 0.1}, {name: mine, kind: function, function: "pkg.mod:fn", weight: 0.5, batched: false},
    {name: judge, kind: genrm, weight: 0.5}, {name: tests, kind: code, all_or_nothing: false}]` (keys: name, kind,
    weight, pattern, function, batched, all_or_nothing). A function gets metadata {sample_id, prompt_id, owner,
    response_tokens, finish}; one that raises stops the run naming the row. A code term runs the answer's last
    ```python block on the row's `tests` in the sandbox, on the tools group or the rollout ranks (docs/agentic.md).
    At most one genrm term and one code term. `rule_score` (reward/accuracy, the judge agreement) is the first
    exact, math, function or code term, else the exact verifier as a metric only. null: the `mode` shorthand,
    terms `genrm` (weight alpha) and `rule` (kind exact, weight beta)."""
    parse_fail_score: float = Field(0.0, ge=0, le=1)
    """Score given when the judge's verdict cannot be parsed (counted as reward/genrm_parse_fail)."""
    verdict_max_tokens: int = Field(512, ge=1)
    """Tokens the judge may generate for its verdict (a reasoning judge needs hundreds; the parsers read the
    final verdict)."""
    verdict_temperature: float = Field(0.0, ge=0)
    """Judge sampling temperature; 0 means greedy."""
    judge_template: str | None = None
    """The judge prompt: text with `{question}`, `{response}` and `{reference}` placeholders (other braces stay
    as written), or the path of a file holding it (a value without `{response}` is read as a path). null: the
    demo judge's prompt `{question}{response}\\nCorrect? `."""
    judge_chat: Literal["auto", True, False] = "auto"
    """Render the judge prompt as the user turn of the judge tokenizer's chat template: `auto` when the
    tokenizer has one (plain text otherwise: the demo judge), `true` (refused without one), `false` plain text."""
    judge_parser: Literal["yes_no", "boxed_score", "last_number", "regex"] = "yes_no"
    """How a verdict becomes a score in [0, 1], from its end: `yes_no` (the last yes/correct/no/wrong word, or a
    bare number in [0, 1]), `boxed_score` (the last `\\boxed{N}` on the judge score scale), `last_number` (the
    last number on the scale; `N/M` is N out of M), `regex` (the last match of `judge_pattern`)."""
    judge_score_min: float = 0.0
    """The judge score scale's low end (score 0) for boxed_score, last_number and regex; outside the scale is a
    parse failure."""
    judge_score_max: float = 10.0
    """The judge score scale's high end (score 1) for boxed_score, last_number and regex."""
    judge_pattern: str | None = None
    """`regex` parser only (and needed there): a regex with one group holding yes/no or a number on the scale,
    matched case-insensitively; the last match counts, e.g. `Final verdict: (yes|no)`."""
    judge_dtype: Literal["float32", "bfloat16", "float16", None] = None
    """Parameter dtype of the judge's engine; null takes model.dtype."""
    judge_batch_size: int | None = Field(None, ge=1)
    """Judge prompts given to the engine at a time (the hf engine's batch; bounds SGLang's concurrency too);
    null: rollout.max_batch_size when that is set, else 64."""

    @model_validator(mode="before")
    @classmethod
    def _mode_follows_the_terms(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("terms") and "mode" not in data:
            kinds = [t.get("kind") if isinstance(t, dict) else getattr(t, "kind", None) for t in data["terms"]]
            data = {**data, "mode": _mode_of(kinds)}
        return data

    @field_validator("terms", mode="before")
    @classmethod
    def _term_keys(cls, value: object) -> object:
        valid = list(RewardTerm.model_fields)
        for i, item in enumerate(value if isinstance(value, list) else []):
            unknown = sorted(set(item) - set(valid)) if isinstance(item, dict) else []
            if unknown:
                raise ValueError(f"reward.terms[{i}]: unknown key {unknown[0]!r}; valid keys: {', '.join(valid)}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RewardConfig:
        if self.terms is not None:
            self._check_terms(self.terms)
        if self._changed("overlong_penalty_factor") and self.overlong_buffer_len is None:
            raise ValueError(f"reward.overlong_penalty_factor={self.overlong_penalty_factor:g} sizes the overlong "
                             "penalty, which reward.overlong_buffer_len turns on; set it, or drop the factor")
        if self.mode == "rule_only":
            refused = [f for f in _JUDGE_FIELDS if self._changed(f)]
            if refused:
                raise ValueError(f"reward.{refused[0]} is set but no judge runs (reward.mode=rule_only, or no genrm "
                                 f"term); remove reward.{refused[0]}, or add a genrm term")
        numeric = self.judge_parser in ("boxed_score", "last_number", "regex")
        for name in ("judge_score_min", "judge_score_max"):
            if self._changed(name) and not numeric:
                raise ValueError(f"reward.{name} is set but reward.judge_parser={self.judge_parser} reads no scale; "
                                 "remove it, or use judge_parser boxed_score, last_number or regex")
        if self.judge_score_min >= self.judge_score_max:
            raise ValueError(f"reward.judge_score_min={self.judge_score_min:g} must be below reward.judge_score_max="
                             f"{self.judge_score_max:g}; e.g. 0 and 10 for scores out of ten")
        if (self.judge_parser == "regex") != (self.judge_pattern is not None):
            raise ValueError("reward.judge_pattern is the regex of reward.judge_parser=regex and only of it: set both "
                             "(e.g. judge_pattern: 'Final verdict: (yes|no)') or neither")
        if self.judge_pattern is not None:
            try:
                groups = re.compile(self.judge_pattern).groups
            except re.error as err:
                raise ValueError(f"reward.judge_pattern={self.judge_pattern!r} is not a valid regex ({err})") from None
            if groups != 1:
                raise ValueError(f"reward.judge_pattern={self.judge_pattern!r} has {groups} groups; it needs exactly "
                                 "one, holding the verdict (use (?:...) for the others)")
        for word in ("answer", "prompt"):
            if self.judge_template is not None and "{" + word + "}" in self.judge_template:
                raise ValueError(f"reward.judge_template uses {{{word}}}, which is no placeholder; the placeholders "
                                 "are {question}, {response} and {reference}")
        return self

    def _check_terms(self, terms: list[RewardTerm]) -> None:
        names = [t.name for t in terms]
        twice = sorted({n for n in names if names.count(n) > 1})
        if not terms or twice:
            raise ValueError(f"reward.terms needs at least one term, each with its own name; "
                             f"{'repeated: ' + ', '.join(twice) if twice else 'got none'}")
        judges = [t.name for t in terms if t.kind == "genrm"]
        if len(judges) > 1:
            raise ValueError(f"reward.terms has {len(judges)} genrm terms ({', '.join(judges)}); there is one judge, "
                             "so keep one genrm term")
        codes = [t.name for t in terms if t.kind == "code"]
        if len(codes) > 1:
            raise ValueError(f"reward.terms has {len(codes)} code terms ({', '.join(codes)}); the rollout ranks run "
                             "the tests once per response, so keep one code term")
        for name in ("alpha", "beta"):
            if self._changed(name):
                raise ValueError(f"reward.{name}={getattr(self, name):g} is a weight of the reward.mode shorthand, not "
                                 f"read with reward.terms; leave it at {type(self).model_fields[name].default:g} "
                                 "(remove it) and give each term its weight")
        derived = _mode_of([t.kind for t in terms])
        if self.mode != derived:
            raise ValueError(f"reward.mode={self.mode} disagrees with reward.terms, which make it {derived} "
                             f"({'a' if judges else 'no'} genrm term); remove reward.mode (it follows from the terms) "
                             f"or --set reward.mode={derived}")

    def _changed(self, name: str) -> bool:
        """Whether a field holds other than its default (a default value has no effect to refuse)."""
        return getattr(self, name) != type(self).model_fields[name].default

    @property
    def needs_answer(self) -> bool:
        """Whether every row must carry `data.answer_key`: a term other than genrm, code and format reads the
        reference (rows without one get an empty answer otherwise)."""
        return any(t.kind not in ("genrm", "code", "format") for t in self.effective_terms())

    def effective_terms(self) -> tuple[RewardTerm, ...]:
        """The terms that make the reward: `terms`, or those the `mode` shorthand stands for."""
        if self.terms is not None:
            return tuple(self.terms)
        judge, rule = RewardTerm(name="genrm", kind="genrm"), RewardTerm(name="rule", kind="exact")
        if self.mode == "rm_only":
            return (judge,)
        if self.mode == "rule_only":
            return (rule,)
        return (judge.model_copy(update={"weight": self.alpha}), rule.model_copy(update={"weight": self.beta}))


def _mode_of(kinds: list) -> str:
    """The `reward.mode` a list of term kinds makes."""
    if "genrm" not in kinds:
        return "rule_only"
    return "rm_only" if all(k == "genrm" for k in kinds) else "rm_with_rule"
