"""`agent.turn_schedule`: under `as_ready` a trajectory waiting on a slow tool holds back only itself, while under
`lockstep` the chunk's next turn waits for it; both make the same trajectories where batch composition does not
change what the engine samples.

    .venv/bin/python -m pytest tests/unit/test_turn_schedule.py -q

The slow tool (`tests.programs.agent_tools:gate`) returns "opened" only if the engine is asked for a fast
trajectory's last turn while the slow call still waits: an event, not a clock, tells the schedules apart.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.programs import agent_tools
from tests.programs.scripted_engine import ScriptedEngine
from yatt_hpc.agent.loop import AgentLoop
from yatt_hpc.agent.tools import build_toolbox
from yatt_hpc.config.agent import AgentConfig, ToolSpec
from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.demo.lookup import CALL_PATTERN, lookup_row
from yatt_hpc.rollout.engine import GenerationRequest

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "models" / "demo_tools" / "policy"
TOOLS = ("tests.programs.agent_tools:gate", "tests.programs.agent_tools:add", "tests.programs.agent_tools:slow")


def call(name: str, **args) -> str:
    inner = ",".join(f'"{k}":{v}' for k, v in args.items())
    return f'<call>{{"name":"{name}","arguments":{{{inner}}}}}</call>'


class LoggingEngine(ScriptedEngine):
    """The scripted engine, keeping each call's (sample id, turn) pairs; opens `agent_tools.GATE` when it is asked
    for the pair `opens`."""

    def __init__(self, tokenizer, scripts, opens=None) -> None:
        super().__init__(tokenizer, scripts)
        self.calls: list[list[tuple[int, int]]] = []
        self.opens = opens

    def generate(self, requests, on_result=None, on_step=None):
        self.calls.append([(r.sample_id, self.turn.get(r.sample_id, 0)) for r in requests])
        if self.opens in self.calls[-1]:
            agent_tools.GATE.set()
        return super().generate(requests)


def _loop(tok, schedule: str, timeout: float = 30.0, budget: int = 400) -> AgentLoop:
    cfg = AgentConfig(tools=[ToolSpec(function=f) for f in TOOLS], tool_call_pattern=CALL_PATTERN, max_turns=3,
                      max_response_tokens=budget, tool_timeout_s=timeout, turn_schedule=schedule)
    return AgentLoop(cfg, tok, max_new_tokens=64, engine_seed=0, toolbox=build_toolbox(cfg))


def _requests(tok, count: int, n: int = 1, seed: int = 5) -> list[GenerationRequest]:
    rows = [lookup_row(seed, i) for i in range(count)]
    return [GenerationRequest(sample_id=i * n + k, prompt_ids=tok.encode(r["prompt"]), max_new_tokens=64)
            for i, r in enumerate(rows) for k in range(n)]


def _tool_text(tok, out) -> str:
    return tok.tok.decode(out.result.response_ids[out.mask == 0].tolist())


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(POLICY)


def _gate_scripts(wait_s: float) -> dict[int, list[str]]:
    """Sample 0 calls the slow gate once and answers; samples 1 and 2 call the fast `add` twice, then answer."""
    fast = [call("add", a=1, b=2), call("add", a=3), "abc"]
    return {0: [call("gate", wait_s=wait_s), "abc"], 1: fast, 2: fast}


def test_as_ready_fast_trajectories_take_their_later_turns_while_a_slow_tool_waits(tok):
    agent_tools.GATE.clear()
    engine = LoggingEngine(tok, _gate_scripts(wait_s=30), opens=(1, 2))  # fast sample 1's last turn opens it
    loop = _loop(tok, "as_ready")
    outs = loop.run(engine, _requests(tok, 3))
    assert "opened" in _tool_text(tok, outs[0]), "the slow call returned before the fast trajectories went on"
    assert [o.turns for o in outs] == [2, 3, 3] and all(o.result.finish_reason == "stop" for o in outs)
    at = {pair: i for i, pairs in enumerate(engine.calls) for pair in pairs}
    assert engine.calls[0] == [(0, 0), (1, 0), (2, 0)]
    # fast sample 1 took its second and third turns while the slow call waited (the gate opened at its third),
    # so before the slow trajectory's second turn; sample 2 may share that turn's call (its results came back
    # meanwhile)
    assert at[(1, 1)] < at[(1, 2)] < at[(0, 1)] and at[(2, 1)] < at[(2, 2)]
    stats = loop.take_stats()
    assert stats["agent_engine_calls"] == len(engine.calls) >= 4
    assert stats["agent_tool_turns"] == 5 and stats["agent_tool_wait_s"] > 0.0


def test_lockstep_holds_the_chunks_next_turn_until_the_slow_tool_is_back(tok):
    agent_tools.GATE.clear()
    engine = LoggingEngine(tok, _gate_scripts(wait_s=0.3), opens=(1, 2))
    loop = _loop(tok, "lockstep")
    outs = loop.run(engine, _requests(tok, 3))
    assert "closed" in _tool_text(tok, outs[0]), "lockstep called the engine while a tool was still running"
    assert engine.calls == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)], [(1, 2), (2, 2)]]
    stats = loop.take_stats()
    assert stats["agent_engine_calls"] == 3 and stats["agent_engine_idle_s"] >= 0.25  # the gate waited 0.3 s


def test_with_a_batch_independent_engine_both_schedules_make_the_same_trajectories(tok):
    scripts = {0: [call("slow", seconds=0.2), "abc"], 1: [call("add", a=1, b=2), call("add", a=3), "abc"],
               2: [call("nope"), "bd"], 3: ['<call>{"name":"add","arguments":{a:1}}</call>', "c"], 4: ["dd"]}
    lock, ready = (_loop(tok, s, timeout=5).run(ScriptedEngine(tok, scripts), _requests(tok, 5))
                   for s in ("lockstep", "as_ready"))
    for a, b in zip(lock, ready):
        assert a.result.response_ids.tolist() == b.result.response_ids.tolist() and a.turns == b.turns
        assert a.mask.tolist() == b.mask.tolist() and a.result.logprobs.tolist() == b.result.logprobs.tolist()
        assert a.result.finish_reason == b.result.finish_reason


def test_the_hf_engine_samples_the_same_tokens_either_way_with_log_probs_within_float_noise(tok, monkeypatch):
    """Each turn samples with its own seed (`turn_seed`), so only the batch's composition differs: log-probs move
    at float-noise level, and on this policy no sampled token changes."""
    from yatt_hpc.rollout.hf_engine import HFEngine

    monkeypatch.setenv("YATT_TOOL_LAG_S", "0.3")
    requests = _requests(tok, 6, n=4)
    runs = {}
    for schedule in ("lockstep", "as_ready"):
        cfg = AgentConfig(tools=[ToolSpec(function="tests.programs.agent_tools:look_lagging", name="look")],
                          tool_call_pattern=CALL_PATTERN, max_turns=3, max_response_tokens=140, turn_schedule=schedule)
        loop = AgentLoop(cfg, tok, max_new_tokens=64, engine_seed=3, toolbox=build_toolbox(cfg))
        runs[schedule] = (loop.run(HFEngine(str(POLICY), seed=3), requests), loop.take_stats())
    (lock, lock_stats), (ready, ready_stats) = runs["lockstep"], runs["as_ready"]
    assert any(not o.mask.all() for o in lock), "the demo policy calls the tool in some trajectories"
    for a, b in zip(lock, ready):
        assert a.result.response_ids.tolist() == b.result.response_ids.tolist() and a.mask.tolist() == b.mask.tolist()
        np.testing.assert_allclose(a.result.logprobs, b.result.logprobs, atol=1e-5)
    assert ready_stats["agent_engine_calls"] > lock_stats["agent_engine_calls"]


def test_as_ready_without_a_tool_is_refused_naming_the_field_and_the_fix():
    with pytest.raises(ValueError, match=r"agent.turn_schedule='as_ready'.*add a tool or use 'lockstep'"):
        AgentConfig(environment="tests.programs.agent_tools:CountEnv", turn_schedule="as_ready")
