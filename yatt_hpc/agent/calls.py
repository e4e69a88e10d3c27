"""Tool calls in a model turn's text, and tool results as the chat template renders them (token ids).

    calls = parse_tool_calls('<tool_call>{"name": "lookup", "arguments": {"key": "ab"}}</tool_call>', QWEN_TOOL_CALL)
    render = TurnRenderer(tokenizer, template=None, role="tool")
    ids = render.results(["42"], last_token=im_end_id)   # the tool turn + the next generation prompt, as ids

Test: .venv/bin/python -m pytest tests/unit/test_agent_calls.py

A call is the JSON object in the pattern's first group: {"name": str, "arguments": object} (`arguments` may
also be a JSON string of that object, as some models write it). A match that is not such an object is a
malformed call: its error text goes back to the model. Results are rendered through the chat template
(the tokenizer's, or `data.chat_template`) as messages of the tool role after an assistant message, with the
generation prompt: the ids are those of the text the template puts after the assistant's content, so the
model's own tokens are never re-tokenised (token-in/token-out). When that text starts with the token the model
stopped its turn with (Qwen's `<|im_end|>`), that token is not repeated.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence

from yatt_hpc.agent.tools import ToolCall

_MARK = "\u2063YATT-TURN-END\u2063"  # an assistant content no template changes; what follows it is the delta


def parse_tool_calls(text: str, pattern: str | re.Pattern) -> list[ToolCall | str]:
    """Every tool call in `text`, in order: a ToolCall, or the error text of a malformed one."""
    compiled = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.DOTALL)
    out: list[ToolCall | str] = []
    for match in compiled.finditer(text):
        raw = match.group(1)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            out.append(f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {raw[:120]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(f'a tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {raw[:120]!r}')
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            out.append(f"the arguments of the call to {obj['name']!r} must be a JSON object, got {raw[:120]!r}")
            continue
        out.append(ToolCall(obj["name"], args))
    return out


class TurnRenderer:
    """Tool results (or an environment's observation) as the token ids that follow a model turn."""

    def __init__(self, tokenizer, template: str | None = None, role: str = "tool",
                 tools: Sequence[dict] | None = None) -> None:
        self.tokenizer, self.role, self.tools = tokenizer, role, list(tools or []) or None
        hf = getattr(tokenizer, "tok", None)
        self.template = template or getattr(hf, "chat_template", None)
        if not self.template:
            raise ValueError("agent tools need a chat template to render tool results with, and the policy's "
                             "tokenizer has none; give data.chat_template (a Jinja file with the tool role)")
        self._memo: dict[tuple[str, ...], list[int]] = {}

    def render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        hf = getattr(self.tokenizer, "tok", None)
        if hf is not None and hasattr(hf, "apply_chat_template"):
            return hf.apply_chat_template(messages, tools=self.tools, tokenize=False, chat_template=self.template,
                                          add_generation_prompt=add_generation_prompt)
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters.setdefault("tojson", lambda v, **kw: json.dumps(v, **kw))
        return env.from_string(self.template).render(messages=messages, tools=self.tools,
                                                     add_generation_prompt=add_generation_prompt)

    def results(self, contents: Sequence[str], last_token: int | None, role: str | None = None) -> list[int]:
        """Ids of the messages `contents` (one per tool result) after the model's turn, then the generation
        prompt; `last_token` is the token the turn ended with (dropped from the front when the template repeats it)."""
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        messages += [{"role": role or self.role, "content": c} for c in contents]
        text = self.render_text(messages, add_generation_prompt=True)
        at = text.rfind(_MARK)
        if at < 0:
            raise ValueError("the chat template dropped the assistant's content; it cannot render tool turns")
        ids = list(self.tokenizer.encode(text[at + len(_MARK):]))
        if ids and last_token is not None and ids[0] == last_token:
            ids = ids[1:]
        return ids
