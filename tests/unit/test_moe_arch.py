"""Qwen3-MoE and Qwen2-MoE as the converter reads them: the config's routing facts, what is refused, the experts between disk
names and transformers' fused parameters, which experts an expert-parallel rank holds, and the HF engine taking
experts one by one. The logits and gradients against transformers are tests/mpi/test_moe.py."""
from __future__ import annotations

import re

import pytest
import torch

from tests.mpi.moe_worker import tiny_moe, tiny_moe_config
from yatt_hpc.models.hf_experts import unfuse_hf_experts
from yatt_hpc.train import convert
from yatt_hpc.train.hf_arch import MoEArch, describe_hf_config, refuse_unsupported_moe


def test_qwen3_moe_routing_is_read_from_the_config():
    arch = describe_hf_config(tiny_moe_config(norm_topk_prob=False, aux=0.02), tp_size=2)
    assert arch.family == "qwen3_moe" and arch.qk_norm and arch.gated_mlp
    assert arch.moe == MoEArch(num_experts=4, topk=2, ffn_hidden_size=32, norm_topk_prob=False, aux_loss_coeff=0.02)


def test_qwen2_moe_is_qwen2_attention_with_routed_experts_and_a_gated_shared_expert():
    arch = describe_hf_config(tiny_moe_config(norm_topk_prob=False, aux=0.02, family="qwen2_moe"), tp_size=2)
    assert arch.family == "qwen2_moe" and arch.qkv_bias and not arch.qk_norm and arch.head_dim == 16
    assert arch.moe == MoEArch(num_experts=4, topk=2, ffn_hidden_size=32, norm_topk_prob=False, aux_loss_coeff=0.02,
                               shared_ffn_hidden_size=48)
    config = tiny_moe_config(family="qwen2_moe")
    config.qkv_bias = False
    assert not describe_hf_config(config, tp_size=1).qkv_bias


def test_the_shared_expert_maps_to_megatrons_shared_experts_on_every_expert_rank():
    arch = describe_hf_config(tiny_moe_config(family="qwen2_moe"), tp_size=1)
    for rank in (0, 1):
        rules = {r.megatron: (r.hf, r.split) for unit in convert.weight_rules(arch, experts=convert.Experts(rank, 2))
                 for r in unit if ".shared_experts." in r.megatron and r.megatron.startswith("decoder.layers.1.")}
        assert rules == {
            "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (
                ("model.layers.1.mlp.shared_expert.gate_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight"),
                convert.Split.GATE_UP),
            "decoder.layers.1.mlp.shared_experts.linear_fc2.weight": (
                ("model.layers.1.mlp.shared_expert.down_proj.weight",), convert.Split.ROW),
            "decoder.layers.1.mlp.shared_experts.gate_weight": (
                ("model.layers.1.mlp.shared_expert_gate.weight",), convert.Split.REPLICATED)}
    assert not convert.is_expert("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")  # a dense parameter


@pytest.mark.parametrize("family, field, value, message", [
    pytest.param("qwen2_moe", "decoder_sparse_step", 2, "decoder_sparse_step=2 (qwen2_moe): only 1",
                 id="qwen2-sparse-step"),
    pytest.param("qwen2_moe", "mlp_only_layers", [1], "mlp_only_layers=[1] (qwen2_moe)", id="qwen2-dense-layers"),
    pytest.param("qwen2_moe", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0 (qwen2_moe)",
                 id="qwen2-no-shared-expert"),
    pytest.param("qwen2_moe", "shared_expert_intermediate_size", 47,
                 "shared_expert_intermediate_size=47 is not divisible by tp_size=2", id="qwen2-shared-tp"),
    pytest.param("qwen2_moe", "use_sliding_window", True, "use_sliding_window=True", id="qwen2-sliding"),
    pytest.param("qwen3_moe", "shared_expert_intermediate_size", 64, "shared_expert_intermediate_size=64 (qwen3_moe)",
                 id="qwen3-shared-expert"),
])
def test_qwen2_moe_settings_without_a_megatron_twin_are_refused_naming_the_field(family, field, value, message):
    config = tiny_moe_config(family=family)
    setattr(config, field, value)
    with pytest.raises((NotImplementedError, ValueError), match=re.escape(message)):
        describe_hf_config(config, tp_size=2)


