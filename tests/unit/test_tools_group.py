"""The tools group (`placement.tools`): its plan, its Slurm component, what is refused, and the calls' wire form.

    .venv/bin/python -m pytest tests/unit/test_tools_group.py -q

The runs are tests/mpi/test_tool_calls.py; the Slurm job tests/slurm/test_submit.py.
"""
from pathlib import Path

import pytest

from yatt_hpc.agent.tools import ToolBox, ToolCall, build_tool
from yatt_hpc.agent.tools_group import call_slices, decode_calls, decode_outcomes, encode_calls, encode_outcomes
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.agent import AgentConfig, ToolSpec
from yatt_hpc.launch.commands import local_launch
from yatt_hpc.launch.sbatch import render_sbatch
from yatt_hpc.placement import PlanError, plan

REPO = Path(__file__).resolve().parents[2]
TOOLS = "agent.tools=[{function: 'tests.programs.agent_tools:add'}]"


def cfg(name="demo_tools_cpu.yaml", *overrides):
    return load_config(REPO / "configs" / name, overrides)


def test_without_a_tools_group_the_plan_has_three_groups():
    p = plan(cfg())
    assert [g.name for g in p.groups] == ["trainer", "rollout", "genrm"] and not p.tool_ranks
    assert not p.has_group("tools")


def test_tool_ranks_come_after_genrm_on_cpu_with_their_own_mpirun_ranks():
    p = plan(cfg("demo_tools_cpu.yaml", "placement.tools.tasks_per_node=2"))
    t = p.group("tools")
    assert [g.name for g in p.groups] == ["trainer", "rollout", "genrm", "tools"]
    assert (t.rank_start, t.rank_stop, t.devices_per_task, p.world_size) == (4, 6, 0, 6)
    assert p.tool_ranks == range(4, 6) and p.device_ids(5) == () and p.group_of(5) == "tools"
    assert t.slurm.kind == "shared_allocation" and t.layout == (("dp", 2),)
    assert local_launch(p, "RUN")[-10:] == [":", "-np", "2", "python3", "-m", "yatt_hpc.runtime.worker", "--group",
                                            "tools", "--run-dir", "RUN"]
    # colocation's phases take turns on the cores; tool ranks run no torch and take no part in that count
    assert p.node_cpus == plan(cfg()).node_cpus


def test_disjoint_tools_group_is_a_heterogeneous_component_without_gpus():
    c = cfg("tools_disjoint_cpu.yaml", "placement.tools.nodes=2", "placement.tools.cpus_per_task=4",
            "placement.tools.mem=16G", "placement.trainer.devices_per_task=1", "placement.rollout.devices_per_task=1")
    p = plan(c)
    t = p.group("tools")
    assert (t.slurm.kind, t.slurm.component, t.nodes, t.devices) == ("het_component", 3, 2, 0)
    assert p.total_nodes == 5 and p.total_devices == 3
    script = render_sbatch(c, p, "/runs/x", "/venv/bin/python")
    components = script.split("#SBATCH hetjob")
    assert len(components) == 4
    last = components[-1].split("\n\n")[0]
    assert "--nodes=2" in last and "--cpus-per-task=4" in last and "--mem=16G" in last
    assert "--gpus-per-node" not in last and "--gpus-per-node=2" in components[0]


def test_a_shared_allocation_counts_the_tool_ranks_per_node():
    c = cfg("demo_tools_cpu.yaml", "placement.tools.tasks_per_node=3", "placement.tools.cpus_per_task=2")
    script = render_sbatch(c, plan(c), "/runs/x", "/venv/bin/python")
    assert "--ntasks-per-node=7" in script and "--cpus-per-task=2" in script and "hetjob" not in script


@pytest.mark.parametrize("overrides, needle", [
    pytest.param(("agent.tools=[]", "placement.tools.tasks_per_node=1"),
                 r"placement.tools.tasks_per_node=1 makes a tools group, but agent.tools is empty.*tasks_per_node=0",
                 id="no-tools"),
    pytest.param(("placement.tools.tasks_per_node=1", "placement.mode=partial", "placement.dynamic_split.enabled=true",
                  "eval.sources=[]", "eval.every=10", "eval.samples_per_prompt=1", "eval.max_prompts=null"),
                 r"placement.tools.tasks_per_node=1 with placement.dynamic_split.enabled.*dynamic_split.enabled=false",
                 id="dynamic-split"),
])
def test_a_tools_group_that_cannot_run_is_refused_naming_the_field_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        cfg("demo_tools_cpu.yaml", *overrides)


def test_a_shared_placement_refuses_a_tools_group_on_other_nodes():
    with pytest.raises(PlanError, match=r"placement.tools.nodes=2 and placement.trainer.nodes=1; set placement.tools.nodes=1"):
        plan(cfg("demo_tools_cpu.yaml", "placement.tools.tasks_per_node=1", "placement.tools.nodes=2"))
    assert plan(cfg("tools_disjoint_cpu.yaml", "placement.tools.nodes=2")).group("tools").nodes == 2  # disjoint: its own


