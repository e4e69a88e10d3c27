"""The agentic demo task: answer a key's secret code, which only the `look` tool knows.

    from yatt_hpc.demo.lookup import look, lookup_row, trajectory
    lookup_row(seed=7, index=0)   # {"id": 0, "prompt": "key dacb\\n> ", "answer": "bdc"}
    look("dacb")                  # "bdc": the tool (agent.tools: [{function: yatt_hpc.demo.lookup:look}])

The code of a key is a hash of it (three letters of "abcd"), so a policy cannot learn the answers: it can only
learn to call the tool with the prompt's key and copy what the tool returns. A trajectory in the demo's chat
format (`CHAT_TEMPLATE`, one token per character):

    key dacb\\n> <call>{"name":"look","arguments":{"k":"dacb"}}</call><eos>\\ntool: bdc\\n> bdc<eos>

Built by tools/make_demo_tools_model.py (the tiny policy and its rows); run by configs/demo_tools_cpu.yaml.
"""
from __future__ import annotations

import json
import random
import zlib

ALPHABET = "abcd"
KEY_LENGTH, CODE_LENGTH = 4, 3
CALL_PATTERN = r"<call>(\{.*?\})</call>"
# the demo's chat format: the assistant's turn ends with <eos> (as Qwen's with <|im_end|>), a tool result is
# its own line, and the generation prompt is "> "
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}<eos>\n"
    "{% elif m['role'] == 'tool' %}tool: {{ m['content'] }}\n"
    "{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}> {% endif %}"
)


def code_of(key: str) -> str:
    """The secret code of `key`: three letters from a CRC of the key (stable across runs and machines)."""
    h = zlib.crc32(f"yatt-lookup:{key}".encode())
    return "".join(ALPHABET[(h >> (2 * i)) & 3] for i in range(CODE_LENGTH))


def look(k: str) -> str:
    """Look up the secret code of a key.

    k: the key, four letters from a, b, c, d
    """
    if len(k) != KEY_LENGTH or set(k) - set(ALPHABET):
        raise ValueError(f"no such key {k!r}")
    return code_of(k)


def lookup_row(seed: int, index: int) -> dict:
    rng = random.Random(f"yatt-lookup:{seed}:{index}")
    key = "".join(rng.choice(ALPHABET) for _ in range(KEY_LENGTH))
    return {"id": index, "prompt": f"key {key}\n> ", "answer": code_of(key)}


def call_text(key: str) -> str:
    return "<call>" + json.dumps({"name": "look", "arguments": {"k": key}}, separators=(",", ":")) + "</call>"


def trajectory(row: dict, kind: str, rng: random.Random) -> list[tuple[str, bool]]:
    """A teacher trajectory of `kind` after the prompt, as (text, the model writes it) pieces; `<eos>` is the
    end-of-turn token. `right`: the tool with the prompt's key, then its code. `guess`: an answer without the
    tool. `wrong_key`: the tool with a mistyped key, then that key's code. `broken`: a malformed call, then a guess."""
    key = row["prompt"].split()[1]
    guess = "".join(rng.choice(ALPHABET) for _ in range(CODE_LENGTH))
    if kind == "guess":
        return [(guess, True)]
    if kind == "right":
        used = key
    elif kind == "wrong_key":
        i = rng.randrange(KEY_LENGTH)
        used = key[:i] + rng.choice(ALPHABET.replace(key[i], "")) + key[i + 1:]
    else:
        broken = call_text(key).replace('"k"', "k", 1)
        return [(broken, True), ("\ntool: error: the tool call is not valid JSON\n> ", False), (guess, True)]
    return [(call_text(used), True), (f"\ntool: {code_of(used)}\n> ", False), (code_of(used), True)]