@pytest.mark.parametrize("field, value, message", [
    pytest.param("decoder_sparse_step", 2, "decoder_sparse_step=2 (qwen3_moe): only 1", id="sparse-step"),
    pytest.param("mlp_only_layers", [0], "mlp_only_layers=[0] (qwen3_moe)", id="dense-layers"),
    pytest.param("moe_intermediate_size", 33, "moe_intermediate_size=33 is not divisible by tp_size=2", id="tp"),
])
def test_what_megatron_would_compute_differently_is_refused_naming_the_field(field, value, message):
    config = tiny_moe_config()
    setattr(config, field, value)
    with pytest.raises((NotImplementedError, ValueError), match=re.escape(message)):
        describe_hf_config(config, tp_size=2)


def test_expert_parallelism_with_a_dense_policy_is_refused(monkeypatch):
    from transformers import Qwen2Config

    from yatt_hpc.moe import layers

    monkeypatch.setattr(layers, "expert_parallel_size", lambda: 2)
    dense = describe_hf_config(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=64), tp_size=1)
    with pytest.raises(ValueError, match=r"placement.trainer.ep=2 but the policy \(qwen2\) has no experts"):
        refuse_unsupported_moe(dense, False, "none", 1)
    refuse_unsupported_moe(describe_hf_config(tiny_moe_config(), tp_size=1), False, "none", 1)  # a MoE policy: fine


@pytest.mark.parametrize("lora, recompute, pp, field", [
    pytest.param(True, "none", 1, "train.lora.rank > 0", id="lora"),
    pytest.param(False, "full", 1, "train.recompute='full'", id="recompute"),
    pytest.param(False, "none", 2, "placement.trainer.pp=2", id="pipeline"),
])
def test_trainer_features_the_experts_are_not_wired_into_are_refused(lora, recompute, pp, field):
    arch = describe_hf_config(tiny_moe_config(), tp_size=1)
    with pytest.raises(ValueError, match=re.escape(field)):
        refuse_unsupported_moe(arch, lora, recompute, pp)
    refuse_unsupported_moe(describe_hf_config(tiny_moe_config(), 1), False, "none", 1)  # the plain case runs


def test_a_value_model_of_routed_experts_is_refused_naming_the_estimator():
    from yatt_hpc.critic.model import build_value_model

    with pytest.raises(ValueError, match=r"train\.adv_estimator=gae with a mixture-of-experts model \(qwen3_moe\)"):
        build_value_model(tiny_moe_config(), tp_size=1)


def test_experts_unfused_are_what_save_pretrained_writes(tmp_path):
    from safetensors.torch import load_file

    model = tiny_moe()
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    ours = unfuse_hf_experts(model.state_dict())
    assert sorted(ours) == sorted(disk) and all(torch.equal(ours[k], disk[k]) for k in disk)


def test_an_expert_parallel_rank_holds_a_contiguous_share_under_local_numbers():
    arch = describe_hf_config(tiny_moe_config(), tp_size=1)
    rules = [r for unit in convert.weight_rules(arch, experts=convert.Experts(1, 2)) for r in unit]
    layer0 = {r.megatron: r.hf for r in rules if r.megatron.startswith("decoder.layers.0.mlp.experts.")}
    assert layer0["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == (
        "model.layers.0.mlp.experts.2.gate_proj.weight", "model.layers.0.mlp.experts.2.up_proj.weight")
    assert len(layer0) == 4  # experts 2 and 3: fc1 and fc2 each
    assert any(r.megatron == "decoder.layers.0.mlp.router.weight" for r in rules)  # every rank routes
    with pytest.raises(ValueError, match="4 experts do not split over placement.trainer.ep=3"):
        convert.weight_rules(arch, experts=convert.Experts(0, 3))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_hf_engine_writes_experts_sent_one_by_one_into_its_fused_parameters(family):
    """Qwen2-MoE's shared expert and its gate are plain linears: sent under their checkpoint names, loaded as is."""
    from yatt_hpc.rollout.hf_engine import HFEngine

    target, source = tiny_moe(seed=0, family=family), tiny_moe(seed=1, family=family)
    engine = HFEngine(target, device="cpu")
    sent = list(unfuse_hf_experts(source.state_dict()).items())
    half = len(sent) // 2  # two buckets: a layer's experts may straddle them
    engine.update_weights(sent[:half], final=False)
    engine.update_weights(sent[half:], final=True)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in source.state_dict().items())
    with pytest.raises(ValueError, match="shape mismatch for 'model.layers.0.mlp.experts.1.up_proj.weight'"):
        engine.update_weights([("model.layers.0.mlp.experts.1.up_proj.weight", torch.zeros(3, 3))], final=True)


