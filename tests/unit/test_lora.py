"""LoRA on the Megatron trainer (yatt_hpc/lora/), in a one-rank gloo world: adapter maths by hand, the real `peft`
library's logits and gradients, merged weights, the policy's optimizer and checkpoint, the base identity, refusals.

    .venv/bin/python -m pytest tests/unit/test_lora.py -q

The TP=2 counterpart is tests/mpi/test_lora_tp2.py; a LoRA run of the demo, its exact resume and its exports are
tests/mpi/test_lora_run.py.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.batches import random_update_batch
from tests.mpi.convert_tp2_worker import tiny_hf_model
from yatt_hpc.config import ConfigError, load_config
from yatt_hpc.config.lora import LoraConfig
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.errors import InputError
from yatt_hpc.lora import identity
from yatt_hpc.lora.peft import adapter_config, megatron_to_peft, merge_into_hf, peft_to_megatron, reshard, save_peft
from yatt_hpc.lora.targets import PEFT_PREFIX, peft_shapes, resolve_targets
from yatt_hpc.train.convert import Stage
from yatt_hpc.train.hf_arch import describe_hf_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "demo"
TOLERANCE = 1e-5
# (tiny model, target_modules): GPT-2's fused c_attn and Conv1D layout; Qwen2's GQA with q/k/v biases, every layer;
# Llama with only some of the modules a fused layer holds (k_proj and gate_proj without an adapter)
CASES = [pytest.param("gpt2-tied", ["all-linear"], id="gpt2-all-linear"),
         pytest.param("qwen2-gqa-qkv-bias-tied", ["all-linear"], id="qwen2-gqa-all-linear"),
         pytest.param("llama-gqa-untied-vocab61", ["q_proj", "v_proj", "up_proj", "down_proj"], id="llama-some")]


def lora_twin(hf, target_modules, rank=4, alpha=8.0, seed=0, dropout=0.0):
    """The Megatron model of `hf` with adapters whose B is random (at the start B is zero: nothing to see)."""
    from yatt_hpc.lora.layers import Lora
    from yatt_hpc.train import convert
    from yatt_hpc.train import megatron_model as mm

    model = mm.build_gpt_model(hf.config, tp_size=1)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1))
    cfg = LoraConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=target_modules)
    lora = Lora.attach(model, describe_hf_config(hf.config, 1), cfg, seed, 0, 1)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
    return model, lora


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def peft_model(hf, peft_sd, target_modules, tmp_path, rank=4, alpha=8.0):
    """`hf` with the adapters loaded by the real peft library from a directory we wrote."""
    from peft import PeftModel

    config = adapter_config(rank, alpha, 0.0, resolve_targets(describe_hf_config(hf.config, 1), target_modules),
                            hf.config, "base")
    save_peft(tmp_path / "adapter", peft_sd, config)
    return PeftModel.from_pretrained(hf, str(tmp_path / "adapter"), is_trainable=True)


def ids_for(hf, shape=(2, 12), seed=1):
    return torch.randint(0, hf.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the maths, and peft's


def test_a_fused_qkv_layer_adds_each_modules_scaled_BAx_in_megatrons_group_order(one_rank_world):
    """By hand: linear_qkv's output rows are [q heads of group g, k_g, v_g] per KV group; an adapter on q_proj and
    one on v_proj (none on k_proj) add (alpha / r) B_q A_q x to the q rows and (alpha / r) B_v A_v x to the v rows."""
    hf = tiny_hf_model("llama-gqa-untied-vocab61")
    model, _ = lora_twin(hf, ["q_proj", "v_proj"], rank=4, alpha=8.0)
    layer = model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(3, 2, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = layer(x)[0] - torch.nn.functional.linear(x, layer.weight)
        q = 2.0 * x @ layer.adapters.q_proj.lora_A.T @ layer.adapters.q_proj.lora_B.T
        v = 2.0 * x @ layer.adapters.v_proj.lora_A.T @ layer.adapters.v_proj.lora_B.T
    groups, d = hf.config.num_key_value_heads, hf.config.head_dim
    per = hf.config.num_attention_heads // groups
    expected = []
    for g in range(groups):
        expected += [q[..., g * per * d:(g + 1) * per * d], torch.zeros(3, 2, d), v[..., g * d:(g + 1) * d]]
    torch.testing.assert_close(got, torch.cat(expected, dim=-1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("case", "targets"), CASES)
def test_peft_loads_our_adapters_onto_the_hf_model_with_our_logits(one_rank_world, tmp_path, case, targets):
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model(case)
    model, _ = lora_twin(hf, targets)
    peft_sd = megatron_to_peft([[adapters(model)]], hf.config)
    ids = ids_for(hf)
    with torch.no_grad():
        ours = mm.forward_logits(model.eval(), ids)[..., :hf.config.vocab_size]
        theirs = peft_model(hf, peft_sd, targets, tmp_path)(ids).logits
    assert (ours - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(("case", "targets"), CASES)
def test_adapter_gradients_equal_peft_gradients(one_rank_world, tmp_path, case, targets):
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model(case)
    model, _ = lora_twin(hf, targets)
    theirs = peft_model(hf, megatron_to_peft([[adapters(model)]], hf.config), targets, tmp_path)
    ids = ids_for(hf)
    weights = torch.randn(*ids.shape, hf.config.vocab_size, generator=torch.Generator().manual_seed(2))
    (mm.forward_logits(model.train(), ids)[..., :hf.config.vocab_size] * weights).sum().backward()
    (theirs(ids).logits * weights).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)  # the base is frozen
    ours = megatron_to_peft([[{n: p.grad for n, p in model.named_parameters() if p.requires_grad}]], hf.config)
    expected = {f"{PEFT_PREFIX}{n.replace('.default', '')}": p.grad for n, p in theirs.base_model.model.named_parameters()
                if p.requires_grad}
    assert sorted(ours) == sorted(expected)
    scale = max(g.abs().max().item() for g in expected.values())
    assert max((ours[k] - expected[k]).abs().max().item() for k in ours) <= TOLERANCE * scale


@pytest.mark.parametrize(("case", "targets"), CASES)
def test_merged_weights_are_the_base_plus_scaled_BA_and_compute_the_adapted_logits(one_rank_world, case, targets):
    """What the engines get: each adapted HF weight is W + (alpha / r) B A (by hand, transposed for GPT-2's
    Conv1D), every other tensor the base's; a plain model loaded with them gives the adapters' logits."""
    from yatt_hpc.train import convert
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model(case)
    model, lora = lora_twin(hf, targets)
    merged = dict(convert.iter_gathered_hf_weights(model, hf.config, one_rank_world, emit_tied_lm_head=False,
                                                   local=lora.merged_state(model)))
    base = {k: v for k, v in hf.state_dict().items() if k in merged}
    peft_sd = megatron_to_peft([[adapters(model)]], hf.config)
    changed = 0
    for name, weight in base.items():
        module = f"{PEFT_PREFIX}{name.removesuffix('.weight')}"
        if f"{module}.lora_A.weight" not in peft_sd:
            assert torch.equal(merged[name], weight), name
            continue
        delta = 2.0 * peft_sd[f"{module}.lora_B.weight"] @ peft_sd[f"{module}.lora_A.weight"]
        torch.testing.assert_close(merged[name], weight + (delta.T if case.startswith("gpt2") else delta))
        changed += 1
    assert changed == len(peft_sd) // 2
    for name, weight in merge_into_hf(base, peft_sd, 2.0, hf.config).items():  # the export's merge: the same
        torch.testing.assert_close(weight, merged[name])
    plain = mm.build_gpt_model(hf.config, tp_size=1)
    mm.load_megatron_shard(plain, convert.hf_to_megatron(merged, hf.config, 0, 1))
    ids = ids_for(hf)
    with torch.no_grad():
        a, b = mm.forward_logits(plain.eval(), ids), mm.forward_logits(model.eval(), ids)
    assert (a - b).abs().max().item() <= TOLERANCE


def test_disabled_adapters_give_the_base_models_logits(one_rank_world):
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model("qwen2-gqa-qkv-bias-tied")
    model, lora = lora_twin(hf, ["all-linear"])
    ids = ids_for(hf)
    with torch.no_grad(), lora.disabled():
        off = mm.forward_logits(model.eval(), ids)[..., :hf.config.vocab_size]
    with torch.no_grad():
        on = mm.forward_logits(model, ids)[..., :hf.config.vocab_size]
        base = hf(ids).logits
    assert (off - base).abs().max().item() <= TOLERANCE and (on - base).abs().max().item() > 1e-3


def test_dropout_masks_the_adapters_input_in_the_update_only(one_rank_world):
    """train.lora.dropout: a forward with gradients differs from one without by the dropped inputs; the scoring
    forward (no gradients) is dropout-free, like PEFT's in eval mode."""
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model("gpt2-tied")
    model, _ = lora_twin(hf, ["all-linear"], dropout=0.5)
    ids = ids_for(hf)
    with torch.no_grad():
        scored = mm.forward_logits(model, ids)
    trained = mm.forward_logits(model.train(), ids).detach()
    again = mm.forward_logits(model, ids).detach()
    undropped, _ = lora_twin(hf, ["all-linear"], dropout=0.0)
    with torch.no_grad():
        plain = mm.forward_logits(undropped, ids)
    assert torch.equal(scored, plain)
    assert (trained - plain).abs().max() > 1e-3 and (trained - again).abs().max() > 1e-3  # new masks each forward


