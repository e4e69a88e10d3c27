"""Tools the policy calls: user functions named in the config, their JSON schemas, and running a turn's calls.

    box = build_toolbox(cfg.agent)                       # imports what agent.tools names, nothing else
    box.schemas()                                        # [{"type": "function", "function": {...}}] for tools=
    outcomes = box.run([ToolCall("lookup", {"key": "ab"}), ...])   # one ToolOutcome per call, in order
    pending = box.start(calls); pending.poll()           # the same without waiting: None until all are back

Test: .venv/bin/python -m pytest tests/unit/test_agent_tools.py

A tool is `package.module:function`. Its schema comes from the config (`parameters`, `description`) or from
the function: each parameter's annotation (int, float, str, bool, list, dict, and `X | None`) gives its JSON
type, a parameter without a default is required, and the docstring's first paragraph is the description,
its `name: text` lines the parameters' descriptions (Google style `Args:` sections read the same).

A turn's calls run concurrently in a thread pool (`agent.tool_workers`); `start` submits them and returns at
once (`agent.turn_schedule: as_ready` submits each trajectory's calls so and polls them between engine calls).
A malformed call, an unknown tool, arguments that do not fit the signature, a tool that raises or runs past
`agent.tool_timeout_s`, or a result that is not text all come back as an error text the model reads (and are
counted); the rank goes on. A timed-out Python function cannot be stopped from outside: its thread is left to
finish and the pool grows a replacement, so a tool that hangs for good costs one thread per call (the sandboxed
Python tool is killed).
"""
from __future__ import annotations

import concurrent.futures as futures
import importlib
import inspect
import json
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yatt_hpc.agent.sandbox import PythonSandbox, ToolFailure
from yatt_hpc.config.agent import BUILTIN_PYTHON, AgentConfig, ToolSpec

POLL_S = 0.01  # how often a waiting turn looks at its calls' clocks
JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


class ToolConfigError(ValueError):
    """A tool named in the config cannot be used; the message names the item and the fix."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolOutcome:
    name: str
    content: str
    status: str  # ok | error | timeout
    seconds: float


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., object]
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates render (`tools=`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def import_object(spec: str, where: str) -> object:
    """`package.module:attr` imported; a failure names `where` and the fix."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise ToolConfigError(f"{where}={spec!r} cannot be imported ({type(err).__name__}: {err}); make the module "
                              "importable on every rank (installed, or on PYTHONPATH) and check the name") from None
    return obj


def json_type(annotation: object) -> dict:
    """The JSON schema of a parameter annotation (unannotated: any string)."""
    if annotation is inspect.Parameter.empty:
        return {"type": "string"}
    if isinstance(annotation, str):  # postponed annotations: the common names only
        base = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict}
        annotation = base.get(annotation.replace(" | None", "").split("[")[0], str)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return json_type(args[0]) if len(args) == 1 else {"type": [json_type(a)["type"] for a in args]}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    return {"type": JSON_TYPES.get(origin or annotation, "string")}