def test_fused_experts_given_back_must_all_come_back_before_the_final_bucket():
    """`drop_weights` frees the fused expert parameters too: a sync refills them expert by expert, and one whose
    experts did not all arrive is named at the final bucket."""
    from yatt_hpc.rollout.hf_engine import HFEngine

    target, source = tiny_moe(seed=0), tiny_moe(seed=1)
    engine = HFEngine(target, device="cpu")
    sent = list(unfuse_hf_experts(source.state_dict()).items())
    engine.drop_weights()
    engine.update_weights(sent[:len(sent) // 2], final=False)
    engine.update_weights(sent[len(sent) // 2:], final=True)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in source.state_dict().items())
    engine.drop_weights()
    with pytest.raises(RuntimeError, match=r"mlp\.experts\.gate_up_proj \(experts \['model\.layers\.1\.mlp\.experts\.3"):
        engine.update_weights([(n, t) for n, t in sent if not n.startswith("model.layers.1.mlp.experts.3.")], final=True)


def _report(values: dict, group: str = "trainer") -> dict:
    return {"group": group, "values": values, "times": {}, "peak_rss_mb": 0.0, "peak_held": 0}


def _scalars(replicas: list[dict]) -> dict:
    from yatt_hpc.runtime.summary import step_scalars

    reports = [_report(v) for v in replicas] + [_report({}, "rollout"), _report({}, "genrm")]
    return step_scalars(reports, 1.0, leader_report=reports[0])


def test_expert_load_metric_is_the_busiest_experts_tokens_over_the_mean_per_layer_over_every_replica():
    # two replicas, one layer of 4 experts (layer 1 perfectly balanced): layer 0 gets 6, 2, 2, 2 tokens in all
    replicas = [{"moe_tokens/0/0": 4.0, "moe_tokens/0/1": 1.0, "moe_tokens/0/2": 1.0, "moe_tokens/0/3": 2.0},
                {"moe_tokens/0/0": 2.0, "moe_tokens/0/1": 1.0, "moe_tokens/0/2": 1.0, "moe_tokens/0/3": 0.0}]
    for values in replicas:
        values.update({f"moe_tokens/1/{e}": 3.0 for e in range(4)})
    got = _scalars(replicas)
    assert got["moe/load_max_over_mean/layer0"] == pytest.approx(6.0 / 3.0)
    assert got["moe/load_max_over_mean/layer1"] == 1.0
    assert got["moe/load_max_over_mean"] == pytest.approx(2.0)
    dense = _scalars([{"samples": 4.0}])
    assert not any(key.startswith("moe/") for key in dense)


def test_an_expert_parallel_shard_goes_to_checkpoint_names_and_back():
    """A rank's experts under model-wide numbers in its checkpoint file; from a shard with every expert each rank
    takes its own, renumbered from 0 (optimizer entries, `<param>.exp_avg`, alike)."""
    local = {"decoder.layers.0.mlp.router.weight": torch.zeros(1),
             "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.full((1,), 2.0),
             "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight": torch.full((1,), 3.0)}
    saved = convert.experts_global(local, convert.Experts(1, 2))
    assert sorted(saved) == ["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
                             "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
                             "decoder.layers.0.mlp.router.weight"]
    every = {**saved, "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.ones(1),
             "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight.exp_avg": torch.ones(1)}
    assert convert.experts_local(every, convert.Experts(1, 2)).keys() == local.keys()
    assert torch.equal(convert.experts_local(every, convert.Experts(1, 2))[
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"], torch.full((1,), 2.0))
    assert sorted(convert.experts_local(every, convert.Experts(0, 2))) == [
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight.exp_avg", "decoder.layers.0.mlp.router.weight"]
    assert convert.is_expert("decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight")
    assert not convert.is_expert("decoder.layers.3.mlp.router.weight")
