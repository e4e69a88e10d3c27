"""A test-only engine wrapper whose answers are programs: a code reward's runs without a model that writes code.

    YATT_TEST_ENGINE_WRAPPER=tests.programs.coding_engine:CodingEngine yatt-hpc run ...   # a character-tokenizer policy

The configured engine generates as usual (its weights, seeds and timing stay real); each response is then replaced
by one of ANSWERS, chosen by the sample id (a right program, a wrong one, a crash, an endless loop, no program),
encoded with the policy's tokenizer and ended by its EOS, logprob -1 per token (short: the demo policy holds 64
positions). A run's code rewards are then a
function of the sample ids alone: the same wherever the programs run.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from tests.programs.wrapped_engine import WrappedEngine
from yatt_hpc.data.tokenizer import load_tokenizer

POLICY = Path(__file__).resolve().parents[2] / "models/demo/policy"
ANSWERS = ("```python\nprint(int(input())*2)\n```",  # passes both tests of the rows (double the input)
           "```python\nprint(0)\n```",                # passes none
           "```python\n1/0\n```",                     # crashes
           "```python\nwhile 1:0\n```",               # runs past agent.sandbox.timeout_s
           "no program",                               # a parse failure
           "```python\nprint(6)\n```")                # passes the first test only (3 -> 6)
"""Each response's text: ANSWERS[sample_id % len(ANSWERS)]."""


class CodingEngine(WrappedEngine):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.tokenizer = load_tokenizer(str(POLICY))

    def generate(self, requests, on_result=None, on_step=None):
        out = []
        for r in self.inner.generate(requests):
            ids = self.tokenizer.encode(ANSWERS[r.sample_id % len(ANSWERS)]) + [self.tokenizer.eos_ids[0]]
            out.append(dataclasses.replace(r, response_ids=np.asarray(ids, np.int32),
                                           logprobs=np.full(len(ids), -1.0, np.float32), finish_reason="stop"))
        for r in out:
            if on_result is not None:
                on_result(r)
        return out
