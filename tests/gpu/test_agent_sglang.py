"""Multi-turn rollouts on the SGLang engine: token ids in (`input_ids`), token ids out, logprobs of each turn
against a teacher-forced forward of the whole trajectory.

Run on a CUDA machine with the GPU extra: .venv/bin/python -m pytest tests/gpu/test_agent_sglang.py -ra
Skips without CUDA or sglang. A tiny random Llama cannot call tools, so the turns come from an environment
that answers every turn with an observation (tests/programs/agent_tools.py:CountEnv); the observation ids
come from the demo_tools tokenizer's chat template (its ids lie inside the Llama's vocabulary).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("SGLang tests need CUDA: torch.cuda.is_available() is False", allow_module_level=True)
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang tests need sglang: pip install -e '.[gpu]'", allow_module_level=True)

from tests.gpu.test_sglang_engine import LOGPROB_ATOL, _save_tiny_llama  # noqa: E402
from yatt_hpc.agent.loop import AgentLoop  # noqa: E402
from yatt_hpc.config.agent import AgentConfig  # noqa: E402
from yatt_hpc.data.tokenizer import load_tokenizer  # noqa: E402
from yatt_hpc.rollout import GenerationRequest, build_engine  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[2] / "models" / "demo_tools" / "policy"


def test_sglang_turns_take_token_ids_and_their_logprobs_match_a_teacher_forced_forward(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = _save_tiny_llama(tmp_path / "llama", seed=0)
    tok = load_tokenizer(TOKENIZER)
    cfg = AgentConfig(environment="tests.programs.agent_tools:CountEnv", max_turns=3, max_response_tokens=96)
    loop = AgentLoop(cfg, tok, max_new_tokens=16, engine_seed=0)
    engine = build_engine("sglang", model_dir, device="cuda", tp_size=1, seed=0, deterministic=True,
                          mem_fraction_static=0.3)
    requests = [GenerationRequest(sample_id=i, prompt_ids=np.arange(5, 15) + i, max_new_tokens=16) for i in range(4)]
    rows = [{"prompt": "", "answer": "never", "metadata": {}}] * 4
    try:
        first = loop.run(engine, requests, rows)
        again = loop.run(engine, requests, rows)
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().float()
    for out, other, request in zip(first, again, requests):
        assert out.result.response_ids.tolist() == other.result.response_ids.tolist()  # deterministic=True
        if out.turns < 2:
            continue
        assert (out.mask == 0).any()
        ids = torch.tensor(np.concatenate([request.prompt_ids, out.result.response_ids]), device="cuda")[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        teacher = logp[len(request.prompt_ids) - 1:].cpu().numpy()
        sampled = out.mask == 1
        np.testing.assert_allclose(out.result.logprobs[sampled], teacher[sampled], atol=LOGPROB_ATOL)
