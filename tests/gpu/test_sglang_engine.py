"""The SGLang engine honours the BaseEngine contract (same as tests/unit/test_hf_engine.py), on one GPU.

Run on a CUDA machine with the GPU extra: .venv/bin/python -m pytest tests/gpu/test_sglang_engine.py -ra
Skips, printing why, without CUDA or without sglang. Uses a tiny random Llama (head_dim 64, which
every SGLang attention backend takes) saved in bfloat16, so logprobs are compared to an fp32
teacher-forced forward pass of the same bf16 weights with a bf16-sized tolerance.
"""

from __future__ import annotations

import importlib.util
import threading
import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("SGLang engine tests need CUDA: torch.cuda.is_available() is False", allow_module_level=True)
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang engine tests need sglang: pip install -e '.[gpu]'", allow_module_level=True)

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from yatt_hpc.rollout import GenerationRequest, build_engine

EOS = 2
VOCAB = 512
# bf16 activations in SGLang vs an fp32 forward of the same weights.
LOGPROB_ATOL = 5e-2


def _save_tiny_llama(path, seed: int) -> str:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _save_tiny_llama(tmp_path_factory.mktemp("llama_a"), seed=0)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    return _save_tiny_llama(tmp_path_factory.mktemp("llama_b"), seed=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = build_engine(
        "sglang", model_dir, device="cuda", tp_size=1, seed=0, deterministic=True, mem_fraction_static=0.3,
        enable_memory_saver=importlib.util.find_spec("torch_memory_saver") is not None,
    )
    yield eng
    eng.shutdown()


def _requests(count: int = 12, max_new_tokens: int = 24, **kwargs) -> list[GenerationRequest]:
    rng = np.random.default_rng(123)
    return [
        GenerationRequest(
            sample_id=i, prompt_ids=rng.integers(3, VOCAB, size=int(rng.integers(1, 9))),
            max_new_tokens=max_new_tokens, seed=1000 + i, **kwargs,
        )
        for i in range(count)
    ]


def _teacher_forced_logprobs(model, result, temperature: float = 1.0) -> np.ndarray:
    ids = torch.tensor(np.concatenate([result.prompt_ids, result.response_ids]), dtype=torch.long, device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[len(result.prompt_ids) - 1 : -1], dim=-1)
    picked = logprobs.gather(1, torch.from_numpy(result.response_ids).long().cuda()[:, None]).squeeze(1)
    return picked.cpu().numpy()


def _fp32_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()


def test_generate_returns_one_result_per_request_in_request_order(engine):
    requests = _requests()
    results = engine.generate(requests)
    assert [r.sample_id for r in results] == [q.sample_id for q in requests]
    for request, result in zip(requests, results):
        assert result.response_ids.dtype == np.int32 and result.logprobs.dtype == np.float32
        assert result.response_ids.shape == result.logprobs.shape
        assert 1 <= len(result.response_ids) <= request.max_new_tokens
        assert result.finish_reason in ("stop", "length")
        if result.finish_reason == "stop":
            assert result.response_ids[-1] == EOS
        assert EOS not in result.response_ids[:-1]


@pytest.mark.parametrize("temperature", [pytest.param(1.0, id="t1"), pytest.param(0.7, id="t0.7")])
def test_logprobs_equal_a_teacher_forced_forward_pass(engine, model_dir, temperature):
    reference = _fp32_model(model_dir)
    for result in engine.generate(_requests(temperature=temperature)):
        expected = _teacher_forced_logprobs(reference, result, temperature)
        np.testing.assert_allclose(result.logprobs, expected, rtol=0, atol=LOGPROB_ATOL)


def test_same_seeds_give_same_samples_whatever_the_batch_order(engine):
    requests = _requests()
    forward = engine.generate(requests)
    backward = engine.generate(requests[::-1])[::-1]
    for a, b in zip(forward, backward):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)


def test_unknown_weight_name_raises_before_loading(engine):
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.mlp.up_prj.weight'.*up_proj"):
        engine.update_weights([("model.layers.0.mlp.up_prj.weight", torch.zeros(256, 128))], final=True)
    assert engine.weight_version == 0


