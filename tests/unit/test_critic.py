"""The value model (`yatt_hpc/critic/`): a real Megatron-Core GPTModel with a scalar head on one rank, its values
on both forward layouts, its update, where it starts from, and its transformers export.

    .venv/bin/python -m pytest tests/unit/test_critic.py -q
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.batches import random_update_batch
from yatt_hpc.config.schema import RunConfig, TrainConfig
from yatt_hpc.errors import InputError

DEMO_POLICY = Path(__file__).resolve().parents[2] / "models" / "demo" / "policy"


def _critic(path=None, **critic):
    """A critic from `train.critic.path` (null: the demo policy's model.path) on this one-rank world."""
    from yatt_hpc.critic.update import MegatronCritic

    share = critic.pop("share_prompts", True)
    cfg = RunConfig.model_validate({"model": {"path": str(DEMO_POLICY)}, "train": {
        "adv_estimator": "gae", "share_prompts": share, "micro_batch_size": 3,
        "critic": {"lr": 1e-3, "head_init_std": 0.05, "path": None if path is None else str(path), **critic}}})
    return MegatronCritic.from_run_config(cfg, 0, 1)


def _returns(batch, values):
    from yatt_hpc.train.step_plan import step_gae

    return step_gae(batch, values, TrainConfig(adv_estimator="gae")).returns


def test_values_are_the_same_on_shared_prompts_and_padded_rows_and_the_update_fits_them(one_rank_world):
    from yatt_hpc.train.step_plan import whole_batch_plan

    batch, _ = random_update_batch(104, samples=8)
    shared, padded = _critic(lr=2e-4), _critic(lr=2e-4, share_prompts=False)
    v_shared, v_padded = shared.values(batch), padded.values(batch)
    assert [len(v) for v in v_shared] == batch.response_len.tolist()
    for a, b in zip(v_shared, v_padded):
        np.testing.assert_allclose(a, b, atol=1e-5)
    returns = [np.full(n, r, np.float32) for n, r in zip(batch.response_len, np.linspace(0, 1, len(batch)))]
    plan = whole_batch_plan(batch, shared.cfg)
    losses = [shared.update_values(batch, shared.values(batch), returns, plan).loss for _ in range(12)]
    assert max(losses[-3:]) < 0.75 * losses[0], losses
    stats = padded.update_values(batch, v_padded, returns, plan)
    assert stats.optimizer_steps == 1 and stats.tokens == float(batch.response_len.sum())


@pytest.mark.parametrize("share, level", [(True, "token"), (False, "token"), (True, "turn")],
                         ids=["shared-prompts", "padded", "turn-level"])
def test_tool_result_tokens_carry_no_value_loss(one_rank_world, share, level):
    """An agent's tool results (response_mask 0) are out of the value loss: their returns can be anything; at
    `critic.level: turn` so are all but each model turn's first token."""
    from yatt_hpc.algos.gae import value_positions
    from yatt_hpc.train.step_plan import whole_batch_plan

    batch, _ = random_update_batch(104, samples=6)
    rng = np.random.default_rng(5)
    batch.response_mask = (rng.random(batch.response_mask.size) < 0.6).astype(np.uint8)
    masks = batch.ragged("response_mask")
    returns = [np.full(n, 0.5, np.float32) for n in batch.response_len]
    positions = [value_positions(m, level) for m in masks]
    wild = [np.where(p, r, 50.0).astype(np.float32) for r, p in zip(returns, positions)]
    plan = whole_batch_plan(batch, _critic(share_prompts=share, level=level).cfg)
    a, b = _critic(share_prompts=share, level=level), _critic(share_prompts=share, level=level)
    old = a.values(batch)
    stats_a, stats_b = a.update_values(batch, old, returns, plan), b.update_values(batch, old, wild, plan)
    assert stats_a.tokens == stats_b.tokens == float(sum(p.sum() for p in positions))
    assert stats_a.loss == stats_b.loss
    for x, y in zip(a.values(batch), b.values(batch)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("level", ["token", "turn"])
def test_the_value_loss_is_a_mean_over_the_tokens_it_covers(one_rank_world, level):
    """Returns one above the values where the loss looks: 0.5 (V - R)^2 = 0.5 whatever the level, because the
    token-mean divides by the tokens the level covers (`step_plan.value_tokens`), not every response token."""
    from yatt_hpc.algos.gae import value_positions
    from yatt_hpc.train.step_plan import plan_update, value_tokens

    batch, _ = random_update_batch(104, samples=6)
    batch.response_mask = np.tile([1, 1, 1, 0], batch.response_mask.size)[:batch.response_mask.size].astype(np.uint8)
    critic = _critic(share_prompts=True, level=level)
    old = critic.values(batch)
    returns = [(v + value_positions(m, level)).astype(np.float32) for v, m in zip(old, batch.ragged("response_mask"))]
    plan = plan_update(batch, critic.cfg, 1, gather=lambda items: items, reduce=lambda values: values,
                       tokens=value_tokens(batch, level))
    assert critic.update_values(batch, old, returns, plan).loss == pytest.approx(0.5, rel=1e-5)


def test_value_clip_holds_the_loss_around_the_old_values(one_rank_world):
    from yatt_hpc.train.step_plan import whole_batch_plan

    batch, _ = random_update_batch(104, samples=8)
    far = [np.full(n, 5.0, np.float32) for n in batch.response_len]  # returns far from every value
    clipped, free = _critic(value_clip=0.01), _critic(value_clip=None)
    old = clipped.values(batch)
    plan = whole_batch_plan(batch, clipped.cfg)
    for _ in range(3):  # moving past old +- 0.01 toward 5 leaves the clipped term the larger
        stats = clipped.update_values(batch, old, far, plan)
        open_stats = free.update_values(batch, old, far, plan)
    assert stats.clipped == stats.tokens and open_stats.clipped == 0.0


def test_the_critics_optimizer_takes_its_own_settings_and_lr_is_adams_first_step(one_rank_world):
    from yatt_hpc.train.step_plan import whole_batch_plan

    critic = _critic(lr=2e-3, adam_betas=(0.8, 0.95), adam_eps=1e-6, weight_decay=0.01, grad_clip=0.5)
    group = critic.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-3, (0.8, 0.95), 1e-6, 0.01)
    batch, _ = random_update_batch(104, samples=8)
    bias = critic.model.output_layer.bias.detach().clone()
    critic.optimizer.param_groups[0]["weight_decay"] = 0.0
    stats = critic.update_values(batch, critic.values(batch), [np.full(n, 3.0) for n in batch.response_len],
                                 whole_batch_plan(batch, critic.cfg))
    moved = float((critic.model.output_layer.bias - bias).abs())
    assert moved == pytest.approx(2e-3, rel=1e-3)  # Adam's first step: lr x sign(gradient)
    assert stats.grad_norm > 0.5  # the norm before the clip
    old = critic.values(batch)
    critic._zero_grads()  # grad_clip: the gradients the optimizer steps with have the norm 0.5
    inputs = critic._inputs(batch)
    loss, _ = critic._value_loss((np.arange(len(batch)), batch, inputs), critic._forward(critic.model, inputs), old,
                                 [np.full(n, 3.0) for n in batch.response_len], np.ones(len(batch), np.float32),
                                 whole_batch_plan(batch, critic.cfg).totals[0])
    with critic._backward_layout(inputs):
        loss.backward()
    grads = [(p, p.grad) for p in critic.master.values()]
    assert critic._clip_grads(grads) > 0.5
    assert float(torch.sqrt(sum((g.double() ** 2).sum() for _, g in grads))) == pytest.approx(0.5, rel=1e-4)


def test_a_new_head_is_drawn_with_head_init_std_and_zero_starts_at_zero(one_rank_world):
    batch, _ = random_update_batch(104, samples=4)
    zero = _critic(head_init_std=0.0)
    assert not zero.model.output_layer.weight.any() and all(not v.any() for v in zero.values(batch))
    drawn = _critic(head_init_std=0.5)
    assert float(drawn.model.output_layer.weight.std()) == pytest.approx(0.5, rel=0.25)
    again = _critic(head_init_std=0.5)  # seeded by train.seed: the same head on every rank and every start
    assert torch.equal(drawn.model.output_layer.weight, again.model.output_layer.weight)


def _reward_model(tmp_path: Path, labels: int = 1) -> Path:
    """A GPT2ForSequenceClassification on the demo policy's decoder (a one-label reward model's layout)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(**{k: v for k, v in json.loads((DEMO_POLICY / "config.json").read_text()).items()
                           if k not in ("architectures", "dtype", "transformers_version")}, num_labels=labels)
    torch.manual_seed(1)
    model = GPT2ForSequenceClassification(config).eval()
    out = tmp_path / f"rm{labels}"
    model.save_pretrained(out)
    shutil.copy(DEMO_POLICY / "yatt_tokenizer.json", out)
    return out


def test_a_one_label_reward_model_gives_the_critic_its_decoder_and_head(one_rank_world, tmp_path):
    from transformers import GPT2ForSequenceClassification

    path = _reward_model(tmp_path)
    critic = _critic(path=path, head_init_std=0.7)  # the reward model's head wins over a new one
    rm = GPT2ForSequenceClassification.from_pretrained(path).eval()
    torch.testing.assert_close(critic.model.output_layer.weight.detach(), rm.score.weight.detach())
    assert not critic.model.output_layer.bias.any()  # a sequence classifier's score has no bias
    batch, _ = random_update_batch(104, samples=3)
    for i, v in enumerate(critic.values(batch)):
        p, n = int(batch.prompt_len[i]), int(batch.response_len[i])
        tokens = torch.from_numpy(np.concatenate([batch.ragged("prompt_tokens")[i],
                                                  batch.ragged("response_tokens")[i]]).astype(np.int64))[None]
        with torch.no_grad():
            scores = rm.transformer(tokens).last_hidden_state[0] @ rm.score.weight.T
        np.testing.assert_allclose(v, scores[p - 1:p - 1 + n, 0].numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="2 labels"):
        _critic(path=_reward_model(tmp_path, labels=2))


def test_the_exported_critic_loads_in_transformers_and_gives_the_same_values(one_rank_world, tmp_path):
    from transformers import AutoModelForTokenClassification

    from yatt_hpc.critic.model import to_token_classification, token_classification_config
    from yatt_hpc.models.hf_config import load_hf_config

    critic = _critic(head_init_std=0.3)
    critic.model.output_layer.bias.data.fill_(0.25)
    hf = to_token_classification([[critic.checkpoint_tensors()]], load_hf_config(DEMO_POLICY))
    assert {"classifier.weight", "classifier.bias", "transformer.wte.weight"} <= hf.keys()
    out = tmp_path / "critic"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model.safetensors"))
    config = token_classification_config(json.loads((DEMO_POLICY / "config.json").read_text()))
    (out / "config.json").write_text(json.dumps(config))
    model = AutoModelForTokenClassification.from_pretrained(out).eval()
    assert type(model).__name__ == "GPT2ForTokenClassification" and model.config.num_labels == 1
    batch, _ = random_update_batch(104, samples=3)
    for i, v in enumerate(critic.values(batch)):
        p, n = int(batch.prompt_len[i]), int(batch.response_len[i])
        tokens = torch.from_numpy(np.concatenate([batch.ragged("prompt_tokens")[i],
                                                  batch.ragged("response_tokens")[i]]).astype(np.int64))[None]
        with torch.no_grad():
            logits = model(tokens).logits[0, :, 0]
        np.testing.assert_allclose(v, logits[p - 1:p - 1 + n].numpy(), atol=1e-5)


@pytest.mark.parametrize("sets, needle", [
    pytest.param({"placement": {"trainer": {"nodes": 1, "tasks_per_node": 2, "tp": 1, "pp": 2, "dp": 1}},
                  "train": {"adv_estimator": "gae", "critic": {"path": "models/demo/policy"}}},
                 "placement.trainer.pp=2", id="pipeline-stages-split-the-critics-layers"),
    pytest.param({"rollout": {"max_staleness": 1}, "placement": {"mode": "partial"}}, "rollout.max_staleness=1",
                 id="asynchronous"),
    pytest.param({"train": {"adv_estimator": "gae", "critic": {"path": "models/demo/judge"}}}, "vocab_size",
                 id="another-vocabulary"),
    pytest.param({"train": {"adv_estimator": "gae", "critic": {"path": "no/such/dir"}}}, "train.critic.path",
                 id="missing-directory"),
])
def test_critic_settings_the_run_cannot_take_are_refused_before_launch(sets, needle, tmp_path, monkeypatch):
    from yatt_hpc.runtime.inputs import check_critic

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    raw = {"train": {"adv_estimator": "gae"}, **sets}
    raw["train"] = {"adv_estimator": "gae", **sets.get("train", {})}
    if "tp" in json.dumps(sets.get("placement", {})):
        raw["train"]["prompts_per_step"] = 16
    cfg = RunConfig.model_validate(raw)
    if cfg.train.critic.path == "models/demo/judge":
        judge = json.loads(Path("models/demo/judge/config.json").read_text())
        if judge["vocab_size"] == 104:  # the demo judge reads the policy's tokens: make one that does not
            other = tmp_path / "other"
            shutil.copytree("models/demo/judge", other)
            (other / "config.json").write_text(json.dumps({**judge, "vocab_size": 200}))
            cfg = RunConfig.model_validate({**raw, "train": {"adv_estimator": "gae", "critic": {"path": str(other)}}})
    with pytest.raises(InputError, match=needle.replace(".", r"\.")):
        check_critic(cfg)


def test_the_plan_shows_the_critic_and_its_memory():
    from yatt_hpc.placement import plan as plan_placement
    from yatt_hpc.placement.show import critic_text

    base = {"placement": {"mode": "colocate", "trainer": {"nodes": 1, "tasks_per_node": 2, "tp": 1, "dp": 2}}}
    cfg = RunConfig.model_validate({**base, "train": {"adv_estimator": "gae", "shard_optimizer": True}})
    text = critic_text(plan_placement(cfg), cfg)
    assert "from model.path (Pc = P)" in text and "AdamW 8Pc/2 (sharded over dp)" in text and "in turn" in text
    bf16 = RunConfig.model_validate({**base, "model": {"dtype": "bfloat16"},
                                     "train": {"adv_estimator": "gae", "critic": {"path": "models/rm"}}})
    assert "train.critic.path=models/rm: weights 2Pc/1" in critic_text(plan_placement(bf16), bf16)
    plain = RunConfig.model_validate(base)
    assert critic_text(plan_placement(plain), plain) is None


def test_a_checkpoint_holds_the_critic_and_exports_it_as_token_classification(tmp_path):
    """No Megatron model here: the checkpoint files, their reading back, and `export_critic` on a Llama."""
    from transformers import AutoModelForTokenClassification

    from tests.mpi.convert_tp2_worker import tiny_hf_model
    from yatt_hpc.ckpt import CheckpointError, CheckpointManager, RankState, SharedState
    from yatt_hpc.ckpt.export_hf import export_critic
    from yatt_hpc.ckpt.loader import read_rank
    from yatt_hpc.critic.model import value_shard
    from yatt_hpc.train.convert import hf_to_megatron

    model_dir, run_dir = tmp_path / "llama", tmp_path / "run"
    llama = tiny_hf_model("llama-gqa-untied-vocab61")
    llama.save_pretrained(model_dir)
    critic = value_shard(llama.state_dict(), llama.config, 0, 1, seed=0, init_std=0.3, where="test")
    optim = {"output_layer.bias.exp_avg": torch.ones(1)}
    with CheckpointManager(run_dir) as mgr:
        mgr.save(4, RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0},
                              model=hf_to_megatron(llama.state_dict(), llama.config, 0, 1), critic=critic,
                              critic_optim=optim, critic_optim_meta={"kind": "test"}),
                 SharedState(config_yaml=f"model:\n  path: {model_dir}\ntrain:\n  adv_estimator: gae\n"))
        mgr.save(5, RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0},
                              model=hf_to_megatron(llama.state_dict(), llama.config, 0, 1)),
                 SharedState(config_yaml=f"model:\n  path: {model_dir}\n"))
    restored = read_rank(run_dir / "checkpoints" / "step-4", "trainer/dp0/tp0/pp0")
    assert restored.critic.keys() == critic.keys() and all(torch.equal(restored.critic[k], critic[k]) for k in critic)
    assert torch.equal(restored.critic_optim["output_layer.bias.exp_avg"], torch.ones(1))
    assert restored.critic_optim_meta == {"kind": "test"}
    assert not read_rank(run_dir / "checkpoints" / "step-5", "trainer/dp0/tp0/pp0").critic
    export_critic(run_dir, 4, tmp_path / "out")
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "out").eval()
    assert type(model).__name__ == "LlamaForTokenClassification" and model.config.num_labels == 1
    torch.testing.assert_close(model.score.weight.detach(), critic["output_layer.weight"], rtol=0, atol=0)
    backbone = {k: v for k, v in llama.state_dict().items() if k != "lm_head.weight"}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in backbone.items())
    with pytest.raises(CheckpointError, match="holds no value model"):
        export_critic(run_dir, 5, tmp_path / "none")