def test_adapters_start_at_zero_B_and_the_same_A_in_any_pipeline_split(one_rank_world):
    from yatt_hpc.lora.layers import Lora, initial_a
    from yatt_hpc.lora.targets import layer_sites
    from yatt_hpc.train import convert
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model("qwen2-gqa-qkv-bias-tied")
    model = mm.build_gpt_model(hf.config, tp_size=1)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1))
    arch = describe_hf_config(hf.config, 1)
    Lora.attach(model, arch, LoraConfig(rank=4), 0, 0, 1)
    state = adapters(model)
    assert all(not t.any() for n, t in state.items() if n.endswith("lora_B"))
    a = state["decoder.layers.1.self_attention.linear_qkv.adapters.q_proj.lora_A"]
    bound = 1 / math.sqrt(hf.config.hidden_size)  # PEFT's kaiming_uniform_(a=sqrt(5))
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    site = layer_sites(arch, resolve_targets(arch, ["q_proj"]))[0]  # global layer 1 = stage 1's layer 0 at pp=2
    assert torch.equal(initial_a(0, 1, site, site.slots[0], 4), a)


# ---------------------------------------------------------------------------- layouts

def test_adapters_reshard_between_layouts_through_the_peft_layout():
    """tp=2 x pp=2 shards of a PEFT state dict, resharded into tp=1 x pp=1 and back, are the same tensors."""
    hf = tiny_hf_model("qwen2-gqa-qkv-bias-tied")
    arch = describe_hf_config(hf.config, 1)
    targets = resolve_targets(arch, ["all-linear"])
    generator = torch.Generator().manual_seed(3)
    model_peft = {PEFT_PREFIX + name: torch.randn(shape, generator=generator)
                  for name, shape in peft_shapes(arch, targets, 4).items()}
    parts = [[peft_to_megatron(model_peft, hf.config, targets, t, 2, Stage(p, 2)) for t in range(2)] for p in range(2)]
    assert megatron_to_peft(parts, hf.config).keys() == model_peft.keys()
    assert all(torch.equal(megatron_to_peft(parts, hf.config)[k], v) for k, v in model_peft.items())
    one = reshard(parts, hf.config, 0, 1, None, Stage())
    assert all(torch.equal(v, peft_to_megatron(model_peft, hf.config, targets, 0, 1)[k]) for k, v in one.items())


