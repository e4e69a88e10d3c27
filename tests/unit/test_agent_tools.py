"""Tools from the config: schemas from signatures and docstrings, calls parsed from model text, failures as text.

    .venv/bin/python -m pytest tests/unit/test_agent_tools.py -q
"""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from yatt_hpc.agent.calls import parse_tool_calls
from yatt_hpc.agent.tools import ToolBox, ToolCall, ToolConfigError, build_tool, tool_schemas
from yatt_hpc.config.agent import QWEN_TOOL_CALL, AgentConfig, ToolSpec
from yatt_hpc.config.schema import RunConfig


def _box(timeout_s=2.0, max_output_chars=2000, **names):
    cfg = AgentConfig(tools=[ToolSpec(function=f"tests.programs.agent_tools:{n}") for n in ("add", "fail", "slow")])
    return ToolBox([build_tool(s, cfg) for s in cfg.tools], workers=2, timeout_s=timeout_s,
                   max_output_chars=max_output_chars)


def test_the_schema_comes_from_the_signature_and_docstring():
    cfg = AgentConfig(tools=[ToolSpec(function="tests.programs.agent_tools:add")])
    (schema,) = tool_schemas(cfg)
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first"},
                                                        "b": {"type": "integer", "description": "the second"}},
                       "required": ["a"]}}}


def test_a_given_schema_and_name_override_the_functions():
    params = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    cfg = AgentConfig(tools=[ToolSpec(function="tests.programs.agent_tools:add", name="plus", description="sum",
                                      parameters=params)])
    assert tool_schemas(cfg)[0]["function"] == {"name": "plus", "description": "sum", "parameters": params}


def test_qwen_calls_are_parsed_and_malformed_ones_become_error_texts():
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>'
            '<tool_call>{"tool": "add"}</tool_call><tool_call>{"name": "add", "arguments": [1]}</tool_call>')
    calls = parse_tool_calls(text, QWEN_TOOL_CALL)
    assert calls[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 5})]
    assert "not valid JSON" in calls[2] and "must be a JSON object" in calls[3] and "arguments" in calls[4]
    assert parse_tool_calls("no call here", QWEN_TOOL_CALL) == []


def test_every_failure_is_an_error_text_for_the_model_and_the_box_goes_on():
    box = _box(timeout_s=0.5)
    out = box.run([ToolCall("add", {"a": 2, "b": 3}), ToolCall("nope", {}), ToolCall("fail", {"x": "y"}),
                   ToolCall("add", {"c": 1}), "the tool call is not valid JSON", ToolCall("slow", {"seconds": 3})])
    assert [o.status for o in out] == ["ok", "error", "error", "error", "error", "timeout"]
    assert out[0].content == "5"
    assert "unknown tool 'nope'" in out[1].content and "add, fail, slow" in out[1].content
    assert "RuntimeError: broken tool on y" in out[2].content
    assert "bad arguments for add" in out[3].content
    assert "timed out after 0.5 s" in out[5].content
    assert box.run([ToolCall("add", {"a": 1})])[0].content == "1", "a stuck call does not hold the pool"
    box.close()


def test_long_results_are_cut():
    box = _box(max_output_chars=16)
    out = box.run([ToolCall("add", {"a": 10**40})])[0]
    assert out.content.startswith("1" + "0" * 15) and "cut at 16 characters" in out.content


@pytest.mark.parametrize("section, needle", [
    pytest.param({"tools": [{"function": "nodots"}]}, "must name package.module:function", id="bad-spec"),
    pytest.param({"tools": [{"function": "a.b:add"}, {"function": "c.d:add"}]}, "occur twice", id="duplicate-names"),
    pytest.param({"environment_args": {"x": 1}}, "without agent.environment", id="env-args-alone"),
    pytest.param({"tools": [{"function": "a.b:f"}], "tool_call_pattern": "<c>.*</c>"}, "has no group", id="no-group"),
    pytest.param({"tools": [{"function": "a.b:f"}], "sandbox": {"timeout_s": 3}}, "no agent.tools item is builtin",
                 id="sandbox-without-python"),
    pytest.param({"tools": [{"function": "a.b:f"}], "max_response_tokens": 8}, "below rollout.max_new_tokens",
                 id="budget-below-a-turn"),
    pytest.param({"tools": [{"function": "a.b:f"}], "max_response_tokens": 4096, "x": 1}, "x", id="unknown-key"),
])
def test_refused_agent_settings_name_the_field_and_the_fix(section, needle):
    with pytest.raises(ValidationError, match=needle):
        RunConfig(agent=section, rollout={"max_new_tokens": 16})