def test_abort_from_another_thread_returns_aborted_results(engine):
    requests = _requests(count=4, max_new_tokens=900)
    box: list = []
    worker = threading.Thread(target=lambda: box.extend(engine.generate(requests)))
    worker.start()
    while worker.is_alive():
        engine.abort()
        time.sleep(0.01)
    worker.join()
    assert len(box) == 4
    assert any(r.finish_reason == "abort" for r in box)


def test_release_frees_gpu_memory_and_resume_restores_the_same_samples(engine):
    if importlib.util.find_spec("torch_memory_saver") is None:
        pytest.skip("release_memory needs torch_memory_saver (enable_memory_saver=True)")
    before = engine.generate(_requests())
    free_before, _ = torch.cuda.mem_get_info()
    engine.release_memory()
    free_released, _ = torch.cuda.mem_get_info()
    engine.resume_memory()
    after = engine.generate(_requests())
    assert free_released - free_before > 256 * 2**20, (free_before, free_released)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)


def test_update_weights_makes_the_engine_serve_the_new_model(engine, model_dir, other_model_dir):
    # Runs last: it changes the module engine's weights.
    new_model = AutoModelForCausalLM.from_pretrained(other_model_dir, dtype=torch.bfloat16)
    named = [(n, p.detach().cuda()) for n, p in new_model.named_parameters()]
    half = len(named) // 2
    if importlib.util.find_spec("torch_memory_saver") is not None:
        engine.release_memory()  # the colocated order: update while released, then resume
    engine.update_weights(named[:half], final=False)
    engine.update_weights(named[half:], final=True)
    engine.resume_memory()
    assert engine.weight_version == 1
    new_reference, old_reference = _fp32_model(other_model_dir), _fp32_model(model_dir)
    results = engine.generate(_requests())
    assert all(r.weight_version == 1 for r in results)
    new_error = max(np.abs(r.logprobs - _teacher_forced_logprobs(new_reference, r)).max() for r in results)
    old_error = max(np.abs(r.logprobs - _teacher_forced_logprobs(old_reference, r)).max() for r in results)
    assert new_error <= LOGPROB_ATOL < old_error, (new_error, old_error)


def _save_tiny_moe(path) -> str:
    """A random Qwen3-MoE (4 experts, 2 per token, head_dim 64) whose routers prefer experts per token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                            bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return str(path)


def test_a_recording_engine_returns_the_experts_of_every_fed_token_as_transformers_routes_them(tmp_path):
    """train.moe_routing_replay with SGLang (routing_record.routed_experts_from_sglang): each result's column holds
    every prompt token's and every response token's experts but the last's (-1), and they are the experts
    transformers' router picks for the same tokens (bf16 engine against an fp32 forward: most, not all)."""
    path = _save_tiny_moe(tmp_path / "moe")
    engine = build_engine("sglang", path, device="cuda", tp_size=1, seed=0, deterministic=True,
                          mem_fraction_static=0.3, enable_memory_saver=False, record_routing=True)
    try:
        results = engine.generate(_requests(count=4, max_new_tokens=8))
    finally:
        engine.shutdown()
    reference = _fp32_model(path)
    alike = total = 0
    for result in results:
        routed = result.routed_experts
        tokens = np.concatenate([result.prompt_ids, result.response_ids])
        assert routed.shape == (len(tokens), 2, 2) and (routed[-1] == -1).all()
        ids = torch.tensor(tokens[:-1], dtype=torch.long, device="cuda")[None]
        with torch.no_grad():
            logits = reference(input_ids=ids, output_router_logits=True).router_logits
        for layer, layer_logits in enumerate(logits):
            hf = np.sort(layer_logits.topk(2, dim=-1).indices.cpu().numpy(), axis=-1)
            alike += int((np.sort(routed[:-1, layer], axis=-1) == hf).all(-1).sum())
            total += len(hf)
    assert alike / total > 0.9, (alike, total)
