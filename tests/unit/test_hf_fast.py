"""The engine's faster paths for HF models compute what transformers computes (rollout/hf_fast.py), and the
trainer's Megatron model uses the same one-kernel GELU."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN, GELUTanh, NewGELUActivation
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from yatt_hpc.rollout.hf_fast import (
    DECODE_ATTENTION,
    PreallocatedLayer,
    decode_attention,
    fuse_activations,
    preallocated_cache,
    use_decode_attention,
)

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo" / "policy"


def test_the_fused_gelu_is_gpt2s_gelu_new_and_the_trainer_uses_it():
    from yatt_hpc.train.megatron_model import NATIVE_ACTIVATIONS, activation, tanh_gelu

    x = torch.linspace(-8, 8, 10001)
    assert (GELUTanh()(x) - NewGELUActivation()(x)).abs().max() < 1e-6
    assert activation("gelu_new") is tanh_gelu and activation("gelu_fast") is tanh_gelu
    assert (tanh_gelu(x) - ACT2FN["gelu_new"](x)).abs().max() < 1e-6
    # the others the trainer runs from torch (transformers' activations module is not imported for them)
    # compute what ACT2FN's do; anything else is still ACT2FN's own
    for name in NATIVE_ACTIVATIONS:
        assert (activation(name)(x) - ACT2FN[name](x)).abs().max() < 1e-6, name
    assert type(activation("quick_gelu")) is type(ACT2FN["quick_gelu"])


def test_fusing_activations_keeps_the_models_logits():
    model = AutoModelForCausalLM.from_pretrained(DEMO).eval()
    ids = torch.randint(3, model.config.vocab_size, (4, 12))
    with torch.no_grad():
        before = model(ids).logits
        assert fuse_activations(model) == model.config.n_layer
        after = model(ids).logits
    assert not any(isinstance(m, NewGELUActivation) for m in model.modules())
    assert (before - after).abs().max() < 1e-5
    assert fuse_activations(model) == 0  # nothing left to swap


def test_a_preallocated_layer_holds_what_a_dynamic_layer_holds_and_refuses_overflow():
    ours, theirs = PreallocatedLayer(capacity=7), DynamicLayer()
    for width in (4, 1, 1, 1):
        k, v = torch.randn(2, 3, width, 5), torch.randn(2, 3, width, 5)
        got, want = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours.get_seq_length() == theirs.get_seq_length()
    assert ours.keys.data_ptr() == ours._keys.data_ptr()  # a view of the buffer, not a copy
    with pytest.raises(RuntimeError, match="7 positions asked to hold 8"):
        ours.update(torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 5))


@pytest.mark.parametrize("keep", [[4, 1, 2], [2, 0, 1], [1, 1, 3, 3]], ids=["in-place", "reordered", "repeated"])
def test_selecting_rows_of_a_preallocated_layer_keeps_those_rows_and_goes_on_filling(keep):
    ours, theirs = PreallocatedLayer(capacity=9), DynamicLayer()
    for width in (4, 1):
        k, v = torch.randn(5, 3, width, 2), torch.randn(5, 3, width, 2)
        ours.update(k, v), theirs.update(k, v)
    keep = torch.tensor(keep)
    ours.batch_select_indices(keep), theirs.batch_select_indices(keep)
    assert ours._keys.shape == (len(keep), 3, 9, 2) and ours.get_seq_length() == 5
    k, v = torch.randn(len(keep), 3, 1, 2), torch.randn(len(keep), 3, 1, 2)
    got, want = ours.update(k, v), theirs.update(k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_cache_of_a_model_is_preallocated_layer_by_layer():
    model = AutoModelForCausalLM.from_pretrained(DEMO)
    cache = preallocated_cache(model.config, 20)
    assert len(cache.layers) == model.config.n_layer
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


class _Heads(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_decode_attention_is_sdpa_for_one_token_queries(heads, kv_heads, mask_kind):
    torch.manual_seed(0)
    rows, length, dim = 5, 9, 8
    query = torch.randn(rows, heads, 1, dim)
    buffer_k, buffer_v = torch.randn(rows, kv_heads, 16, dim), torch.randn(rows, kv_heads, 16, dim)
    key, value = buffer_k[:, :, :length], buffer_v[:, :, :length]  # the cache's views
    attend = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    attend[0, ..., :3] = False  # a left-padded row
    attend[3, ..., :1] = False
    mask = {"none": None, "bool": attend,
            "additive": torch.zeros(rows, 1, 1, length).masked_fill(~attend, torch.finfo(torch.float32).min)}[mask_kind]
    module = _Heads(heads // kv_heads)
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key.contiguous(), value.contiguous(), mask, scaling=0.3)
    assert got.shape == want.shape == (rows, 1, heads, dim)
    assert (got - want).abs().max() < 1e-5


def test_decode_attention_leaves_a_prefill_to_sdpa():
    module = _Heads(1)
    q, k, v = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    got, _ = decode_attention(module, q, k, v, None)
    want, _ = sdpa_attention_forward(module, q, k, v, None)
    assert torch.equal(got, want)


def test_an_engine_model_decodes_with_it_and_keeps_the_teacher_forced_logprobs():
    """The HF engine's sampled logprobs equal a cache-free forward of transformers' own model (SDPA). The
    engine serves the demo's GPT-2 from its directory natively (native_gpt2.py); an in-memory model goes
    through transformers, with this module's paths."""
    from yatt_hpc.rollout import GenerationRequest
    from yatt_hpc.rollout.hf_engine import HFEngine

    engine = HFEngine(AutoModelForCausalLM.from_pretrained(DEMO))
    assert not engine._native and engine._model.config._attn_implementation == DECODE_ATTENTION
    reference = AutoModelForCausalLM.from_pretrained(DEMO).eval()
    assert reference.config._attn_implementation == "sdpa"
    prompts = [np.array([5, 6, 7, 8, 9], np.int32), np.array([11, 12], np.int32)]  # ragged: left padding
    results = engine.generate([GenerationRequest(sample_id=i, prompt_ids=p, max_new_tokens=8, seed=i)
                               for i, p in enumerate(prompts)])
    for prompt, result in zip(prompts, results):
        seq = torch.tensor(np.concatenate([prompt, result.response_ids]).astype(np.int64))[None]
        with torch.no_grad():
            logp = F.log_softmax(reference(seq).logits[0, len(prompt) - 1:-1], -1)
        want = logp.gather(1, seq[0, len(prompt):, None]).squeeze(1).numpy()
        assert np.abs(result.logprobs - want).max() < 1e-5


