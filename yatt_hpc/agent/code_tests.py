"""A code-execution reward's pure parts: the model's program, a row's tests, one sandbox program per test, a verdict.

    program = extract_program(answer_text)            # the last ```python block; None: no program (a parse failure)
    tests = parse_tests(row_metadata.get("tests"))    # CodeTests, or CodeTestsError naming the value and the fix
    sources = [harness_source(program, tests, k, secret) for k in range(len(tests))]   # each run in the sandbox
    passed = [run_passed(run.status, run.output, program, tests, k, secret) for k, run in enumerate(runs)]
    score = code_score(passed, all_or_nothing=False)  # the fraction passed

Test: .venv/bin/python -m pytest tests/unit/test_code_reward.py

A row's tests are its `tests` column (in the row's metadata, as every column the loader does not consume), given
as a JSON value or a string of one, in one of the formats open code datasets use:

    ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]               # asserts (MBPP `test_list`, HumanEval, KodCode)
    {"inputs": ["1 2\\n", "5 5\\n"], "outputs": ["3\\n", "10\\n"]}      # stdin/stdout (APPS `input_output`, PRIME, TACO)
    [{"input": "1 2\\n", "output": "3\\n"}, ...]                       # stdin/stdout (DeepCoder / LiveCodeBench)

Each test is its own sandbox run, so a crash, a failed assert or an endless loop costs that test only. An assert
test runs the program as a module (`__name__` is not "__main__": a `main()` guard does not run) and then the
assert, and passes when it ends with status 0 and last prints a line only this harness knows (a hash of a secret
the program never sees), so a program that calls `os._exit(0)` or prints "ok" passes nothing. A stdin/stdout test
runs the program as `__main__` with the input on `sys.stdin` and passes when it exits 0 and its output equals the
expected one, compared line by line with trailing whitespace and trailing empty lines dropped (as APPS and
DeepCoder compare). Call-based tests (`fn_name` with arguments) are refused: write them as asserts.
The program runs in the same interpreter as the harness, as verl's and PRIME's checkers run it: the sandbox keeps
it from the rank and the network, not from reading the harness's frame.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

FENCE = re.compile(r"```(?:python|py|python3)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
TESTS_KEY = "tests"
"""The row column (metadata key) holding a row's tests."""
MAX_TESTS = 256


class CodeTestsError(ValueError):
    """A row's tests are missing or malformed; the message names the value and the fix."""


@dataclass(frozen=True)
class CodeTests:
    kind: str  # "assert" | "stdio"
    asserts: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.asserts) if self.kind == "assert" else len(self.inputs)


def extract_program(text: str) -> str | None:
    """The last ```python fenced block of `text` (an answer), or None when there is none (or it is empty)."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks and blocks[-1].strip() else None


def _fix() -> str:
    return (f'give the row a `{TESTS_KEY}` column: a JSON list of assert statements, {{"inputs": [...], "outputs": '
            '[...]}, or a list of {"input": ..., "output": ...} (docs/agentic.md, "Code-execution rewards")')


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:160] + "..."


def _strings(values: object, what: str, raw: object) -> tuple[str, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise CodeTestsError(f"`{TESTS_KEY}` {what} must be a list of strings, got {_short(raw)}; {_fix()}")
    return tuple(values)


def parse_tests(raw: object) -> CodeTests:
    """A row's `tests` value as CodeTests; CodeTestsError for a missing, empty or malformed one."""
    value = raw
    if raw is None:
        raise CodeTestsError(f"the row has no `{TESTS_KEY}` column; {_fix()}")
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as err:
            raise CodeTestsError(f"`{TESTS_KEY}`={_short(raw)} is not JSON ({err.msg} at character {err.pos}); "
                                 f"{_fix()}") from None
    if isinstance(value, dict):
        if value.get("fn_name"):
            raise CodeTestsError(f"`{TESTS_KEY}` has fn_name={value['fn_name']!r}: call-based tests are not run; "
                                 "write them as assert statements (a list of strings)")
        if "inputs" not in value or "outputs" not in value:
            raise CodeTestsError(f"`{TESTS_KEY}`={_short(raw)} is an object without inputs and outputs; {_fix()}")
        tests = CodeTests("stdio", inputs=_strings(value["inputs"], "inputs", raw),
                          outputs=_strings(value["outputs"], "outputs", raw))
        if len(tests.inputs) != len(tests.outputs):
            raise CodeTestsError(f"`{TESTS_KEY}` has {len(tests.inputs)} inputs and {len(tests.outputs)} outputs; "
                                 "give one output per input")
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        if not all(isinstance(v.get("input"), str) and isinstance(v.get("output"), str) for v in value):
            raise CodeTestsError(f"`{TESTS_KEY}`={_short(raw)}: each case needs string `input` and `output`; {_fix()}")
        tests = CodeTests("stdio", inputs=tuple(v["input"] for v in value), outputs=tuple(v["output"] for v in value))
    elif isinstance(value, list):
        tests = CodeTests("assert", asserts=_strings(value, "asserts", raw))
    else:
        raise CodeTestsError(f"`{TESTS_KEY}`={_short(raw)} is a {type(value).__name__}; {_fix()}")
    if not len(tests):
        raise CodeTestsError(f"`{TESTS_KEY}`={_short(raw)} holds no test; {_fix()}")
    if len(tests) > MAX_TESTS:
        raise CodeTestsError(f"`{TESTS_KEY}` holds {len(tests)} tests, over {MAX_TESTS}; keep a sample of them")
    return tests


def pass_mark(program: str, test: str, secret: int) -> str:
    """The line an assert test's harness prints after the assert held: unknown to the program (it never sees
    `secret`), the same in every run of the same program and test (deterministic scores)."""
    return "yatt-pass-" + hashlib.sha256(f"{secret}\0{program}\0{test}".encode()).hexdigest()[:32]


def harness_source(program: str, tests: CodeTests, k: int, secret: int) -> str:
    """The sandbox program of test `k`: the harness around the model's `program`."""
    if tests.kind == "assert":
        test = tests.asserts[k]
        return (f"import os, sys\nos.remove(__file__)\n_g = {{'__name__': 'solution'}}\n"
                f"exec(compile({program!r}, 'solution.py', 'exec'), _g)\n"
                f"exec(compile({test!r}, 'test.py', 'exec'), _g)\n"
                f"sys.stdout.flush()\nprint({chr(10)!r} + {pass_mark(program, test, secret)!r}, flush=True)\n")
    data = tests.inputs[k].encode("utf-8")
    return (f"import io, os, sys\nos.remove(__file__)\n"
            f"sys.stdin = io.TextIOWrapper(io.BytesIO({data!r}), encoding='utf-8')\n"
            f"exec(compile({program!r}, 'solution.py', 'exec'), {{'__name__': '__main__'}})\n")


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def run_passed(status: str, output: str, program: str, tests: CodeTests, k: int, secret: int) -> bool:
    """Whether the sandbox run of test `k` (its status and output, as `SandboxRun`) passed."""
    if status != "ok":
        return False
    if tests.kind == "assert":
        return bool(_lines(output)) and _lines(output)[-1] == pass_mark(program, tests.asserts[k], secret)
    return _lines(output) == _lines(tests.outputs[k])


def code_score(passed: list[bool], all_or_nothing: bool = False) -> float:
    """The `code` term's value of one sample: the fraction of its tests passed (1 or 0 with `all_or_nothing`)."""
    if not passed:
        return 0.0
    if all_or_nothing:
        return float(all(passed))
    return sum(passed) / len(passed)
