"""The `agent:` section: multi-turn rollouts with tools and an environment (docs/agentic.md).

    agent:
      tools:
        - {function: mypkg.tools:lookup}          # a Python function; its JSON schema from signature + docstring
        - {function: builtin:python}              # the sandboxed Python interpreter (agent.sandbox)
      max_turns: 4
      max_response_tokens: 256

Part of the typed configuration (`yatt_hpc.config.schema.RunConfig.agent`); `yatt_hpc/agent/` reads it on the
rollout ranks. Without tools or an environment the section is off and a rollout is one model turn.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from yatt_hpc.config.section import Section

QWEN_TOOL_CALL = r"<tool_call>\s*(\{.*?\})\s*</tool_call>"
"""Qwen2.5 / Qwen3 chat templates' tool-call format: a JSON object {"name", "arguments"} between the tags."""
SPEC = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")
BUILTIN_PYTHON = "builtin:python"


class ToolSpec(Section):
    """One tool the policy may call (an item of `agent.tools`)."""

    function: str
    """`package.module:function` (imported on the rollout ranks, and on the trainer ranks to render the prompt's
    tool list, only because this names it), or `builtin:python` (the sandboxed interpreter, `agent.sandbox`)."""
    name: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")
    """The name the model calls it by; null: the function's name (`python` for the sandbox)."""
    description: str | None = None
    """What the model reads about the tool; null: the first paragraph of the function's docstring."""
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema (`{"type": "object", "properties": ..., "required": [...]}`); null: built from
    the function's signature (annotations int/float/str/bool/list/dict) and its docstring's `name: text` lines."""

    @field_validator("function")
    @classmethod
    def _spec(cls, value: str) -> str:
        if value != BUILTIN_PYTHON and not SPEC.match(value):
            raise ValueError(f"agent.tools item function={value!r} must name package.module:function (the code is "
                             f"imported only because this names it), or be {BUILTIN_PYTHON}")
        return value


class SandboxConfig(Section):
    """Limits of the built-in Python tool: each call is a fresh interpreter in a private temporary directory."""

    timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit of one call; the program (and every process it started) is killed after it and the model
    reads a timeout error."""
    cpu_s: int = Field(2, ge=1, le=3600)
    """CPU-time limit (RLIMIT_CPU) of the program."""
    memory_mb: int = Field(512, ge=32)
    """Address-space limit (RLIMIT_AS) in MiB."""
    file_mb: int = Field(16, ge=0)
    """Largest file the program may write (RLIMIT_FSIZE) in MiB."""
    processes: int = Field(16, ge=1)
    """Processes and threads the sandbox's user may run (RLIMIT_NPROC; a fork bomb stops there). Root ignores
    the limit, so a root rank runs each program as a uid of its own (200000 and up, no account)."""
    output_chars: int = Field(2000, ge=64)
    """Characters of stdout + stderr the model reads back; the rest is cut and says so."""
    python: str = "/usr/bin/python3"
    """The interpreter the programs run with: a path the sandbox's unprivileged uid can execute (not a
    virtual environment under a private home); it runs with `-I`, so only its standard library is importable."""
    allow_network: bool = False
    """false: every call runs in a new network namespace (`unshare -n`; no interface but loopback), and the tool
    is refused at start-up where the rank cannot create one. true: the program has the rank's network."""


class AgentConfig(Section):
    """Multi-turn rollouts: the policy calls tools (or acts in an environment) until it answers."""

    tools: list[ToolSpec] = []
    """The tools the policy may call; their calls run in a thread pool on the rollout rank, or on the tools
    group's ranks (`placement.tools`)."""
    environment: str | None = None
    """`package.module:Class` of an environment: one instance per trajectory, `reset(row)` with the prompt row
    (dict: prompt, answer, metadata), then `step(text)` with each model turn that calls no tool, returning
    (observation or None, reward, done). Its rewards, summed, are the reward term of kind `environment`."""
    environment_args: dict[str, Any] = {}
    """Keyword arguments of the environment's constructor (JSON values)."""
    max_turns: int = Field(4, ge=1, le=64)
    """Most model turns in one trajectory; a trajectory still calling tools after the last ends `length`."""
    max_response_tokens: int = Field(1024, ge=1)
    """The whole response's budget: model turns, tool results and the template tokens around them. Each model
    turn samples at most min(rollout.max_new_tokens, what the budget leaves)."""
    tool_call_pattern: str = QWEN_TOOL_CALL
    """The regex of a tool call in a model turn; its first group is the JSON object {"name", "arguments"}.
    The default is the Qwen2.5/Qwen3 format."""
    tool_role: str = "tool"
    """The chat-template role tool results are rendered with (an environment's observations go as `user`)."""
    tool_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A Python tool call that has not returned after this long is reported to the model as a timeout."""
    tool_workers: int = Field(4, ge=1, le=256)
    """Threads of the tool pool (the calls of one turn run concurrently): on each rollout rank, or on each rank of
    the tools group (`placement.tools`)."""
    max_tool_output_chars: int = Field(2000, ge=16)
    """Characters of one tool result the model reads; the rest is cut and says so."""
    turn_schedule: Literal["lockstep", "as_ready"] = "lockstep"
    """How a chunk's trajectories take their turns. `lockstep`: every live trajectory's next turn goes to the engine
    in one call once the whole turn's tool calls are back, so each engine call's batch is a function of the data
    and runs are bitwise reproducible. `as_ready`: each trajectory's calls are submitted without waiting and the
    engine is called for the trajectories whose results are back while others still wait on tools; a slow tool
    holds back only its own trajectory, but which trajectories share an engine call depends on tool timing, so
    log-probs differ at float-noise level and a run is not bitwise reproducible (docs/agentic.md)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The limits of every program run in the sandbox: the built-in Python tool's calls and the `code` reward
    term's tests (only with a `builtin:python` tool or a code term)."""

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    @model_validator(mode="after")
    def _fields_agree(self) -> AgentConfig:
        names = [t.name or t.function.rpartition(":")[2] for t in self.tools]
        names = ["python" if t.function == BUILTIN_PYTHON and t.name is None else n for t, n in zip(self.tools, names)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"agent.tools: the tool name(s) {', '.join(dupes)} occur twice; give each its own `name`")
        if self.environment is not None and not SPEC.match(self.environment):
            raise ValueError(f"agent.environment={self.environment!r} must name package.module:Class")
        if self.environment_args and self.environment is None:
            raise ValueError("agent.environment_args is set without agent.environment; name the environment class "
                             "or drop environment_args")
        if self.turn_schedule == "as_ready" and not self.tools:
            raise ValueError("agent.turn_schedule='as_ready' lets trajectories go on while others wait on tools, and "
                             "agent.tools is empty: there is no call to wait on; add a tool or use 'lockstep'")
        try:
            groups = re.compile(self.tool_call_pattern, re.DOTALL).groups
        except re.error as err:
            raise ValueError(f"agent.tool_call_pattern={self.tool_call_pattern!r} is not a valid regex ({err})") from None
        if groups < 1:
            raise ValueError(f"agent.tool_call_pattern={self.tool_call_pattern!r} has no group; its first group must "
                             'capture the JSON object {"name": ..., "arguments": {...}}')
        return self


