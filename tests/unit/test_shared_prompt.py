"""The shared-prompt forward (train/shared_prompt.py) computes what the padded rows compute: the same
response logprobs and entropies, the same gradients, the same policy update; and it runs only on models
whose positions it can state."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.mpi.convert_tp2_worker import TINY_CASES, tiny_hf_model
from tests.unit.same_update import assert_same_update, linear_steps, parameters
from yatt_hpc.batch import SampleBatch
from yatt_hpc.config.schema import TrainConfig

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


def _grouped_batch(vocab: int, seed: int = 0) -> tuple[SampleBatch, np.ndarray]:
    """Three prompts (two of the same length, one longer), groups of 4, 1 and 3 samples interleaved, with an
    empty and a one-token response among them."""
    rng = np.random.default_rng(seed)
    prompts = {7: rng.integers(3, vocab, 5), 8: rng.integers(3, vocab, 9), 9: rng.integers(3, vocab, 5)}
    order = [7, 8, 7, 9, 7, 9, 7, 9]
    lengths = [3, 4, 1, 2, 0, 6, 7, 5]
    responses = [rng.integers(3, vocab, n) for n in lengths]
    batch = SampleBatch(
        sample_id=np.arange(len(order), dtype=np.int64), prompt_id=np.array(order, np.int64),
        prompt_len=np.array([len(prompts[g]) for g in order], np.int32),
        prompt_tokens=np.concatenate([prompts[g] for g in order]).astype(np.int32),
        response_len=np.array(lengths, np.int32), response_tokens=np.concatenate(responses).astype(np.int32),
        logprobs=rng.uniform(-4, -1, sum(lengths)).astype(np.float32))
    return batch, rng.standard_normal(len(order)).astype(np.float32)


def _padded_response_values(batch: SampleBatch, values: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's response-aligned slice of a padded [N, L-1] tensor (target j at prompt_len - 1 + j)."""
    return [values[i, p - 1:p - 1 + r] for i, (p, r) in enumerate(zip(batch.prompt_len, batch.response_len))]