# ---------------------------------------------------------------------------- the policy

def _policy(dtype=torch.float32, **lora):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    cfg = TrainConfig(lr=1e-2, micro_batch_size=4, kl_coef=0.1, lora=LoraConfig(rank=8, **lora))
    return MegatronPolicy.from_hf(DEMO / "policy", 0, 1, cfg, dtype=dtype)


def test_lora_policy_steps_only_the_adapters_and_checkpoints_only_them(one_rank_world):
    policy = _policy()
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    trained = set(policy.named_params)
    assert trained and all(".adapters." in n for n in trained) and base
    assert {id(p) for p in policy.optimizer.param_groups[0]["params"]} == {id(p) for p in policy.named_params.values()}
    assert policy.reference is policy.model  # the base model, with its adapters off: no second copy
    batch, adv = random_update_batch(policy.hf_config.vocab_size)
    ref_before = policy.reference_logprobs(batch)
    stats = policy.update(batch, adv)
    assert math.isfinite(stats.loss) and stats.grad_norm > 0
    assert all(torch.equal(p, base[n]) for n, p in policy.model.named_parameters() if n in base)
    assert all(policy.named_params[n].any() for n in trained if n.endswith("lora_B"))  # B left zero
    ref_after = policy.reference_logprobs(batch)
    assert all((a == b).all() for a, b in zip(ref_before, ref_after))  # the reference is still the base
    saved = policy.checkpoint_tensors()
    assert set(saved) == trained
    optim, _ = policy.optimizer_state()
    assert {k.rpartition(".")[0] for k in optim} == trained
    other = _policy()
    other.load_checkpoint_tensors(saved)
    other.load_optimizer_state(*policy.optimizer_state())
    assert all(torch.equal(other.named_params[n], policy.named_params[n]) for n in trained)
    weights = dict(policy.hf_weights())
    assert not torch.equal(weights["transformer.h.0.attn.c_attn.weight"], base_hf_weight("transformer.h.0.attn.c_attn.weight"))
    assert torch.equal(weights["transformer.wte.weight"], base_hf_weight("transformer.wte.weight"))