def check_agent_fits(cfg) -> None:
    """`RunConfig`'s check of an enabled `agent:` section (and of a tools group) against the other sections
    (ValueError naming the fix)."""
    if (problem := agent_cross_problem(cfg) or tools_group_problem(cfg) or sandbox_problem(cfg)
            or code_reward_problem(cfg)) is not None:
        raise ValueError(problem)


def code_term(cfg):
    """The run's `code` reward term (`reward.terms` holds at most one), or None."""
    return next((t for t in cfg.reward.effective_terms() if t.kind == "code"), None)


def sandbox_problem(cfg) -> str | None:
    """`agent.sandbox` set where nothing runs a program, or None."""
    if cfg.agent.sandbox != SandboxConfig() and not any(t.function == BUILTIN_PYTHON for t in cfg.agent.tools) \
            and code_term(cfg) is None:
        return (f"agent.sandbox is set but no agent.tools item is {BUILTIN_PYTHON} and no reward.terms item has kind "
                "code; add that tool or a code term, or drop agent.sandbox")
    return None


def code_reward_problem(cfg) -> str | None:
    """What a `code` reward term cannot run with, or None: its programs run on the rollout side after a chunk's
    engine call, not inside one or between segments."""
    term = code_term(cfg)
    if term is None:
        return None
    where = f"reward.terms item {term.name!r} (kind code)"
    if cfg.rollout.streaming != "chunks":
        return (f"{where} with rollout.streaming={cfg.rollout.streaming}: the tests run after an engine call, and "
                "streaming sends each group from inside the call; use rollout.streaming=chunks")
    if cfg.rollout.partial_rollouts:
        return (f"{where} with rollout.partial_rollouts=true: a paused response's program is not finished; set "
                "rollout.partial_rollouts=false")
    return None


def tools_group_problem(cfg) -> str | None:
    """What a tools group (`placement.tools.tasks_per_node` > 0) cannot run with, or None."""
    pt = cfg.placement.tools
    if not pt.enabled:
        return None
    f = f"placement.tools.tasks_per_node={pt.tasks_per_node}"
    if not cfg.agent.tools and code_term(cfg) is None:
        return (f"{f} makes a tools group, but agent.tools is empty and no reward.terms item has kind code: the "
                "group runs the agent's tool calls and the code reward's tests, and there are none; add agent.tools "
                "or a code term, or set placement.tools.tasks_per_node=0")
    if cfg.placement.dynamic_split.enabled:
        return (f"{f} with placement.dynamic_split.enabled: a dynamic split changes which pool ranks generate every "
                "step, and the tools group serves a fixed set of rollout ranks; set placement.dynamic_split.enabled="
                "false or placement.tools.tasks_per_node=0 (calls then run on the rollout ranks)")
    return None


def agent_cross_problem(cfg) -> str | None:
    """What in the rest of the run config an enabled `agent:` section cannot run with, or None."""
    agent = cfg.agent
    if any(t.kind == "environment" for t in cfg.reward.effective_terms()) and agent.environment is None:
        return ("a reward.terms item has kind environment but agent.environment is not set; name the environment "
                "class (agent.environment: package.module:Class) or drop the term")
    if not agent.enabled:
        return None
    if agent.max_response_tokens < cfg.rollout.max_new_tokens:
        return (f"agent.max_response_tokens={agent.max_response_tokens} is below rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens} (one model turn's cap); raise agent.max_response_tokens")
    if cfg.rollout.streaming != "chunks":
        return (f"rollout.streaming={cfg.rollout.streaming} with agent tools: a multi-turn trajectory finishes "
                "between engine calls, not inside one; use rollout.streaming=chunks")
    if cfg.rollout.max_staleness:
        return ("rollout.max_staleness with agent tools is not supported yet (the pending batches would need "
                "their tool state in the checkpoint); set rollout.max_staleness=0")
    if cfg.reward.overlong_buffer_len is not None:
        return ("reward.overlong_buffer_len with agent tools: the penalty counts rollout.max_new_tokens, which is "
                "one turn's cap, not the response's; drop reward.overlong_buffer_len")
    return None