def test_a_model_not_on_sdpa_keeps_its_attention():
    model = AutoModelForCausalLM.from_pretrained(DEMO, attn_implementation="eager")
    assert not use_decode_attention(model)
    assert model.config._attn_implementation == "eager"


def _small_qwen2(dtype=torch.float32):
    """A Qwen2 wide enough that its projections reach ONEDNN_MIN_WEIGHT (512 x 512 and up): q and o, the MLP's
    three, the output projection; k and v (128 x 512) stay below it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=2048, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def test_fp32_projections_run_through_onednn_with_the_same_logits_and_gradients_stay_torchs():
    from tests.unit.test_cpu_matmul import ONEDNN_OP, ops_called
    from yatt_hpc.device.cpu_matmul import ONEDNN_MIN_WEIGHT, onednn_linear_available
    from yatt_hpc.rollout.hf_fast import use_onednn_linears

    assert onednn_linear_available()  # torch's CPU wheel has oneDNN: the test must not pass by doing nothing
    model, reference = _small_qwen2(), _small_qwen2()
    big = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() >= ONEDNN_MIN_WEIGHT]
    assert use_onednn_linears(model) == len(big) == 2 * 5 + 1
    ids = torch.randint(3, 2048, (3, 9))
    with torch.inference_mode():
        assert ONEDNN_OP in ops_called(lambda: model(ids))
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    # with autograd on, every layer is torch's own linear: the same logits bit for bit, and a gradient
    assert ONEDNN_OP not in ops_called(lambda: model(ids))
    logits = model(ids).logits
    assert torch.equal(logits, reference(ids).logits)
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None
    assert use_onednn_linears(_small_qwen2(torch.bfloat16)) == 0  # bf16 goes to oneDNN through torch already


def test_an_fp32_engine_on_onednn_keeps_the_teacher_forced_logprobs():
    from yatt_hpc.rollout import GenerationRequest
    from yatt_hpc.rollout.hf_engine import HFEngine

    engine, reference = HFEngine(_small_qwen2()), _small_qwen2()
    assert engine._model.lm_head.forward.__name__ == "_onednn_linear"
    prompt = np.arange(5, 17, dtype=np.int32)
    result, = engine.generate([GenerationRequest(sample_id=0, prompt_ids=prompt, max_new_tokens=8, seed=3)])
    seq = torch.tensor(np.concatenate([prompt, result.response_ids]).astype(np.int64))[None]
    with torch.no_grad():
        logp = F.log_softmax(reference(seq).logits[0, len(prompt) - 1:-1], -1)
    want = logp.gather(1, seq[0, len(prompt):, None]).squeeze(1).numpy()
    assert len(result.response_ids) == 8 and np.abs(result.logprobs - want).max() < 1e-4