def test_agent_tools_refuse_streaming_finished_groups_and_an_environment_term_needs_an_environment():
    with pytest.raises(ValidationError, match="use rollout.streaming=chunks"):
        RunConfig(agent={"tools": [{"function": "a.b:f"}]}, rollout={"streaming": "finished_groups"})
    with pytest.raises(ValidationError, match="agent.environment is not set"):
        RunConfig(reward={"terms": [{"name": "env", "kind": "environment"}]})


def test_agent_tools_take_a_critic():
    cfg = RunConfig(agent={"tools": [{"function": "a.b:f"}]}, train={"adv_estimator": "gae"})
    assert cfg.train.adv_estimator == "gae" and cfg.agent.tools


def test_a_tool_that_cannot_be_imported_is_a_clear_error():
    cfg = AgentConfig(tools=[ToolSpec(function="no_such_module_xyz:f")])
    with pytest.raises(ToolConfigError, match="cannot be imported.*on PYTHONPATH"):
        tool_schemas(cfg)


def test_a_budget_past_the_policys_positions_is_refused_before_launch():
    from tests.conftest import REPO
    from yatt_hpc.config import load_config
    from yatt_hpc.errors import InputError
    from yatt_hpc.runtime.inputs import check_model_dirs

    cfg = load_config(str(REPO / "configs/demo_tools_cpu.yaml"),
                      overrides=["agent.max_response_tokens=200", f"model.path={REPO}/models/demo_tools/policy"])
    with pytest.raises(InputError, match=r"16 \+ agent.max_response_tokens=200 = 216 exceeds the policy's 160 positions"):
        check_model_dirs(cfg)


def test_the_environment_term_is_the_trajectories_summed_environment_reward_and_verifiers_read_the_answer():
    import numpy as np

    from yatt_hpc.batch import SampleBatch
    from yatt_hpc.config.reward import RewardTerm
    from yatt_hpc.reward.terms import RewardTerms, ScoringRows

    terms = RewardTerms([RewardTerm(name="env", kind="environment", weight=0.5),
                         RewardTerm(name="exact", kind="exact")])
    got = terms.score(ScoringRows(prompts=["p", "q"], responses=["abc", "x"], answers=["abc", "abc"],
                                  metadata=[{}, {}], env_rewards=[1.0, -0.5]))
    assert got.values["env"].tolist() == [1.0, -0.5] and got.reward.tolist() == [1.5, -0.25]
    # the verifier reads a trajectory's last model turn: after the tool turn (mask 0), not the call before it
    batch = SampleBatch(sample_id=np.arange(2), prompt_id=np.arange(2), owner=np.zeros(2, np.int32),
                        response_len=np.array([6, 2], np.int32),
                        response_tokens=np.array([1, 2, 9, 9, 3, 4, 5, 6], np.int32),
                        response_mask=np.array([1, 1, 0, 0, 1, 1, 1, 1], np.uint8))
    assert [t.tolist() for t in batch.final_turns()] == [[3, 4], [5, 6]]


def test_a_tools_group_is_not_a_setting():
    with pytest.raises(ValidationError, match="tools"):
        RunConfig(placement={"tools": {"nodes": 1, "tasks_per_node": 1}})


def test_a_calls_limit_runs_from_its_start_not_from_its_wait_for_a_worker():
    cfg = AgentConfig(tools=[ToolSpec(function="tests.programs.agent_tools:slow"),
                             ToolSpec(function="tests.programs.agent_tools:typo")])
    box = ToolBox([build_tool(s, cfg) for s in cfg.tools], workers=1, timeout_s=0.6)
    out = box.run([ToolCall("slow", {"seconds": 0.3})] * 3 + [ToolCall("typo", {"x": "a"}), ToolCall("typo", {"y": 1})])
    assert [o.status for o in out] == ["ok"] * 3 + ["error", "error"], out
    assert "raised TypeError" in out[3].content and "bad arguments for typo" in out[4].content
    box.close()
