"""The `code` reward term: the program out of an answer, a row's tests, the harness, scores by hand in the real sandbox.

    .venv/bin/python -m pytest tests/unit/test_code_reward.py -q

The runs over mpirun (on the tools group, and without one) are tests/mpi/test_code_reward_run.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from yatt_hpc.agent.code_runs import CodeReward, CodeRunPool, final_turn
from yatt_hpc.agent.code_tests import (
    CodeTests,
    CodeTestsError,
    code_score,
    extract_program,
    harness_source,
    parse_tests,
    pass_mark,
    run_passed,
)
from yatt_hpc.agent.rollout_side import extra_columns
from yatt_hpc.agent.sandbox import SandboxError
from yatt_hpc.agent.tools_group import decode_runs, encode_runs
from yatt_hpc.batch import SampleBatch, batch_columns, batch_from_columns
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.agent import AgentConfig, SandboxConfig
from yatt_hpc.config.reward import RewardTerm
from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.reward.terms import RewardTerms, ScoringRows
from yatt_hpc.rollout.engine import GenerationResult

REPO = Path(__file__).resolve().parents[2]
ADD_ASSERTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
DOUBLE = {"inputs": ["3\n", "5\n"], "outputs": ["6\n", "10\n"]}


def block(program: str, before: str = "Here it is:\n") -> str:
    return f"{before}```python\n{program}\n```\n"


# ------------------------------------------------------------------ pure parts


@pytest.mark.parametrize("text, program", [
    pytest.param(block("print(1)"), "print(1)\n", id="one-block"),
    pytest.param(block("print(1)") + "then\n" + block("print(2)"), "print(2)\n", id="the-last-block"),
    pytest.param("```py\nx = 1\n```", "x = 1\n", id="py-fence"),
    pytest.param("```\nprint(1)\n```", None, id="unlabelled-fence-is-not-python"),
    pytest.param("```python\n   \n```", None, id="empty-block"),
    pytest.param("print(1)", None, id="no-block"),
    pytest.param("```python\nprint(1)", None, id="unclosed-block"),
])
def test_the_program_is_the_last_python_block_of_the_answer(text, program):
    assert extract_program(text) == program


@pytest.mark.parametrize("raw, tests", [
    pytest.param(["assert f(1) == 1"], CodeTests("assert", asserts=("assert f(1) == 1",)), id="asserts"),
    pytest.param(json.dumps(["assert f(1) == 1"]), CodeTests("assert", asserts=("assert f(1) == 1",)), id="json-text"),
    pytest.param(DOUBLE, CodeTests("stdio", inputs=("3\n", "5\n"), outputs=("6\n", "10\n")), id="inputs-outputs"),
    pytest.param([{"input": "3\n", "output": "6\n", "testtype": "stdin"}],
                 CodeTests("stdio", inputs=("3\n",), outputs=("6\n",)), id="input-output-cases"),
])
def test_the_three_test_formats_parse(raw, tests):
    assert parse_tests(raw) == tests


@pytest.mark.parametrize("raw, needle", [
    pytest.param(None, "the row has no `tests` column; give the row a `tests` column", id="missing"),
    pytest.param("[assert", "is not JSON (Expecting value at character 1)", id="not-json"),
    pytest.param([], "holds no test", id="empty"),
    pytest.param(42, "is a int; give the row", id="a-number"),
    pytest.param({"inputs": ["1"], "outputs": []}, "has 1 inputs and 0 outputs; give one output per input", id="uneven"),
    pytest.param({"inputs": ["1"], "outputs": ["2"], "fn_name": "f"}, "call-based tests are not run; write them as "
                 "assert", id="fn-name"),
    pytest.param({"input": ["1"]}, "an object without inputs and outputs", id="wrong-keys"),
    pytest.param([{"input": "1"}], "each case needs string `input` and `output`", id="case-without-output"),
    pytest.param(["assert f()", 3], "asserts must be a list of strings", id="not-strings"),
])
def test_malformed_tests_are_refused_naming_the_value_and_the_fix(raw, needle):
    with pytest.raises(CodeTestsError) as err:
        parse_tests(raw)
    assert needle in str(err.value), str(err.value)


def test_the_score_is_the_fraction_passed_or_all_or_nothing():
    assert code_score([True, False, True, True]) == 0.75
    assert code_score([True, False, True, True], all_or_nothing=True) == 0.0
    assert code_score([True, True], all_or_nothing=True) == 1.0 and code_score([]) == 0.0


def test_an_assert_passes_only_with_the_harness_mark_as_last_line():
    tests = parse_tests(["assert f() == 1"])
    mark = pass_mark("p", "assert f() == 1", 7)
    assert mark != pass_mark("p", "assert f() == 1", 8) and mark != pass_mark("q", "assert f() == 1", 7)
    assert run_passed("ok", f"noise\n\n{mark}\n", "p", tests, 0, 7)
    assert not run_passed("ok", "ok\n", "p", tests, 0, 7)
    assert not run_passed("error", f"{mark}\n", "p", tests, 0, 7)
    stdio = parse_tests(DOUBLE)
    assert run_passed("ok", "6  \n\n\n", "p", stdio, 0, 7) and not run_passed("ok", "7\n", "p", stdio, 0, 7)
    assert mark in harness_source("p", tests, 0, 7) and "'3\\n'" in harness_source("p", stdio, 0, 7)


def test_the_final_turn_is_after_the_last_unsampled_token():
    tokens = np.arange(6, dtype=np.int32)
    assert final_turn(tokens, None).tolist() == list(range(6))
    assert final_turn(tokens, np.array([1, 1, 0, 0, 1, 1], np.uint8)).tolist() == [4, 5]


# ------------------------------------------------------------------ scores by hand, in the real sandbox


@pytest.fixture(scope="module")
def pool():
    try:
        p = CodeRunPool(AgentConfig(sandbox=SandboxConfig(timeout_s=1, cpu_s=1)))
    except SandboxError as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    yield p
    p.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(REPO / "models/demo/policy"))  # the demo's character tokenizer: any ASCII answer


def score(pool, tokenizer, answers, tests, all_or_nothing=False, finish="stop"):
    reward = CodeReward(pool, tokenizer, all_or_nothing=all_or_nothing, secret=0, remote=False)
    rows = [{"prompt": "p", "prompt_id": i, "metadata": {"tests": t} if t is not None else {}}
            for i, t in enumerate(tests)]
    results = [GenerationResult(i, np.zeros(1, np.int32), np.asarray(tokenizer.encode(a), np.int32),
                                np.zeros(len(tokenizer.encode(a)), np.float32), finish, 0) for i, a in enumerate(answers)]
    return reward.score(rows, results, [None] * len(answers)), reward.take_stats()


ADD = "def add(a, b):\n    return a + b"


@pytest.mark.parametrize("program, expected", [
    pytest.param(ADD, 1.0, id="right"),
    pytest.param("def add(a, b):\n    return a * b if a == 2 else a + b", 1.0, id="right-by-accident"),
    pytest.param("def add(a, b):\n    return abs(a) + b", 0.75, id="three-of-four"),
    pytest.param("def add(a, b):\n    return -1", 0.0, id="wrong"),
    pytest.param("import os\nos._exit(0)", 0.0, id="exit-0-before-the-asserts"),
    pytest.param("def add(a, b):\n    return -1\nprint('ok')\nraise SystemExit(0)", 0.0, id="prints-ok-then-exits"),
    pytest.param("if __name__ == '__main__':\n    input()\ndef add(a, b):\n    return a + b", 1.0,
                 id="main-guard-does-not-run"),
])
def test_assert_tests_score_the_fraction_that_hold(pool, tokenizer, program, expected):
    scores, stats = score(pool, tokenizer, [block(program)], [ADD_ASSERTS])
    assert scores == [expected] and stats["code_tests"] == 4 and stats["code_tests_passed"] == 4 * expected


def test_stdin_tests_compare_the_output(pool, tokenizer):
    answers = [block("print(int(input()) * 2)"), block("import sys\nprint(2 * int(sys.stdin.read()))\nsys.exit(0)"),
               block("x = int(input())\nprint(6 if x == 3 else 0)"), block("print(int(input()) * 2, 'x')")]
    scores, stats = score(pool, tokenizer, answers, [DOUBLE] * 4)
    assert scores == [1.0, 1.0, 0.5, 0.0]
    assert stats["code_all_passed"] == 2 and stats["code_run_errors"] == 0


def test_a_crash_an_endless_loop_and_no_program_score_zero_and_are_counted(pool, tokenizer):
    answers = [block("1 / 0"), block("while True:\n    pass"), "no code here", block("print(int(input()) * 2)")]
    scores, stats = score(pool, tokenizer, answers, [DOUBLE, DOUBLE, DOUBLE, '{"inputs": ["1"]'])
    assert scores == [0.0, 0.0, 0.0, 0.0]
    assert stats["code_run_errors"] == 2 and stats["code_timeouts"] == 2, stats
    assert stats["code_parse_failures"] == 1 and stats["code_bad_tests"] == 1 and stats["code_samples"] == 4
    assert stats["code_runs_local"] == 4 and stats["code_run_seconds"] >= 2.0  # the loop ran its 1 s twice


def test_all_or_nothing_and_an_aborted_response(pool, tokenizer):
    three_of_four = block("def add(a, b):\n    return abs(a) + b")
    assert score(pool, tokenizer, [three_of_four], [ADD_ASSERTS], all_or_nothing=True)[0] == [0.0]
    scores, stats = score(pool, tokenizer, [block(ADD)], [ADD_ASSERTS], finish="abort")
    assert scores == [0.0] and not stats.get("code_samples") and not stats.get("code_tests")


def test_a_missing_tests_column_scores_zero_and_logs_the_fix(pool, tokenizer, caplog):
    scores, stats = score(pool, tokenizer, [block(ADD)], [None])
    assert scores == [0.0] and stats["code_bad_tests"] == 1
    assert "prompt_id 0" in caplog.text and "give the row a `tests` column" in caplog.text


def test_scores_are_the_same_on_every_run(pool, tokenizer):
    answers = [block(ADD), block("def add(a, b):\n    return abs(a) + b"), block("1/0")]
    assert score(pool, tokenizer, answers, [ADD_ASSERTS] * 3)[0] == score(pool, tokenizer, answers, [ADD_ASSERTS] * 3)[0]


# ------------------------------------------------------------------ the column, the wire, the term, the config


def test_runs_cross_the_wire_unchanged():
    from yatt_hpc.agent.sandbox import SandboxRun

    runs = [SandboxRun("6\n", "ok", 0, 0.25), SandboxRun("timeout: ...", "timeout", 124, 1.5)]
    assert decode_runs(encode_runs(runs)) == runs


def test_the_code_reward_column_travels_in_batches_and_checkpoints():
    batch = SampleBatch(sample_id=np.arange(3), prompt_id=np.arange(3), owner=np.zeros(3, np.int32))
    filled = batch.select(np.arange(3), **extra_columns({"code_reward": {0: 1.0, 1: 0.25, 2: 0.0}}, batch.sample_id))
    assert filled.wire() is not None and filled.code_reward.tolist() == [1.0, 0.25, 0.0]
    assert SampleBatch.concat([filled, filled]).code_reward.tolist() == [1.0, 0.25, 0.0] * 2
    assert batch_from_columns(batch_columns(filled)).code_reward.tolist() == [1.0, 0.25, 0.0]
    old = {k: v for k, v in batch_columns(filled).items() if k != "code_reward"}  # a checkpoint from before
    assert batch_from_columns(old).code_reward.tolist() == [0.0] * 3


def test_the_code_term_reads_the_rollout_sides_column_and_is_the_correctness_term():
    terms = RewardTerms([RewardTerm(name="tests", kind="code"), RewardTerm(name="fmt", kind="format", pattern="```",
                                                                           weight=0.1)])
    rows = ScoringRows(["p", "p"], ["```python\nx\n```", "none"], ["", ""], [{}, {}], code_rewards=[0.75, 0.0])
    got = terms.score(rows)
    assert got.values["tests"].tolist() == [0.75, 0.0] and got.rule_score.tolist() == [0.75, 0.0]
    assert got.reward.tolist() == pytest.approx([0.85, 0.0])


CODE = "reward.terms=[{name: tests, kind: code}]"


def cfg(*overrides):
    return load_config(REPO / "configs/demo_cpu.yaml", ["reward.mode=rule_only", *overrides])


def test_a_code_term_allows_a_tools_group_and_sandbox_limits_without_tools():
    c = cfg(CODE, "placement.tools.tasks_per_node=1", "agent.sandbox.timeout_s=2")
    assert c.agent.sandbox.timeout_s == 2 and not c.agent.enabled and c.placement.tools.tasks_per_node == 1


@pytest.mark.parametrize("terms, needed", [
    pytest.param(CODE, False, id="code"),
    pytest.param("reward.terms=[{name: t, kind: code}, {name: f, kind: format, pattern: x}]", False, id="code-format"),
    pytest.param("reward.terms=[{name: t, kind: code}, {name: a, kind: exact}]", True, id="code-exact"),
    pytest.param("reward.mode=rule_only", True, id="shorthand-rule"),
])
def test_rows_need_an_answer_only_where_a_term_reads_it(terms, needed, tmp_path):
    from yatt_hpc.data.prompts import DatasetError, build_prompt_source

    c = cfg(terms)
    assert c.reward.needs_answer is needed
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "x2 3", "tests": DOUBLE}) + "\n")
    data = c.data.model_copy(update={"source": str(rows)})
    tok = load_tokenizer(str(REPO / "models/demo/policy"))
    if needed:  # the first row is read when the source is built
        with pytest.raises(DatasetError, match="row has no 'answer' column"):
            build_prompt_source(data, tok, require_answer=c.reward.needs_answer)
    else:
        row = build_prompt_source(data, tok, require_answer=c.reward.needs_answer).row_at(0)
        assert row["answer"] == "" and row["metadata"] == {"tests": DOUBLE}


@pytest.mark.parametrize("overrides, needle", [
    pytest.param((CODE, "rollout.streaming=finished_groups"), "reward.terms item 'tests' (kind code) with "
                 "rollout.streaming=finished_groups", id="streaming"),
    pytest.param((CODE, "rollout.partial_rollouts=true", "rollout.max_staleness=1", "rollout.over_dispatch_ratio=1.5",
                   "placement.mode=disjoint"), "with rollout.partial_rollouts=true: a paused response's "
                 "program is not finished", id="partial"),
    pytest.param(("reward.terms=[{name: a, kind: code}, {name: b, kind: code}]",), "has 2 code terms (a, b)",
                 id="two-code-terms"),
    pytest.param(("reward.terms=[{name: a, kind: exact, all_or_nothing: true}]",), "sets all_or_nothing, which only "
                 "a code term reads", id="all-or-nothing-elsewhere"),
    pytest.param(("agent.sandbox.timeout_s=2",), "agent.sandbox is set but no agent.tools item is builtin:python and "
                 "no reward.terms item has kind code", id="sandbox-without-code"),
])
def test_refused_code_settings_name_the_field_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as err:
        cfg(*overrides)
    assert needle in str(err.value), str(err.value)


def test_an_agents_program_is_read_from_its_last_model_turn_only(pool):
    """Multi-turn trajectories (a tool call, its result, the answer): the program of the answer counts; one written
    in an earlier turn, before a tool call, does not."""
    from tests.programs.scripted_engine import ScriptedEngine
    from yatt_hpc.agent.loop import AgentLoop
    from yatt_hpc.agent.tools import build_toolbox
    from yatt_hpc.config.agent import ToolSpec
    from yatt_hpc.demo.lookup import CALL_PATTERN, call_text, lookup_row
    from yatt_hpc.rollout.engine import GenerationRequest

    tok = load_tokenizer(str(REPO / "models/demo_tools/policy"))
    cfg = AgentConfig(tools=[ToolSpec(function="yatt_hpc.demo.lookup:look")], tool_call_pattern=CALL_PATTERN,
                      max_turns=3, max_response_tokens=400)
    row = lookup_row(5, 0)
    key, program = row["prompt"].split()[1], "```python\nprint(int(input())*2)\n```"
    engine = ScriptedEngine(tok, {0: [call_text(key), program], 1: [program + call_text(key), "no code"]})
    requests = [GenerationRequest(sample_id=i, prompt_ids=tok.encode(row["prompt"]), max_new_tokens=128) for i in (0, 1)]
    outs = AgentLoop(cfg, tok, max_new_tokens=128, engine_seed=0, toolbox=build_toolbox(cfg)).run(engine, requests)
    assert [o.turns for o in outs] == [2, 2] and all((o.mask == 0).any() for o in outs)
    reward = CodeReward(pool, tok, all_or_nothing=False, secret=0, remote=False)
    rows = [{"prompt": row["prompt"], "prompt_id": i, "metadata": {"tests": DOUBLE}} for i in (0, 1)]
    assert reward.score(rows, [o.result for o in outs], [o.mask for o in outs]) == [1.0, 0.0]
    assert reward.take_stats()["code_parse_failures"] == 1


def test_a_pool_where_no_program_can_run_is_refused_naming_the_setting():
    with pytest.raises(SandboxError, match=r"agent.sandbox.python='/nonexistent/python3' is not an executable"):
        CodeRunPool(AgentConfig(sandbox=SandboxConfig(python="/nonexistent/python3")))
