"""The parts of the SGLang engine that need no GPU: the install error, name checks, output conversion, signals.

Run: .venv/bin/python -m pytest tests/unit/test_sglang_engine_cpu.py
(The engine itself is exercised by tests/gpu/test_sglang_engine.py on a CUDA machine.)
"""

from __future__ import annotations

import importlib.util
import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from yatt_hpc.rollout import GenerationRequest, build_engine
from yatt_hpc.rollout.engine import validate_bucket
from yatt_hpc.rollout.sglang_engine import (
    checkpoint_tensor_shapes,
    drop_sigterm_drain,
    result_from_sglang_output,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=128)).save_pretrained(
        path, safe_serialization=True
    )
    return str(path)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_engine_without_sglang_says_how_to_install_it(model_dir):
    with pytest.raises(ImportError, match=r"yatt-hpc\[gpu\].*use engine 'hf'"):
        build_engine("sglang", model_dir, device="cuda", tp_size=1, seed=0)


def test_sglang_engine_refuses_a_cpu_device(model_dir):
    with pytest.raises(ValueError, match="CUDA devices only.*device='cpu'"):
        build_engine("sglang", model_dir, device="cpu", tp_size=1, seed=0)


def test_checkpoint_shapes_come_from_safetensors_headers_with_the_tied_head(model_dir):
    shapes = checkpoint_tensor_shapes(model_dir)
    assert shapes["transformer.wte.weight"] == (64, 32)
    assert shapes["lm_head.weight"] == (64, 32)  # tied: not in the file, accepted under its HF name
    validate_bucket([("transformer.h.1.mlp.c_fc.weight", torch.zeros(32, 128))], shapes)
    with pytest.raises(ValueError, match="unknown weight name 'transformer.h.1.mlp.cfc.weight'.*c_fc"):
        validate_bucket([("transformer.h.1.mlp.cfc.weight", torch.zeros(32, 128))], shapes)


def test_checkpoint_without_safetensors_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        checkpoint_tensor_shapes(str(tmp_path))


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        pytest.param({"type": "stop", "matched": 2}, "stop", id="eos"),
        pytest.param({"type": "length", "length": 3}, "length", id="length"),
        pytest.param({"type": "abort", "message": "aborted"}, "abort", id="abort"),
        pytest.param(None, "abort", id="unfinished"),
    ],
)
def test_sglang_output_becomes_a_generation_result(finish, expected):
    request = GenerationRequest(sample_id=4, prompt_ids=[5, 6], max_new_tokens=3, seed=1)
    output = {
        "output_ids": [9, 8, 2],
        "meta_info": {
            "id": "x",
            "finish_reason": finish,
            "output_token_logprobs": [(-0.5, 9, None), (-1.25, 8, None), (-2.0, 2, None)],
        },
    }
    result = result_from_sglang_output(request, output, weight_version=3)
    assert (result.sample_id, result.finish_reason, result.weight_version) == (4, expected, 3)
    np.testing.assert_array_equal(result.response_ids, np.array([9, 8, 2], dtype=np.int32))
    np.testing.assert_array_equal(result.logprobs, np.array([-0.5, -1.25, -2.0], dtype=np.float32))
    np.testing.assert_array_equal(result.prompt_ids, [5, 6])


class FakeLoop:
    """The two calls of an asyncio/uvloop loop that SGLang's tokenizer manager makes; like theirs, adding
    installs a Python-level handler of the loop's own and removing leaves SIG_DFL."""

    def __init__(self):
        self.handlers = {}

    def add_signal_handler(self, sig, callback):
        self.handlers[sig] = callback
        signal.signal(sig, lambda *_: None)

    def remove_signal_handler(self, sig):
        del self.handlers[sig]
        signal.signal(sig, signal.SIG_DFL)


class FakeTokenizerManager:
    """sglang/srt/managers/tokenizer_manager.py: the loop and its SIGTERM/SIGQUIT handlers come with the first request."""

    def __init__(self):
        self.event_loop = None

    def auto_create_handle_loop(self):
        if self.event_loop is None:
            self.event_loop = FakeLoop()
            self.event_loop.add_signal_handler(signal.SIGTERM, "drain, then kill_process_tree(include_parent=True)")
            self.event_loop.add_signal_handler(signal.SIGQUIT, "a child failed: kill_process_tree")


def test_sglang_engine_start_takes_sigterm_off_the_engine_loop_and_keeps_the_ranks_handler():
    def ours(signum, frame):
        pass

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}
    manager = FakeTokenizerManager()
    try:
        signal.signal(signal.SIGTERM, ours)
        drop_sigterm_drain(SimpleNamespace(tokenizer_manager=manager))
        assert list(manager.event_loop.handlers) == [signal.SIGQUIT], "SIGQUIT (a failed child) stays SGLang's"
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
