"""The engine's plain-torch GPT-2 (yatt_hpc/rollout/native_gpt2.py) computes transformers' GPT2LMHeadModel:
the same state-dict names and shapes, the same logits through a left-padded prefill and decode steps,
the same sampled tokens through the engine; and a checkpoint it does not compute goes to transformers."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, GPT2LMHeadModel

from tests.conftest import REPO
from yatt_hpc.rollout import GenerationRequest
from yatt_hpc.rollout.hf_engine import HFEngine
from yatt_hpc.rollout.native_gpt2 import load_native, why_not_native

DEMO = str(REPO / "models" / "demo" / "policy")


def _save(path, seed: int = 0, **overrides) -> str:
    settings = {"vocab_size": 50, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "eos_token_id": 2,
                "bos_token_id": 1, **overrides}
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**settings))
    with torch.no_grad():  # biases and LayerNorms away from their initial 0/1, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["tied_gelu_new", "untied_relu_inner"])
def model_dir(request, tmp_path_factory) -> str:
    extra = {} if request.param == "tied_gelu_new" else {"tie_word_embeddings": False, "activation_function": "relu",
                                                         "n_inner": 48}
    return _save(tmp_path_factory.mktemp(request.param), **extra)


def test_the_state_dict_is_gpt2lmheadmodels(model_dir):
    native, hf = load_native(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    ours, theirs = native.state_dict(), hf.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape and torch.equal(ours[k], theirs[k]) for k in theirs)
    tied = native.lm_head.weight is native.transformer.wte.weight
    assert tied == hf.config.tie_word_embeddings


def test_prefill_and_decode_logits_match_transformers_with_left_padding(model_dir):
    native, hf = load_native(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, hf_cache = native.new_cache(width + 4), DynamicCache(config=hf.config)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(4):
            ours = native.last_logits(ids, mask, positions, cache)
            theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=hf_cache,
                        use_cache=True).logits[:, -1]
            assert (ours - theirs).abs().max() < 2e-6
            ids = torch.randint(3, 50, (len(prompts), 1), generator=g)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            positions = positions[:, -1:] + 1


def test_the_engine_samples_transformers_tokens(model_dir):
    """Native engine (from the directory) vs the same weights through transformers (an in-memory model),
    shedding finished rows on the way: the same tokens, logprobs within 1e-5."""
    native = HFEngine(model_dir, seed=3, max_batch_size=5)
    through_hf = HFEngine(AutoModelForCausalLM.from_pretrained(model_dir), seed=3, max_batch_size=5)
    assert native._native and not through_hf._native
    rng = np.random.default_rng(0)
    requests = [GenerationRequest(sample_id=i, prompt_ids=rng.integers(3, 50, int(rng.integers(1, 9))),
                                  max_new_tokens=int(rng.integers(1, 20)), temperature=t)
                for i, t in zip(range(12), [1.0, 0.7, 0.0] * 4)]
    for a, b in zip(native.generate(requests), through_hf.generate(requests), strict=True):
        assert np.array_equal(a.response_ids, b.response_ids) and a.finish_reason == b.finish_reason
        assert np.abs(a.logprobs - b.logprobs).max(initial=0.0) < 1e-5


def test_weight_updates_by_checkpoint_name_reach_the_tied_head(tmp_path):
    first, second = _save(tmp_path / "a", seed=0), _save(tmp_path / "b", seed=1)
    engine, want = HFEngine(first), load_native(second)
    engine.update_weights(((k, v) for k, v in want.state_dict().items() if k != "lm_head.weight"), final=True)
    assert torch.equal(engine._model.lm_head.weight, want.transformer.wte.weight)
    request = [GenerationRequest(sample_id=0, prompt_ids=np.array([4, 5, 6]), max_new_tokens=10, seed=1)]
    assert np.array_equal(engine.generate(request)[0].response_ids, HFEngine(second).generate(request)[0].response_ids)


@pytest.mark.parametrize("change, reason", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
    ({"activation_function": "quick_gelu"}, "activation_function 'quick_gelu'"),
    ({"model_type": "llama"}, "model_type 'llama' is not gpt2"),
    ({"drop": "n_layer"}, "does not state ['n_layer']"),
])
def test_what_it_does_not_compute_is_served_by_transformers(tmp_path, change, reason):
    path = _save(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    if "drop" in change:
        config.pop(change["drop"])
    else:
        config.update(change)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert reason in why_not_native(path)
    assert load_native(path) is None
    if change.get("model_type") is None and "drop" not in change:
        assert not HFEngine(path)._native  # and transformers serves it


def test_a_rollout_rank_serving_the_demo_never_imports_transformers():
    code = ("import sys; from yatt_hpc.roles import rollout; from yatt_hpc.rollout import build_engine; "
            f"e = build_engine('hf', {DEMO!r}, device='cpu', tp_size=1, seed=0); "
            "print(sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("keep, in_place", [([4, 1, 2], True), ([2, 0, 1], False), ([1, 1, 3, 3], False)],
                         ids=["holes-filled-from-past-the-prefix", "reordered", "repeated"])
def test_shedding_rows_of_the_cache_keeps_those_rows_and_goes_on_filling(keep, in_place):
    """The engine sheds finished rows: the kept rows' filled positions are copied (never the whole
    capacity: a long-tail wave sheds ~20 times), in place when the kept rows past the prefix only fill
    its holes, and writing goes on where it stopped; any other order (or the prefill's rows repeated
    per request) is gathered into a new buffer."""
    from yatt_hpc.rollout.native_gpt2 import NativeCache

    cache, full = NativeCache(layers=2, capacity=9), {0: [], 1: []}
    for width in (4, 1):
        for layer in (0, 1):
            k, v = torch.randn(5, 3, width, 2), torch.randn(5, 3, width, 2)
            cache.write(layer, k, v)
            full[layer].append((k, v))
        cache.filled += width
    keep, before = torch.tensor(keep), cache.keys[0].data_ptr()
    cache.batch_select_indices(keep)
    assert cache.keys[0].shape == (len(keep), 3, 9, 2) and cache.filled == 5
    assert (cache.keys[0].data_ptr() == before) == in_place
    k, v = torch.randn(len(keep), 3, 1, 2), torch.randn(len(keep), 3, 1, 2)
    got_k, got_v = cache.write(1, k, v)
    want_k = torch.cat([full[1][0][0][keep], full[1][1][0][keep], k], dim=2)
    want_v = torch.cat([full[1][0][1][keep], full[1][1][1][keep], v], dim=2)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_the_engine_sheds_by_filling_holes_with_the_last_live_rows():
    from yatt_hpc.rollout.micro_batch import live_rows

    live = torch.tensor([True, False, True, False, True, True, False])
    assert live_rows(live).tolist() == [0, 4, 2, 5]  # rows 1 and 3 finished: 4 and 5 move there
    assert live_rows(torch.tensor([True, True, False])).tolist() == [0, 1]  # nothing moves
