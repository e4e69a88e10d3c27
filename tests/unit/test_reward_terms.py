"""Rewards as weighted terms: the built-in kinds on hand-computed cases, user functions (per row, batched,
failing loudly), the weighted sum and the columns kept for the rest of the system, and `reward.terms` in the
config (the `mode` shorthand, refused combinations).

    .venv/bin/python -m pytest tests/unit/test_reward_terms.py -q
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import yaml

from tests.conftest import REPO
from tests.programs import reward_fns
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.load import validate
from yatt_hpc.config.schema import RewardConfig, RewardTerm
from yatt_hpc.errors import USER_ERRORS
from yatt_hpc.reward.errors import RewardError
from yatt_hpc.reward.function import FunctionTerm, load_function, row_metadata
from yatt_hpc.reward.math_answer import math_score
from yatt_hpc.reward.terms import RewardTerms, ScoringRows
from yatt_hpc.reward.verifier import format_score

FNS = "tests.programs.reward_fns"


@pytest.mark.parametrize("response,answer,score", [
    pytest.param(r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0, id="boxed-frac-vs-decimal"),
    pytest.param(r"\boxed{\frac{1}{2}}", "1/2", 1.0, id="boxed-frac-vs-slash"),
    pytest.param(r"\boxed{0.50}", r"\frac{1}{2}", 1.0, id="decimal-vs-latex-reference"),
    pytest.param("half of 3 is 1.5, and 1.5 - 1 = 0.5", "1/2", 1.0, id="last-number"),
    pytest.param("we get 3, then 2", "3", 0.0, id="not-the-first-number"),
    pytest.param(r"\boxed{4} (or maybe 5)", "4", 1.0, id="the-box-wins-over-a-later-number"),
    pytest.param(r"\boxed{1+x}", "x+1", 1.0, id="expression"),
    pytest.param(r"\boxed{\frac{1}{3}}", "0.5", 0.0, id="wrong-fraction"),
    pytest.param(r"\boxed{5}", "4", 0.0, id="wrong-box"),
    pytest.param("I do not know", "0.5", 0.0, id="no-answer"),
    pytest.param("", "0.5", 0.0, id="empty"),
    pytest.param("12", "", 0.0, id="no-reference"),
])
def test_math_term_checks_the_final_answer_with_math_verify(response, answer, score):
    assert math_score(response, answer) == score


@pytest.mark.parametrize("response,pattern,score", [
    pytest.param("<think>a\nb</think> 42", r"^<think>.*</think>", 1.0, id="dot-spans-newlines"),
    pytest.param("42 <think>a</think>", r"^<think>.*</think>", 0.0, id="anchored"),
    pytest.param(r"so \boxed{7}", r"\\boxed\{\d+\}", 1.0, id="search-anywhere"),
    pytest.param("seven", r"\d", 0.0, id="no-match"),
])
def test_format_term_is_whether_the_pattern_is_found(response, pattern, score):
    assert format_score(response, pattern) == score


def _rows(prompts, responses, answers) -> ScoringRows:
    n = len(prompts)
    meta = row_metadata(np.arange(n) + 100, np.arange(n) // 2, np.zeros(n), [len(r) for r in responses], np.zeros(n))
    return ScoringRows(list(prompts), list(responses), list(answers), meta)


def _term(name, kind, weight=1.0, **kw):
    return RewardTerm(name=name, kind=kind, weight=weight, **kw)


def test_weights_combine_the_terms_and_rule_score_is_the_first_correctness_term():
    terms = RewardTerms([_term("fmt", "format", 0.1, pattern=r"\\boxed"), _term("acc", "math", 1.0),
                         _term("same", "exact", -0.5)])
    got = terms.score(_rows(["q", "q", "q"], [r"\boxed{2}", "2", "3"], ["2", "2", "2"]))
    assert got.values["fmt"].tolist() == [1.0, 0.0, 0.0]
    assert got.values["acc"].tolist() == [1.0, 1.0, 0.0]
    assert got.values["same"].tolist() == [0.0, 1.0, 0.0]
    assert got.reward.tolist() == pytest.approx([0.1 + 1.0, 1.0 - 0.5, 0.0])
    assert got.rule_score.tolist() == [1.0, 1.0, 0.0]  # acc: fmt comes first but checks no answer
    assert got.parse_fail.tolist() == [0, 0, 0] and got.genrm_score.tolist() == [0.0, 0.0, 0.0]


def test_without_a_correctness_term_rule_score_is_the_exact_verifier_as_a_metric_only():
    got = RewardTerms([_term("fmt", "format", pattern="b")]).score(_rows(["q", "q"], ["ab", "b"], ["b", "b"]))
    assert got.reward.tolist() == [1.0, 1.0] and got.rule_score.tolist() == [0.0, 1.0]


class _Judge:
    def __init__(self, scores):
        self.scores, self.seen = scores, []

    def score(self, pairs, references=None, images=None):
        self.seen.append((list(pairs), list(references)))
        return list(self.scores)


def test_the_judge_term_sees_the_reference_and_prices_parse_failures():
    judge = _Judge([1.0, None, 0.25])
    terms = RewardTerms([_term("judge", "genrm", 0.5), _term("acc", "exact", 0.5)], judge=judge, parse_fail_score=0.2)
    got = terms.score(_rows(["p1", "p2", "p3"], ["a", "b", "c"], ["a", "x", "y"]))
    assert judge.seen == [([("p1", "a"), ("p2", "b"), ("p3", "c")], ["a", "x", "y"])]
    assert got.values["judge"].tolist() == pytest.approx([1.0, 0.2, 0.25]) == got.genrm_score.tolist()
    assert got.parse_fail.tolist() == [0, 1, 0]
    assert got.reward.tolist() == pytest.approx([1.0, 0.1, 0.125])


def test_a_user_function_scores_every_row_with_its_metadata():
    reward_fns.CALLS.clear()
    term = FunctionTerm("short", f"{FNS}:shortness")
    rows = _rows(["q", "q", "q"], ["a", "abc", ""], ["", "", ""])
    assert term(rows.prompts, rows.responses, rows.answers, rows.metadata) == pytest.approx([0.5, 0.25, 1.0])
    assert reward_fns.CALLS == [1, 1, 1]
    assert rows.metadata[1] == {"sample_id": 101, "prompt_id": 0, "owner": 0, "response_tokens": 3, "finish": "stop"}


def test_metadata_holds_the_rows_own_columns_under_the_samples_keys():
    meta = row_metadata([7], [3], [1], [5], [1], extra=[{"level": 2, "sample_id": "theirs"}])
    assert meta == [{"level": 2, "sample_id": 7, "prompt_id": 3, "owner": 1, "response_tokens": 5, "finish": "length"}]


def test_a_batched_user_function_takes_lists_once():
    reward_fns.CALLS.clear()
    terms = RewardTerms([_term("has", "function", function=f"{FNS}:answer_in_response", batched=True),
                         _term("short", "function", 2.0, function=f"{FNS}:shortness")])
    got = terms.score(_rows(["q"] * 4, ["is 42", "41", "42!", "x"], ["42", "42", "42", "42"]))
    assert got.values["has"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert reward_fns.CALLS == [4, 1, 1, 1, 1]
    assert got.reward.tolist() == pytest.approx([1 + 2 / 6, 2 / 3, 1 + 2 / 4, 2 / 2])
    assert got.rule_score.tolist() == [1.0, 0.0, 1.0, 0.0]  # the first function term


def test_a_raising_user_function_stops_the_run_naming_the_row_and_its_traceback():
    term = FunctionTerm("picky", f"{FNS}:fails_on_long_prompts")
    rows = _rows(["short", "a much longer prompt"], ["r", "r"], ["", ""])
    with pytest.raises(RewardError) as err:
        term(rows.prompts, rows.responses, rows.answers, rows.metadata)
    text = str(err.value)
    assert text.startswith(f"reward term 'picky' (function {FNS}:fails_on_long_prompts) raised on sample 101 "
                           "(prompt id 0 of the trainer replica at world rank 0, prompt 'a much longer prompt'): "
                           "ZeroDivisionError: division by zero")
    assert "in fails_on_long_prompts" in text and "in _divide" in text and "return a / b" in text  # its traceback
    assert "fix the function" in text and "terms.py" not in text
    assert isinstance(err.value, USER_ERRORS)  # the rank prints it as one message and the run stops (exit 2)


@pytest.mark.parametrize("fn,batched,needle", [
    pytest.param("returns_text", False, "returned 'high' on sample 100", id="not-a-number"),
    pytest.param("returns_too_few", True, "returned 1 scores for a batch of 2 rows", id="too-few"),
    pytest.param("returns_nan", True, "returned nan for sample 100", id="nan"),
])
def test_a_user_function_must_return_a_finite_number_per_row(fn, batched, needle):
    term = FunctionTerm("mine", f"{FNS}:{fn}", batched=batched)
    rows = _rows(["p", "p"], ["r", "r"], ["", ""])
    with pytest.raises(RewardError, match=needle):
        term(rows.prompts, rows.responses, rows.answers, rows.metadata)


@pytest.mark.parametrize("spec,needle", [
    pytest.param("no_such_module_xyz:fn", "module 'no_such_module_xyz' of function='no_such_module_xyz:fn' cannot "
                 "be imported (ModuleNotFoundError", id="missing-module"),
    pytest.param(f"{FNS}:nope", f"'{FNS}' has no 'nope'", id="missing-function"),
    pytest.param(f"{FNS}:NOT_A_FUNCTION", "is a int, not a function", id="not-callable"),
    pytest.param(f"{FNS}.shortness", "is not of the form package.module:function", id="no-colon"),
])
def test_loading_a_user_function_names_what_is_wrong(spec, needle):
    with pytest.raises(RewardError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_function(spec, "mine")


def test_a_module_on_sys_path_loads_and_user_code_runs_only_when_named(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_tmp.py").write_text("import sys\nsys.modules[__name__].imported = True\n"
                                                "def bonus(prompt, response, answer, metadata):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    RewardTerms([_term("acc", "exact")])
    assert "my_rewards_tmp" not in sys.modules  # nothing imports user code a term does not name
    fn = load_function("my_rewards_tmp:bonus", "b")
    assert fn("p", "r", "a", {}) == 0.25 and sys.modules["my_rewards_tmp"].imported
    monkeypatch.delitem(sys.modules, "my_rewards_tmp")


# ------------------------------------------------------------------ reward.terms in the config


def test_the_mode_shorthand_stands_for_terms():
    assert [(t.name, t.kind, t.weight) for t in RewardConfig(alpha=0.3, beta=0.6).effective_terms()] == \
        [("genrm", "genrm", 0.3), ("rule", "exact", 0.6)]
    assert [(t.kind, t.weight) for t in RewardConfig(mode="rm_only", alpha=0.3).effective_terms()] == [("genrm", 1.0)]
    assert [(t.kind, t.weight) for t in RewardConfig(mode="rule_only").effective_terms()] == [("exact", 1.0)]


@pytest.mark.parametrize("kinds,mode", [
    pytest.param(["math", "format"], "rule_only", id="no-judge"),
    pytest.param(["genrm"], "rm_only", id="judge-only"),
    pytest.param(["math", "genrm"], "rm_with_rule", id="both"),
])
def test_mode_follows_the_terms(kinds, mode):
    terms = [{"name": f"t{i}", "kind": k, **({"pattern": "x"} if k == "format" else {})} for i, k in enumerate(kinds)]
    cfg = RewardConfig.model_validate({"terms": terms})
    assert cfg.mode == mode and [t.kind for t in cfg.effective_terms()] == kinds


@pytest.mark.parametrize("raw,needle", [
    pytest.param({"terms": [{"name": "a", "kind": "exact"}, {"name": "a", "kind": "math"}]}, "repeated: a",
                 id="same-name"),
    pytest.param({"terms": []}, "needs at least one term", id="empty"),
    pytest.param({"terms": [{"name": "j", "kind": "genrm"}, {"name": "k", "kind": "genrm"}]}, "keep one genrm term",
                 id="two-judges"),
    pytest.param({"terms": [{"name": "f", "kind": "format"}]}, "'f' (kind format) needs a pattern", id="no-pattern"),
    pytest.param({"terms": [{"name": "f", "kind": "format", "pattern": "("}]}, "not a valid regex", id="bad-pattern"),
    pytest.param({"terms": [{"name": "e", "kind": "exact", "pattern": "x"}]}, "sets pattern, which only a format term",
                 id="pattern-on-exact"),
    pytest.param({"terms": [{"name": "m", "kind": "math", "batched": True}]}, "sets batched, which only a function",
                 id="batched-on-math"),
    pytest.param({"terms": [{"name": "u", "kind": "function", "function": "pkg.mod.fn"}]},
                 "must name package.module:function", id="function-spec"),
    pytest.param({"terms": [{"name": "u", "kind": "function"}]}, "must name package.module:function",
                 id="function-missing"),
    pytest.param({"terms": [{"name": "a", "kind": "exact", "wieght": 2}]}, "unknown key 'wieght'; valid keys: name, "
                 "kind, weight, pattern, function, batched", id="unknown-key"),
    pytest.param({"terms": [{"name": "a", "kind": "exact"}], "alpha": 0.7}, "reward.alpha=0.7 is a weight of the "
                 "reward.mode shorthand", id="alpha-with-terms"),
    pytest.param({"terms": [{"name": "a", "kind": "genrm"}], "beta": 0}, "reward.beta=0 is a weight", id="beta"),
    pytest.param({"terms": [{"name": "a", "kind": "exact"}], "mode": "rm_with_rule"}, "reward.mode=rm_with_rule "
                 "disagrees with reward.terms, which make it rule_only", id="mode-disagrees"),
    pytest.param({"terms": [{"name": "a b", "kind": "exact"}]}, "name", id="bad-name"),
    pytest.param({"mode": "rule_only", "judge_batch_size": 8}, "reward.judge_batch_size is set but no judge runs",
                 id="judge-field-without-judge"),
    pytest.param({"terms": [{"name": "a", "kind": "exact"}], "judge_template": "{response}"},
                 "reward.judge_template is set but no judge runs", id="judge-field-without-genrm-term"),
    pytest.param({"judge_pattern": "(yes|no)"}, "reward.judge_pattern is the regex of reward.judge_parser=regex",
                 id="pattern-without-regex"),
    pytest.param({"judge_parser": "regex"}, "set both", id="regex-without-pattern"),
    pytest.param({"judge_parser": "regex", "judge_pattern": "(yes)|(no)"}, "has 2 groups; it needs exactly one",
                 id="two-groups"),
    pytest.param({"judge_parser": "regex", "judge_pattern": "(yes"}, "is not a valid regex", id="bad-regex"),
    pytest.param({"judge_parser": "boxed_score", "judge_score_min": 10, "judge_score_max": 1},
                 "reward.judge_score_min=10 must be below reward.judge_score_max=1", id="scale-upside-down"),
    pytest.param({"judge_score_max": 5}, "reward.judge_score_max is set but reward.judge_parser=yes_no reads no scale",
                 id="scale-without-a-numeric-parser"),
    pytest.param({"judge_template": "Is {answer} the {response}?"}, "uses {answer}, which is no placeholder",
                 id="answer-placeholder"),
])
def test_refused_reward_terms_name_the_field_and_the_fix(raw, needle):
    with pytest.raises(ConfigError) as err:
        validate({"reward": raw})
    assert needle in str(err.value), str(err.value)


def test_terms_load_from_a_set_override_with_the_mode_shorthand_file():
    terms = "reward.terms=[{name: acc, kind: math}, {name: fmt, kind: format, pattern: '\\d$', weight: 0.1}]"
    cfg = load_config(REPO / "configs/demo_cpu.yaml", ["reward.mode=rule_only", terms])
    assert [(t.name, t.weight) for t in cfg.reward.effective_terms()] == [("acc", 1.0), ("fmt", 0.1)]
    assert cfg.reward.mode == "rule_only" and cfg.reward.terms[1].pattern == "\\d$"


def test_a_resolved_config_with_terms_loads_back_the_same():
    from yatt_hpc.config.load import to_yaml

    terms = ("reward.terms=[{name: acc, kind: math}, {name: u, kind: function, function: 'a.b:c', batched: true}, "
             "{name: j, kind: genrm, weight: 0.5}]")
    cfg = load_config(REPO / "configs/demo_cpu.yaml", [terms, "reward.judge_parser=regex",
                                                       "reward.judge_pattern='verdict: (yes|no)'"])
    assert validate(yaml.safe_load(to_yaml(cfg))) == cfg  # what every rank reads from RUN_DIR/config.yaml
