"""The trainer's precision bookkeeping on CPU (`model.dtype`): bf16 parameters, fp32 master weights and
AdamW state, bf16 weights out to the engines, fp32 masters in checkpoints; and the trainer scoring at
the rollout's temperature."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.batches import random_update_batch as _batch
from yatt_hpc.config.schema import TrainConfig

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"




def _policy(dtype=torch.float32, temperature=1.0):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    return MegatronPolicy.from_hf(DEMO / "policy", 0, 1, TrainConfig(lr=1e-3, micro_batch_size=4),
                                  dtype=dtype, temperature=temperature)


def test_bf16_model_keeps_fp32_masters_and_optimizer_state(one_rank_world):
    policy = _policy(torch.bfloat16)
    assert policy.mixed and {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in policy.master.values()} == {torch.float32}
    start = {n: m.clone() for n, m in policy.master.items()}
    batch, adv = _batch(policy.hf_config.vocab_size)
    stats = policy.update(batch, adv)
    assert math.isfinite(stats.loss) and stats.grad_norm > 0
    state = [s for s in policy.optimizer.state.values()]
    assert state and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in state)
    assert all(p.grad is None for p in policy.model.parameters())  # gradients live on the masters
    moved = 0
    for name, p in policy.model.named_parameters():
        master = policy.master[name]
        assert torch.equal(p, master.to(torch.bfloat16)), name   # the model is the masters, rounded
        moved += int(not torch.equal(master, start[name]))
    assert moved > 0
    # the optimizer moves the masters by less than bf16 can resolve: only fp32 masters keep such steps
    small = [n for n in start if 0 < (policy.master[n] - start[n]).abs().max() < 1e-3]
    assert small


def test_checkpoint_tensors_are_the_fp32_masters_and_load_back_exactly(one_rank_world):
    policy, other = _policy(torch.bfloat16), _policy(torch.bfloat16)
    batch, adv = _batch(policy.hf_config.vocab_size)
    policy.update(batch, adv)
    saved = policy.checkpoint_tensors()
    params = dict(policy.model.named_parameters())
    assert all(saved[n].dtype == torch.float32 and torch.equal(saved[n], policy.master[n]) for n in params)
    other.load_checkpoint_tensors(saved)
    for name, p in other.model.named_parameters():
        assert torch.equal(other.master[name], policy.master[name]) and torch.equal(p, params[name]), name


def test_bf16_weights_go_to_the_engines_in_bf16(one_rank_world):
    policy = _policy(torch.bfloat16)
    weights = list(policy.hf_weights())
    assert weights and {t.dtype for _, t in weights} == {torch.bfloat16}


def test_fp32_model_has_no_separate_masters(one_rank_world):
    policy = _policy()
    assert not policy.mixed
    assert all(policy.master[n] is p for n, p in policy.model.named_parameters())


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_policy_scores_tokens_at_the_rollout_temperature(one_rank_world, temperature):
    """The trainer's logprobs equal the engine's, which sample at `temperature`."""
    from yatt_hpc.rollout import GenerationRequest, build_engine
    from yatt_hpc.train import megatron_model
    from yatt_hpc.train.logprobs import token_logprobs_and_entropy

    policy = _policy(temperature=temperature)
    engine = build_engine("hf", str(DEMO / "policy"), device="cpu", tp_size=1, seed=0)
    prompt = np.array([5, 6, 7, 8, 9], np.int32)
    result = engine.generate([GenerationRequest(0, prompt, max_new_tokens=8, temperature=temperature)])[0]
    ids = torch.from_numpy(np.concatenate([prompt, result.response_ids]).astype(np.int64))[None]
    with torch.no_grad():
        logits = megatron_model.forward_logits(policy.model.eval(), ids[:, :-1])
        logp, _ = token_logprobs_and_entropy(logits, ids[:, 1:], policy.tp_group, policy.hf_config.vocab_size,
                                             policy.temperature)
    got = logp[0, len(prompt) - 1:].numpy()
    assert np.abs(got - result.logprobs).max() < 1e-4
    with torch.no_grad():  # and at temperature 1 they would not agree: the check has teeth
        plain, _ = token_logprobs_and_entropy(logits, ids[:, 1:], policy.tp_group, policy.hf_config.vocab_size, 1.0)
    assert np.abs(plain[0, len(prompt) - 1:].numpy() - result.logprobs).max() > 1e-2


@pytest.mark.parametrize("grad_clip", [1e-3, 0.0])  # clipped, and not
def test_a_bf16_step_at_dp1_makes_one_master_gradient_at_a_time_with_the_same_weights(one_rank_world, grad_clip):
    """One replica has nothing to all-reduce, so its fp32 master gradients are made, clipped, stepped and dropped
    one parameter at a time (optimizer_step.py `_streamed_mixed_step`): the same norm, masters, bf16 weights and
    AdamW state, bitwise, as the step that holds them all."""
    from yatt_hpc.train.policy import MegatronPolicy

    def policy():
        torch.manual_seed(0)
        return MegatronPolicy.from_hf(DEMO / "policy", 0, 1, TrainConfig(lr=1e-3, micro_batch_size=4, grad_clip=grad_clip),
                                      dtype=torch.bfloat16)

    streamed, held = policy(), policy()
    held._streams_master_grads = lambda: False
    assert streamed._streams_master_grads()
    most, buffers = [], set()

    def step(real=streamed.optimizer.step):
        grads = [m.grad for m in streamed.master.values() if m.grad is not None]
        most.append(len(grads))
        buffers.update(g.untyped_storage().data_ptr() for g in grads)
        real()

    streamed.optimizer.step = step

    batch, adv = _batch(streamed.hf_config.vocab_size)
    for _ in range(2):
        buffers.clear()
        a, b = streamed.update(batch, adv), held.update(batch, adv)
        assert a.grad_norm == b.grad_norm and a.loss == b.loss
        assert len(buffers) == 1  # every master gradient of the update is a view of its one buffer
    assert not grad_clip or a.grad_norm > grad_clip  # the clipped case clips
    assert most and max(most) == 1  # never more than one fp32 master gradient
    for name, p in streamed.model.named_parameters():
        assert torch.equal(p, dict(held.model.named_parameters())[name]), name
        assert torch.equal(streamed.master[name], held.master[name]), name
    for name in streamed.master:  # each parameter's own AdamW state
        s, h = streamed.optimizer.state[streamed.master[name]], held.optimizer.state[held.master[name]]
        assert all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(h[k])) for k in ("exp_avg", "exp_avg_sq", "step"))