def test_calls_are_cut_into_contiguous_slices_one_per_tool_rank():
    assert call_slices(5, 2, 0) == [(0, 0, 3), (1, 3, 5)]
    assert call_slices(5, 2, 1) == [(1, 0, 3), (0, 3, 5)]
    assert call_slices(1, 3, 2) == [(2, 0, 1)]
    assert call_slices(0, 2, 0) == []
    assert [b - a for _, a, b in call_slices(10, 4, 7)] == [3, 3, 2, 2]


def test_calls_and_outcomes_cross_the_wire_unchanged():
    """What a tool rank answers decodes to exactly what the rollout rank's own pool gives: text, status, order."""
    calls = [ToolCall("add", {"a": 2, "b": 3}), "the tool call is not valid JSON", ToolCall("nope", {}),
             ToolCall("add", {"a": "x\udcff", "z": [1.5e300, None]}), ToolCall("add", {"a": 1, "b": -1})]
    assert decode_calls(encode_calls(calls)) == calls
    spec = ToolSpec(function="tests.programs.agent_tools:add")
    box = ToolBox([build_tool(spec, AgentConfig(tools=[spec]))], workers=2, timeout_s=5.0)
    try:
        here = box.run(calls)
        there = decode_outcomes(encode_outcomes(box.run(decode_calls(encode_calls(calls)))))
    finally:
        box.close()
    assert [(o.name, o.content, o.status) for o in here] == [(o.name, o.content, o.status) for o in there]
    assert [o.status for o in there] == ["ok", "error", "error", "error", "ok"] and there[0].content == "5"


def test_over_dispatch_with_a_tools_group_needs_an_mpi_of_thread_multiple(monkeypatch):
    from mpi4py import MPI

    from yatt_hpc.agent.tools_group import check_tool_threads
    from yatt_hpc.errors import InputError

    c = cfg("demo_tools_cpu.yaml", "placement.tools.tasks_per_node=1", "placement.mode=partial",
            "rollout.over_dispatch_ratio=1.5")
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with pytest.raises(InputError, match=r"rollout.over_dispatch_ratio=1.5 with a tools group.*THREAD_MULTIPLE"):
        check_tool_threads(c)
    check_tool_threads(cfg("demo_tools_cpu.yaml", "placement.tools.tasks_per_node=1"))  # no helper thread: fine


def test_the_sandboxed_python_tools_outcomes_cross_the_wire_unchanged():
    from yatt_hpc.agent.sandbox import SandboxError

    spec = ToolSpec(function="builtin:python")
    try:
        box = ToolBox([build_tool(spec, AgentConfig(tools=[spec]))], workers=2, timeout_s=10.0)
    except SandboxError as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    calls = [ToolCall("python", {"code": "print(6 * 7)"}), ToolCall("python", {"code": "raise SystemExit(3)"}),
             ToolCall("python", {"code": "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)"})]
    try:
        here = box.run(calls)
        there = decode_outcomes(encode_outcomes(box.run(decode_calls(encode_calls(calls)))))
    finally:
        box.close()
    assert [(o.content, o.status) for o in here] == [(o.content, o.status) for o in there]
    assert [o.status for o in there] == ["ok", "error", "error"] and there[0].content == "42\n"


def test_a_request_and_its_answer_carry_the_request_number():
    from yatt_hpc.agent.tools_group import pack, unpack

    data = encode_calls([ToolCall("add", {"a": 1})])
    assert unpack(pack(7, data)) == (7, data) and unpack(pack(2**40, b"")) == (2**40, b"")


def test_started_calls_come_back_as_each_request_finishes_not_all_together():
    """What a tool rank does with the requests in flight: each request's calls start at once, and a request
    of fast calls is complete while another's slow call still runs."""
    from tests.programs import agent_tools

    specs = [ToolSpec(function="tests.programs.agent_tools:add"), ToolSpec(function="tests.programs.agent_tools:gate")]
    box = ToolBox([build_tool(s, AgentConfig(tools=specs)) for s in specs], workers=2, timeout_s=30.0)
    agent_tools.GATE.clear()
    try:
        slow = box.start([ToolCall("gate", {"wait_s": 30})])
        fast = box.start([ToolCall("add", {"a": 2, "b": 3}), "a malformed call"])
        while (got := fast.poll()) is None:
            box.wait_any([fast])
        assert [(o.content, o.status) for o in got] == [("5", "ok"), ("error: a malformed call", "error")]
        assert slow.poll() is None, "the slow call is still waiting on the gate"
        agent_tools.GATE.set()
        while (late := slow.poll()) is None:
            box.wait_any([slow])
        assert [(o.content, o.status) for o in late] == [("opened", "ok")]
    finally:
        box.close()
