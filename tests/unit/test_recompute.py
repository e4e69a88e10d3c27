"""Activation recomputation (`train.recompute`): Megatron's selective and full recompute run on CPU, give
bitwise the gradients of no recompute, and keep fewer activations for the backward.

Bitwise, not close: a recomputed region runs the same kernels on the same inputs in the same order as its
first forward (the RNG states are restored around it, and dropout is off in our models anyway), and its
backward is the same autograd graph, so every gradient is the same float.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.mpi.convert_tp2_worker import tiny_hf_model
from tests.unit.test_shared_prompt import _grouped_batch
from yatt_hpc.config.schema import TrainConfig

DEMO_POLICY = Path(__file__).resolve().parents[2] / "models" / "demo" / "policy"

RECOMPUTE = [
    pytest.param({"recompute": "selective"}, id="selective"),
    pytest.param({"recompute": "full"}, id="full-uniform-1"),
    pytest.param({"recompute": "full", "recompute_num_layers": "all"}, id="full-uniform-all-layers"),
    pytest.param({"recompute": "full", "recompute_method": "block", "recompute_num_layers": 1}, id="full-block-1"),
]


def _gradient(model_dir, share: bool, **recompute) -> dict[str, torch.Tensor]:
    """The gradient of one policy update (no clipping, so it is the loss's own) on the grouped test batch."""
    from yatt_hpc.models.hf_config import load_hf_config
    from yatt_hpc.train.hf_arch import describe_hf_config
    from yatt_hpc.train.policy import MegatronPolicy

    if recompute.get("recompute_num_layers") == "all":  # one checkpointed chunk of every layer
        recompute["recompute_num_layers"] = describe_hf_config(load_hf_config(model_dir), 1).num_layers
    torch.manual_seed(0)
    cfg = TrainConfig(lr=0.1, micro_batch_size=5, kl_coef=0.01, entropy_coef=0.01, grad_clip=0.0,
                      share_prompts=share, **recompute)
    policy = MegatronPolicy.from_hf(model_dir, 0, 1, cfg)
    batch, adv = _grouped_batch(policy.vocab_size, seed=1)
    policy.update(batch, adv)
    return {name: p.grad.clone() for name, p in policy.named_params.items()}


@pytest.fixture(scope="module")
def rope_model(tmp_path_factory) -> Path:
    """A tiny Llama (RoPE, GQA, untied head): recompute must carry the rotary angles into the recomputed layer."""
    path = tmp_path_factory.mktemp("llama")
    tiny_hf_model("llama-gqa-untied-vocab61", seed=2).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("share", [pytest.param(True, id="shared-prompts"), pytest.param(False, id="padded")])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_recompute_gives_bitwise_the_gradients_of_none(one_rank_world, rope_model, share, recompute):
    for model_dir in (DEMO_POLICY, rope_model):
        plain, recomputed = _gradient(model_dir, share), _gradient(model_dir, share, **recompute)
        assert any(g.abs().max() > 0 for g in plain.values())
        for name, grad in plain.items():
            assert torch.equal(recomputed[name], grad), (model_dir.name, name)


def _saved_bytes(share: bool, **recompute) -> int:
    """Bytes the demo policy's training forward, built for `TrainConfig(**recompute)`, keeps for its backward
    on 4 samples of 63 positions."""
    from yatt_hpc.metrics.saved_tensors import SavedActivations
    from yatt_hpc.models.hf_config import load_hf_config
    from yatt_hpc.train import convert, megatron_model, shared_prompt
    from yatt_hpc.train.policy import load_hf_state_dict

    config = load_hf_config(DEMO_POLICY)
    model = megatron_model.build_gpt_model(config, 1, recompute=megatron_model.Recompute.of(TrainConfig(**recompute)))
    megatron_model.load_megatron_shard(model, convert.hf_to_megatron(load_hf_state_dict(DEMO_POLICY), config, 0, 1))
    model.train()
    tokens = torch.randint(3, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    with SavedActivations(model.parameters()) as saved:
        if share:
            prompts, responses = [tokens[0, :16].numpy()] * 4, [row[16:].numpy() for row in tokens]
            layout = shared_prompt.build_layout(prompts, responses)
            logits = shared_prompt.forward_shared(model, layout)
        else:
            logits = megatron_model.forward_logits(model, tokens[:, :-1])
    with shared_prompt.active(layout) if share else torch.enable_grad():
        logits.float().square().mean().backward()  # the recomputed regions' backward runs
    return saved.bytes


@pytest.mark.parametrize("share", [pytest.param(True, id="shared-prompts"), pytest.param(False, id="padded")])
def test_recompute_keeps_fewer_activations_for_the_backward(one_rank_world, share):
    none = _saved_bytes(share)
    selective = _saved_bytes(share, recompute="selective")
    full = _saved_bytes(share, recompute="full")
    block = _saved_bytes(share, recompute="full", recompute_method="block", recompute_num_layers=1)
    chunk = _saved_bytes(share, recompute="full", recompute_num_layers=3)
    print(f"saved for the backward (share_prompts={share}), MiB: none {none / 2**20:.2f}, selective "
          f"{selective / 2**20:.2f}, full {full / 2**20:.2f}, full block of 1 layer {block / 2**20:.2f}, "
          f"full uniform chunks of 3 layers {chunk / 2**20:.2f}")
    # selective drops each layer's attention scores and probabilities; full keeps one [T, B, hidden] input per
    # layer (per chunk of 3: one in all); block recomputes only the first of the 3 layers
    assert chunk < full < selective < none
    assert full < block < none
    assert full < 0.5 * none


@pytest.mark.parametrize("override, needles", [
    pytest.param("train.recompute=partial", ["train.recompute", "'partial'", "'none', 'selective' or 'full'"],
                 id="unknown-mode"),
    pytest.param("train.recompute_method=block", ["train.recompute_method=block", "train.recompute=none",
                                                  "set train.recompute=full"], id="method-without-full"),
    pytest.param("train.recompute_num_layers=2", ["train.recompute_num_layers=2", "train.recompute=none",
                                                  "set train.recompute=full"], id="layers-without-full"),
    pytest.param("train.recompute_num_layers=0", ["train.recompute_num_layers", "invalid value 0"], id="no-layers"),
])
def test_recompute_settings_that_cannot_act_are_refused_at_load(override, needles):
    from yatt_hpc.config import load_config
    from yatt_hpc.config.load import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml", [override])
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_a_recomputed_shared_prompt_layer_refuses_to_run_without_its_layout(one_rank_world):
    """The backward of a recomputed layer runs its forward again: outside `shared_prompt.active` it would attend
    over the stream as one causal sequence, a silently wrong gradient, so it stops instead."""
    from yatt_hpc.models.hf_config import load_hf_config
    from yatt_hpc.train import megatron_model, shared_prompt

    config = load_hf_config(DEMO_POLICY)
    model = megatron_model.build_gpt_model(config, 1, recompute=megatron_model.Recompute("full", "uniform", 1))
    model.train()
    prompts, responses = [torch.arange(3, 9).numpy()] * 2, [torch.arange(10, 14).numpy()] * 2
    logits = shared_prompt.forward_shared(model, shared_prompt.build_layout(prompts, responses))
    with pytest.raises(RuntimeError, match="outside `shared_prompt.active`"):
        logits.sum().backward()


@pytest.mark.parametrize("method,layers,message", [
    pytest.param("block", 4, "train.recompute_num_layers=4 is more than the model's 3", id="more-than-the-model"),
    pytest.param("uniform", 2, "train.recompute_num_layers=2 does not divide the model's 3", id="uniform-not-a-divisor"),
])
def test_recomputed_layers_the_model_cannot_take_are_refused(one_rank_world, method, layers, message):
    """Before launch (`yatt-hpc run` and every rank check the model directory) and where the model is built."""
    from yatt_hpc.config import load_config
    from yatt_hpc.errors import InputError
    from yatt_hpc.models.hf_config import load_hf_config
    from yatt_hpc.runtime.inputs import check_model_dirs
    from yatt_hpc.train import megatron_model

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml",
                      ["train.recompute=full", f"train.recompute_method={method}", f"train.recompute_num_layers={layers}"])
    with pytest.raises(InputError, match=message):
        check_model_dirs(cfg)
    with pytest.raises(ValueError, match=message):
        megatron_model.build_gpt_model(load_hf_config(DEMO_POLICY), 1,
                                       recompute=megatron_model.Recompute("full", method, layers))
    check_model_dirs(load_config(Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml",
                                 ["train.recompute=full", f"train.recompute_method={method}",
                                  "train.recompute_num_layers=3"]))  # the model's own count fits either method