def test_layout_holds_each_prompt_once():
    from yatt_hpc.train.shared_prompt import build_layout

    batch, _ = _grouped_batch(50)
    layout = build_layout(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"), batch.prompt_id)
    assert layout.prompts == 3
    assert len(layout.tokens) == 5 + 9 + 5 + sum(max(int(r) - 1, 0) for r in batch.response_len)
    for i, (p, r) in enumerate(zip(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"))):
        n = len(r)
        assert layout.targets[i, :n].tolist() == r.tolist() and layout.mask[i].sum() == n
        if n:  # the first token is predicted from the prompt's last token, at its position
            assert layout.tokens[layout.source[i, 0]] == p[-1] and layout.positions[layout.source[i, 0]] == len(p) - 1
            # then from the response's own tokens at positions P, P+1, ...
            assert layout.tokens[layout.source[i, 1:n]].tolist() == r[:-1].tolist()
            assert layout.positions[layout.source[i, 1:n]].tolist() == list(range(len(p), len(p) + n - 1))
    # the same text in two groups (two images, say) is two prompts; equal tokens without group ids are one
    same = [np.arange(3, 9)] * 4
    answers = [np.array([5, 6]), np.array([7]), np.array([8, 9, 10]), np.array([11])]
    assert build_layout(same, answers, np.array([4, 4, 5, 5])).prompts == 2
    assert build_layout(same, answers).prompts == 1


@pytest.mark.parametrize("case", [pytest.param(name, id=name) for name in TINY_CASES])
def test_shared_forward_gives_the_padded_logprobs_entropies_and_gradients(one_rank_world, case):
    """GPT-2 (learned positions) and the RoPE families (Llama-3 and linear scaling, GQA, Qwen2's qkv bias,
    Qwen3's q/k norms, untied heads, padded vocabularies)."""
    from yatt_hpc.train import convert, shared_prompt
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.logprobs import token_logprobs_and_entropy
    from yatt_hpc.train.step_plan import pack_micro_batch

    hf = tiny_hf_model(case, seed=3)
    model = mm.build_gpt_model(hf.config, 1)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1))
    vocab = hf.config.vocab_size
    batch, _ = _grouped_batch(vocab)
    weights = [torch.randn(int(r), generator=torch.Generator().manual_seed(i)) for i, r in enumerate(batch.response_len)]

    tokens, _, _ = pack_micro_batch(batch)
    model.zero_grad(set_to_none=True)
    logp, ent = token_logprobs_and_entropy(mm.forward_logits(model, tokens[:, :-1]), tokens[:, 1:], None, vocab)
    padded_logp, padded_ent = _padded_response_values(batch, logp), _padded_response_values(batch, ent)
    sum(((lp + 0.3 * e) * w).sum() for lp, e, w in zip(padded_logp, padded_ent, weights)).backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    layout = shared_prompt.build_layout(batch.ragged("prompt_tokens"), batch.ragged("response_tokens"),
                                        batch.prompt_id)
    logits = shared_prompt.forward_shared(model, layout)
    assert logits.shape[0] == len(layout.tokens) < tokens[:, :-1].numel()
    # the trainer's call: the output layer projects the predicting positions only, in [N, R] order
    projected = []
    hook = model.output_layer.register_forward_hook(lambda layer, args, out: projected.append(out[0].shape[0]))
    picked = shared_prompt.forward_shared(model, layout, rows=layout.source)
    hook.remove()
    assert projected == [layout.source.numel()] and picked.shape == (*layout.source.shape, logits.shape[-1])
    torch.testing.assert_close(picked, logits[layout.source], atol=1e-6, rtol=1e-5)
    s_logp, s_ent = token_logprobs_and_entropy(picked, layout.targets, None, vocab)
    for i, r in enumerate(batch.response_len):
        torch.testing.assert_close(s_logp[i, :r], padded_logp[i].detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s_ent[i, :r], padded_ent[i].detach(), atol=1e-5, rtol=1e-5)
    sum(((s_logp[i, :r] + 0.3 * s_ent[i, :r]) * w).sum()
        for i, (r, w) in enumerate(zip(batch.response_len, weights))).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    # the check can fail: responses placed one position further from their prompts give other logprobs
    in_prompt = torch.zeros(len(layout.tokens), dtype=torch.bool)
    in_prompt[layout.prompt_rows.reshape(-1)] = True  # (padding indexes token 0, the first prompt's first)
    layout.positions[~in_prompt] += 1
    shifted, _ = token_logprobs_and_entropy(shared_prompt.forward_shared(model, layout)[layout.source],
                                            layout.targets, None, vocab)
    assert (shifted - s_logp).abs().max() > 1e-3


def _policy(share: bool):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    cfg = TrainConfig(lr=0.1, micro_batch_size=5, kl_coef=0.01, entropy_coef=0.01, share_prompts=share)
    return linear_steps(MegatronPolicy.from_hf(DEMO / "policy", 0, 1, cfg))  # tests/unit/same_update.py


def test_policy_update_is_the_same_with_shared_prompts(one_rank_world):
    shared, padded = _policy(True), _policy(False)
    assert shared.share_prompts and not padded.share_prompts
    fed: dict[str, list[int]] = {"shared": [], "padded": []}  # token ids each policy's forward embeds

    def counter(out: list[int]):
        return lambda _module, _args, kwargs: out.append(kwargs["input_ids"].numel())

    for name, policy in (("shared", shared), ("padded", padded)):
        policy.model.embedding.register_forward_pre_hook(counter(fed[name]), with_kwargs=True)
    batch, adv = _grouped_batch(shared.vocab_size, seed=1)
    before = parameters(padded)
    for _ in range(2):  # the second update also differs from the reference: the KL term is live
        a, b = shared.update(batch, adv), padded.update(batch, adv)
        for key in ("loss", "kl", "entropy", "clip_frac", "grad_norm", "tokens", "logp_diff_max"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-4, abs=1e-6), key
    assert a.kl > 0
    # the setting takes effect: the shared forward embedded each prompt once, the padded one per sample
    assert 0 < sum(fed["shared"]) < 0.7 * sum(fed["padded"])
    # the two updates moved every parameter the same way (a 1% error in the advantages fails this 4x over;
    # the two paths use a sixth of the tolerance)
    assert_same_update(shared, padded, before)