def schema_from_function(fn: Callable) -> tuple[str, dict]:
    """(description, parameters schema) of `fn` from its signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    notes = dict(re.findall(r"^\s*(\w+)\s*(?:\([^)]*\))?:\s*(.+)$", doc, re.MULTILINE))
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        properties[name] = json_type(param.annotation)
        if name in notes:
            properties[name]["description"] = notes[name].strip()
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return description, {"type": "object", "properties": properties, "required": required}


def build_tool(spec: ToolSpec, cfg: AgentConfig, runnable: bool = True) -> Tool:
    """The tool of `spec`; `runnable=False` only describes it (the trainer renders the prompts' tool list
    and never runs a call: no sandbox is probed there)."""
    where = "agent.tools item function"
    if spec.function == BUILTIN_PYTHON:
        box = PythonSandbox(cfg.sandbox) if runnable else PythonSandbox
        return Tool(spec.name or box.name, box, spec.description or box.description,
                    spec.parameters or box.parameters)
    fn = import_object(spec.function, where)
    if not callable(fn):
        raise ToolConfigError(f"{where}={spec.function!r} is a {type(fn).__name__}, not a function; name a function")
    description, parameters = schema_from_function(fn)
    return Tool(spec.name or spec.function.rpartition(":")[2].split(".")[-1], fn,
                spec.description or description, spec.parameters or parameters)


class PendingCalls:
    """Calls submitted to a `ToolBox`'s pool (`ToolBox.start`): `poll()` is their outcomes, in order, once every
    call finished or ran out of time, None before; it never blocks."""

    def __init__(self, box: ToolBox, calls: list, queue_deadline: float) -> None:
        self.box, self.calls, self.queue_deadline = box, calls, queue_deadline
        self.outcomes: dict[int, ToolOutcome] = {}
        self.running: dict[int, tuple[futures.Future, list[float]]] = {}

    def poll(self) -> list[ToolOutcome] | None:
        now = time.monotonic()
        for i, (future, began) in list(self.running.items()):
            outcome = self.box._outcome(self.calls[i], future, began, self.queue_deadline, now)
            if outcome is not None:
                self.outcomes[i] = outcome
                del self.running[i]
        return None if self.running else [self.outcomes[i] for i in range(len(self.calls))]


class ToolBox:
    """The run's tools and the pool their calls run in."""

    def __init__(self, tools: Sequence[Tool], workers: int = 4, timeout_s: float = 10.0,
                 max_output_chars: int = 2000) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.max_output_chars, self.workers = timeout_s, max_output_chars, workers
        self._pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="tool")
        self._lock = threading.Lock()
        self._live: list[futures.Future] = []  # calls submitted and not yet finished, for the queue deadline

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def run(self, calls: Sequence[ToolCall | str]) -> list[ToolOutcome]:
        """Every call's outcome, in order; a str is a call that could not be parsed (its error text)."""
        pending = self.start(calls)
        while (out := pending.poll()) is None:
            self.wait_any([pending])
        return out

    def start(self, calls: Sequence[ToolCall | str]) -> PendingCalls:
        """Submit `calls` to the pool without waiting: `poll()` the handle for their outcomes, in order."""
        now = time.monotonic()
        self._live = [f for f in self._live if not f.done()]
        runnable = [i for i, c in enumerate(calls) if isinstance(c, ToolCall) and c.name in self.tools]
        # a call's limit runs from when a worker starts it; one still queued gives up once every call queued
        # before it and with it could have used its whole limit (all workers stuck in calls that never return)
        rounds = -(-(len(self._live) + len(runnable)) // self.workers) + 1
        pending = PendingCalls(self, list(calls), now + rounds * self.timeout_s)
        for i in runnable:
            pending.running[i] = self._submit(calls[i])
            self._live.append(pending.running[i][0])
        for i, call in enumerate(calls):
            if isinstance(call, str):
                pending.outcomes[i] = ToolOutcome("", f"error: {call}", "error", 0.0)
            elif i not in pending.running:
                known = ", ".join(sorted(self.tools)) or "none"
                pending.outcomes[i] = ToolOutcome(call.name, f"error: unknown tool {call.name!r}; tools: {known}",
                                                  "error", 0.0)
        return pending

    def wait_any(self, handles: Sequence[PendingCalls], timeout: float = POLL_S) -> None:
        """Sleep until a call of `handles` finishes, or at most `timeout` (a call's clock may run out meanwhile)."""
        running = [f for h in handles for f, _ in h.running.values()]
        if running:
            futures.wait(running, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def _submit(self, call: ToolCall) -> tuple[futures.Future, list[float]]:
        """The call's future, and a list that holds the time a worker started it (empty while queued)."""
        fn, began = self.tools[call.name].fn, []

        def invoke() -> tuple[str, str, float]:
            began.append(time.monotonic())
            try:
                inspect.signature(fn).bind(**call.arguments)
            except TypeError as err:
                return f"error: bad arguments for {call.name}: {err}", "error", 0.0
            try:
                result = fn(**call.arguments)
                text = result if isinstance(result, str) else json.dumps(result)
                return text, "ok", time.monotonic() - began[0]
            except ToolFailure as err:
                return str(err), "timeout" if err.timeout else "error", time.monotonic() - began[0]
            except Exception as err:  # noqa: BLE001 - any failure of a user's tool is the model's to read
                return f"error: {call.name} raised {type(err).__name__}: {err}", "error", time.monotonic() - began[0]

        with self._lock:
            return self._pool.submit(invoke), began

    def _outcome(self, call: ToolCall, future: futures.Future, began: list[float], queue_deadline: float,
                 now: float) -> ToolOutcome | None:
        """The call's outcome: its result, a timeout once its clock ran out, or None while it may still finish."""
        if future.done():
            text, status, seconds = future.result()
            return ToolOutcome(call.name, _cut(text, self.max_output_chars), status, seconds)
        limit = self.timeout_s + (5.0 if isinstance(self.tools[call.name].fn, PythonSandbox) else 0.0)
        if began and now - began[0] > limit:
            self._replace_stuck_worker()
            return ToolOutcome(call.name, f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout",
                               now - began[0])
        if not began and now > queue_deadline:
            return ToolOutcome(call.name, f"error: {call.name} waited past {self.timeout_s:g} s for a free tool "
                               "worker (agent.tool_workers are stuck in calls that timed out)", "timeout", 0.0)
        return None

    def _replace_stuck_worker(self) -> None:
        """A thread stuck in a timed-out call keeps its worker: later calls get a pool of their own."""
        with self._lock:
            self._pool.shutdown(wait=False)
            self._pool = futures.ThreadPoolExecutor(self.workers, thread_name_prefix="tool")
            self._live = []  # the new pool runs none of them

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [cut at {limit} characters]"


def build_toolbox(cfg: AgentConfig) -> ToolBox:
    return ToolBox([build_tool(spec, cfg) for spec in cfg.tools], cfg.tool_workers, cfg.tool_timeout_s,
                   cfg.max_tool_output_chars)


def tool_schemas(cfg: AgentConfig) -> list[dict]:
    """The schemas of the configured tools, for the chat template's `tools=` (no sandbox is started)."""
    return [build_tool(spec, cfg, runnable=False).schema() for spec in cfg.tools]