def test_a_bf16_lora_policy_keeps_fp32_masters_of_the_adapters_only(one_rank_world):
    policy = _policy(torch.bfloat16)
    assert policy.mixed and set(policy.master) == set(policy.named_params)
    assert {m.dtype for m in policy.master.values()} == {torch.float32}
    policy.update(*random_update_batch(policy.hf_config.vocab_size))
    saved = policy.checkpoint_tensors()
    assert set(saved) == set(policy.named_params) and {t.dtype for t in saved.values()} == {torch.float32}
    assert {t.dtype for _, t in policy.hf_weights()} == {torch.bfloat16}  # merged, in the engines' dtype


def base_hf_weight(name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(DEMO / "policy" / "model.safetensors"))[name]


# ---------------------------------------------------------------------------- base identity, refusals

def test_the_base_fingerprint_tells_another_model_and_changed_weights(tmp_path):
    copy = tmp_path / "policy"
    shutil.copytree(DEMO / "policy", copy)
    assert identity.base_fingerprint(copy) == identity.base_fingerprint(DEMO / "policy")
    assert identity.base_fingerprint(DEMO / "judge") != identity.base_fingerprint(DEMO / "policy")
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-5] ^= 1  # a weight of the last tensor (same header, same size)
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert identity.base_fingerprint(copy) != identity.base_fingerprint(DEMO / "policy")


def test_resume_refuses_another_base_or_adapter_shape_naming_the_field():
    saved = identity.lora_record(LoraConfig(rank=8), str(DEMO / "policy"))
    assert identity.resume_problem(saved, dict(saved), 20) is None
    assert identity.resume_problem(None, None, 20) is None
    other = identity.lora_record(LoraConfig(rank=8), str(DEMO / "judge"))
    assert "point model.path at the base" in identity.resume_problem(saved, other, 20)
    assert "train.lora.rank=8" in identity.resume_problem(saved, {**saved, "rank": 4}, 20)
    assert "train.lora.rank=0" in identity.resume_problem(saved, None, 20)
    assert "fully trained weights" in identity.resume_problem(None, saved, 20)


@pytest.mark.parametrize(("overrides", "message"), [
    pytest.param(["train.lora.alpha=32"], "train.lora.alpha=32.0 shapes the adapters, but train.lora.rank=0", id="no-rank"),
    pytest.param(["train.lora.rank=8", "train.lora.target_modules=[qkv]"], "'qkv' is not a linear layer", id="unknown"),
    pytest.param(["train.lora.rank=8", "train.lora.target_modules=[all-linear,q_proj]"], "give all-linear alone",
                 id="all-linear-and-more"),
    pytest.param(["train.lora.rank=8", "train.lora.target_modules=[c_attn,q_proj]"], "mixes GPT-2 names", id="mixed"),
    pytest.param(["train.lora.rank=8", "train.lora.target_modules=[]"], "gives no layer an adapter", id="empty"),
    pytest.param(["train.lora.rank=8", "train.lora.dropout=1.0"], "train.lora.dropout", id="dropout"),
    pytest.param(["train.lora.rank=8", "checkpoint.load_from=runs/x"], "export that checkpoint", id="load-from"),
])
def test_lora_settings_that_cannot_act_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(REPO / "configs/demo_cpu.yaml", overrides)


def test_lora_modules_the_model_does_not_have_are_refused_before_launch():
    from yatt_hpc.runtime.inputs import check_lora_targets

    cfg = load_config(REPO / "configs/demo_cpu.yaml", ["train.lora.rank=8", "train.lora.target_modules=[q_proj]"])
    with pytest.raises(InputError, match=r"a gpt2 model has no 'q_proj'; its linear layers are \['c_attn'"):
        check_lora_targets(cfg)
    check_lora_targets(load_config(REPO / "configs/demo_cpu.yaml", ["train.lora.rank=8"]))
