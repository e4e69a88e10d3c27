"""HF <-> Megatron weights, the Megatron model builder and log-probs on CPU, in a one-rank gloo world.

    .venv/bin/python -m pytest tests/unit/test_convert.py -q

Real torch, real megatron-core, real gloo; the TP=2 counterpart is tests/mpi/test_convert_tp2.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.mpi.convert_tp2_worker import TINY_CASES, param_grads_vs_hf, tiny_hf_model
from yatt_hpc.train import convert
from yatt_hpc.train.hf_arch import describe_hf_config
from yatt_hpc.train.logprobs import token_logprobs_and_entropy

CASES = [pytest.param(name, id=name) for name in TINY_CASES]
TOLERANCE = 1e-5


def _megatron_twin(hf_model):
    from yatt_hpc.train import megatron_model as mm

    model = mm.build_gpt_model(hf_model.config, tp_size=1)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf_model.state_dict(), hf_model.config, 0, 1))
    return model.eval()


@pytest.mark.parametrize("case", CASES)
def test_megatron_logits_equal_hf_logits(one_rank_world, case):
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model(case)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(input_ids).logits
        got = mm.forward_logits(_megatron_twin(hf), input_ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_megatron_parameter_gradients_equal_hf_gradients(one_rank_world, case):
    hf = tiny_hf_model(case)
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    assert param_grads_vs_hf(hf, _megatron_twin(hf), input_ids, one_rank_world) <= TOLERANCE


@pytest.mark.parametrize("case", [c for c in CASES if "rope" in c.values[0]])
def test_megatron_rope_frequencies_equal_hf_scaled_frequencies(one_rank_world, case):
    hf = tiny_hf_model(case)
    rope = _megatron_twin(hf).rotary_pos_emb
    positions = torch.arange(64, dtype=torch.float32)
    ours = rope.get_freqs_non_repeated(64)
    theirs = torch.outer(positions, hf.model.rotary_emb.inv_freq)
    assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_gathering_the_live_model_returns_the_original_hf_state_dict(one_rank_world, case):
    hf = tiny_hf_model(case)
    gathered = convert.gather_hf_state_dict(_megatron_twin(hf), hf.config, one_rank_world)
    original = hf.state_dict()
    assert sorted(gathered) == sorted(original)
    assert all(torch.equal(gathered[name], original[name]) for name in original)


def test_megatron_forward_backward_through_logprobs_reaches_every_parameter(one_rank_world):
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model("qwen2-gqa-qkv-bias-tied")
    model = _megatron_twin(hf).train()
    input_ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    logp, entropy = token_logprobs_and_entropy(
        mm.forward_logits(model, input_ids)[:, :-1], input_ids[:, 1:], one_rank_world)
    (logp.mean() + 0.01 * entropy.mean()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_hf_to_megatron_shards_and_back_is_bitwise_identical(case, tp_size):
    hf = tiny_hf_model(case)
    original = hf.state_dict()
    shards = [convert.hf_to_megatron(original, hf.config, r, tp_size) for r in range(tp_size)]
    restored = convert.megatron_to_hf(shards, hf.config)
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[name], original[name]) for name in original)


def test_vocab_is_zero_padded_to_split_evenly_across_tp_ranks():
    hf = tiny_hf_model("llama-gqa-untied-vocab61")
    shards = [convert.hf_to_megatron(hf.state_dict(), hf.config, r, 2) for r in range(2)]
    embedding = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert [s["output_layer.weight"].shape[0] for s in shards] == [31, 31]
    assert torch.equal(embedding[61:], torch.zeros(1, 64))


def test_qwen3_qk_norms_map_to_megatron_qk_layernorms_replicated_on_every_tp_rank():
    hf = tiny_hf_model("qwen3-qk-norm-head-dim32-tied")
    sd = hf.state_dict()
    for rank in range(2):
        shard = convert.hf_to_megatron(sd, hf.config, rank, 2)
        for x in "qk":
            got = shard[f"decoder.layers.1.self_attention.{x}_layernorm.weight"]
            assert got.shape == (32,) and torch.equal(got, sd[f"model.layers.1.self_attn.{x}_norm.weight"])


def test_qkv_rows_are_grouped_per_kv_head_and_split_by_group_across_tp():
    hf = tiny_hf_model("qwen2-gqa-qkv-bias-tied")  # 4 heads, 2 KV groups, head_dim 16
    attn = "model.layers.0.self_attn."
    sd = hf.state_dict()
    rank1 = convert.hf_to_megatron(sd, hf.config, 1, 2)["decoder.layers.0.self_attention.linear_qkv.bias"]
    # TP rank 1 owns KV group 1 only: its 2 query heads, then k_1, then v_1.
    expected = torch.cat([sd[f"{attn}q_proj.bias"][32:], sd[f"{attn}k_proj.bias"][16:],
                          sd[f"{attn}v_proj.bias"][16:]])
    assert torch.equal(rank1, expected)


def test_streaming_megatron_to_hf_can_skip_the_tied_lm_head():
    hf = tiny_hf_model("gpt2-tied")
    shard = convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1)
    names = [name for name, _ in convert.iter_megatron_to_hf([shard], hf.config, emit_tied_lm_head=False)]
    assert "lm_head.weight" not in names
    assert sorted(names + ["lm_head.weight"]) == sorted(hf.state_dict())
    assert names[0] == "transformer.wte.weight" and names[-1] == "transformer.ln_f.bias"


def test_hf_to_megatron_rejects_a_checkpoint_of_another_architecture():
    llama = tiny_hf_model("llama-gqa-untied-vocab61")
    qwen_config = tiny_hf_model("qwen2-gqa-qkv-bias-tied").config
    with pytest.raises(KeyError, match="missing=.*q_proj.bias"):
        convert.hf_to_megatron(llama.state_dict(), qwen_config, 0, 1)


def test_a_tied_checkpoint_may_omit_lm_head_but_an_untied_one_may_not():
    tied = tiny_hf_model("gpt2-tied")
    without_head = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    assert "output_layer.weight" not in convert.hf_to_megatron(without_head, tied.config, 0, 1)
    untied = tiny_hf_model("llama-gqa-untied-vocab61")
    without_head = {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(KeyError, match="missing=.*lm_head.weight"):
        convert.hf_to_megatron(without_head, untied.config, 0, 1)


def _config(case: str, **overrides):
    config = tiny_hf_model(case).config
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 5e5}


@pytest.mark.parametrize("case, overrides, error, named", [
    pytest.param("llama-gqa-untied-vocab61", {"attention_bias": True}, NotImplementedError,
                 "attention_bias=True", id="llama-attention-bias"),
    pytest.param("llama-gqa-untied-vocab61", {"mlp_bias": True}, NotImplementedError, "mlp_bias=True",
                 id="llama-mlp-bias"),
    pytest.param("qwen3-qk-norm-untied-vocab61", {"attention_bias": True}, NotImplementedError,
                 "attention_bias=True", id="qwen3-attention-bias"),
    pytest.param("qwen2-gqa-qkv-bias-tied", {"use_sliding_window": True}, NotImplementedError,
                 "use_sliding_window=True", id="qwen2-sliding-window"),
    pytest.param("qwen3-qk-norm-untied-vocab61", {"layer_types": ["full_attention", "sliding_attention"]},
                 NotImplementedError, r"layer_types=\['sliding_attention'\]", id="qwen3-sliding-layers"),
    pytest.param("llama-gqa-untied-vocab61", {"hidden_act": "gelu"}, NotImplementedError,
                 "hidden_act='gelu'", id="gelu-mlp"),
    pytest.param("qwen2-gqa-qkv-bias-tied", {"attention_dropout": 0.1}, NotImplementedError,
                 "attention_dropout=0.1", id="attention-dropout"),
    pytest.param("llama-gqa-untied-vocab61",
                 {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
                 NotImplementedError, "rope_type='yarn'", id="yarn-rope"),
    pytest.param("llama-gqa-untied-vocab61",
                 {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                 NotImplementedError, "rope_type='dynamic'", id="dynamic-rope"),
    pytest.param("llama3-rope-scaling", {"rope_parameters": {**_LLAMA3, "low_freq_factor": 2.0}},
                 NotImplementedError, "low_freq_factor=2.0", id="llama3-other-low-freq-factor"),
    pytest.param("llama3-rope-scaling",
                 {"rope_parameters": {**_LLAMA3, "original_max_position_embeddings": 4096}},
                 NotImplementedError, "original_max_position_embeddings=4096", id="llama3-other-context"),
    pytest.param("llama-gqa-untied-vocab61",
                 {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                 NotImplementedError, "partial_rotary_factor=0.5", id="partial-rotary"),
    pytest.param("llama-linear-rope",
                 {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "mscale": 1.0}},
                 NotImplementedError, "mscale", id="rope-key-megatron-does-not-read"),
    pytest.param("llama-gqa-untied-vocab61", {"num_key_value_heads": 1}, ValueError,
                 "num_kv_heads=1", id="kv-heads-not-divisible-by-tp"),
    pytest.param("qwen3-qk-norm-untied-vocab61", {"model_type": "mixtral"}, ValueError,
                 "model_type='mixtral'", id="unsupported-model-type"),
])
def test_configs_megatron_cannot_express_fail_naming_the_field_and_value(case, overrides, error, named):
    with pytest.raises(error, match=named):
        describe_hf_config(_config(case, **overrides), tp_size=2)


@pytest.mark.parametrize("case, overrides", [
    pytest.param("llama3-rope-scaling", {}, id="llama3-rope"),
    pytest.param("llama-linear-rope", {}, id="linear-rope"),
    pytest.param("qwen2-gqa-qkv-bias-tied", {"use_sliding_window": False, "sliding_window": 4096},
                 id="qwen2.5-sliding-window-off"),
    pytest.param("llama-gqa-untied-vocab61",
                 {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}},
                 id="full-rotary-spelled-out"),
])
def test_configs_of_the_supported_models_are_accepted(case, overrides):
    describe_hf_config(_config(case, **overrides), tp_size=2)


# ---------------------------------------------------------------------------------------- log-probs


def _reference_logprobs_and_entropy(logits, targets):
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return log_p.gather(-1, targets[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("scale", [pytest.param(1.0, id="unit-logits"), pytest.param(30.0, id="peaked")])
def test_token_logprobs_and_entropy_equal_log_softmax_gather(scale):
    generator = torch.Generator().manual_seed(5)
    logits = scale * torch.randn(3, 7, 50, generator=generator)
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    logp, entropy = token_logprobs_and_entropy(logits, targets)
    ref_logp, ref_entropy = _reference_logprobs_and_entropy(logits, targets)
    assert (logp - ref_logp).abs().max().item() <= TOLERANCE
    assert (entropy - ref_entropy).abs().max().item() <= TOLERANCE


def test_temperature_scores_the_tempered_distribution():
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 5, 20, generator=generator)
    targets = torch.randint(0, 20, (2, 5), generator=generator)
    got = token_logprobs_and_entropy(logits, targets, temperature=0.7)
    expected = _reference_logprobs_and_entropy(logits / 0.7, targets)
    assert all((g - e).abs().max().item() <= TOLERANCE for g, e in zip(got, expected, strict=True))


def test_padded_vocab_columns_are_ignored_and_get_no_gradient():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, 40, generator=generator)
    padded = torch.cat([logits, torch.full((2, 5, 4), 9.0)], dim=-1).requires_grad_()
    targets = torch.randint(0, 40, (2, 5), generator=generator)
    logp, entropy = token_logprobs_and_entropy(padded, targets, vocab_size=40)
    ref_logp, ref_entropy = _reference_logprobs_and_entropy(logits, targets)
    assert (logp - ref_logp).abs().max().item() <= TOLERANCE
    assert (entropy - ref_entropy).abs().max().item() <= TOLERANCE
    (logp.sum() + entropy.sum()).backward()
    assert torch.equal(padded.grad[..., 40:], torch.zeros(2, 5, 4))


def test_logprob_and_entropy_gradients_equal_autograd_through_log_softmax():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 6, 30, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 30, (2, 6), generator=generator)
    weights = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, entropy = token_logprobs_and_entropy(ours, targets)
    (logp * weights + entropy * weights.flip(-1)).sum().backward()
    ref_logp, ref_entropy = _reference_logprobs_and_entropy(ref.double(), targets)
    (ref_logp * weights + ref_entropy * weights.flip(-1)).sum().backward()
    assert (ours.grad - ref.grad).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_pipeline_stages_split_and_merge_bitwise(case, tp_size):
    """Two stages (one layer each): local layer names, the embeddings on the first, the head on the last; a tied
    head's copy on the last stage is loaded from the embedding and never written back."""
    hf = tiny_hf_model(case)
    original = hf.state_dict()
    stages = [[convert.hf_to_megatron(original, hf.config, r, tp_size, convert.Stage(s, 2)) for r in range(tp_size)]
              for s in range(2)]
    first, last = stages[0][0], stages[1][0]
    assert all(not k.startswith("decoder.layers.") or k.startswith("decoder.layers.0.") for k in [*first, *last])
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "decoder.final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in first
    assert "output_layer.weight" in last  # its own head, or the tied embeddings' copy
    if describe_hf_config(hf.config, tp_size).tied_embeddings:
        assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    restored = convert.stages_to_hf(stages, hf.config)
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[name], original[name]) for name in original)


def test_layers_that_do_not_split_into_the_stages_are_refused():
    with pytest.raises(ValueError, match="placement.trainer.pp=3 does not divide the policy's 2 transformer layers"):
        convert.hf_to_megatron(tiny_hf_model("gpt2-tied").state_dict(), tiny_hf_model("gpt2-tied").config, 0, 1,
                               convert.Stage(0, 3))
