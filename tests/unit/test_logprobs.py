"""The chunked log-prob / entropy function against plain log_softmax on the full tensor, values and gradients.

    .venv/bin/python -m pytest tests/unit/test_logprobs.py -q

The reference below is the obvious fp32 implementation (it materialises [B, T, V] several times, which
is what the real function avoids); the vocab-parallel case runs in two gloo processes on this host.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from yatt_hpc.train.logprobs import token_logprobs_and_entropy

FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-4  # same bf16 inputs on both sides, so only fp32 summation order differs


def reference_logprobs_and_entropy(logits, targets, vocab_size=None, temperature=1.0):
    z = logits[..., :vocab_size].float() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    return log_p.gather(-1, targets[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)


def _values_and_grads(fn, logits, targets, upstream, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    logp, entropy = fn(leaf, targets, **kwargs)
    (grad,) = torch.autograd.grad((logp, entropy), leaf, upstream)
    return logp, entropy, grad


def _case(seed, shape, width, dtype=torch.float32, scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, width, generator=generator)).to(dtype)
    targets = torch.randint(0, width, shape, generator=generator)
    upstream = tuple(torch.randn(*shape, generator=generator) for _ in range(2))
    return logits, targets, upstream


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("temperature", [pytest.param(t, id=f"T={t}") for t in (1.0, 0.7, 1.3)])
@pytest.mark.parametrize("chunk_tokens", [pytest.param(c, id=f"chunk={c}") for c in (1, 4, 7, 1000)])
def test_chunked_values_and_gradients_equal_full_log_softmax(temperature, chunk_tokens):
    logits, targets, upstream = _case(seed=11, shape=(3, 9), width=50)
    got = _values_and_grads(token_logprobs_and_entropy, logits, targets, upstream,
                            temperature=temperature, chunk_tokens=chunk_tokens)
    expected = _values_and_grads(reference_logprobs_and_entropy, logits, targets, upstream,
                                 temperature=temperature)
    for name, g, e in zip(("logp", "entropy", "grad"), got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        assert _max_diff(g, e) <= FP32_TOLERANCE, name


def test_padded_vocab_is_sliced_out_and_its_columns_get_exactly_zero_gradient():
    logits, targets, upstream = _case(seed=12, shape=(2, 11), width=40)
    padded = torch.cat([logits, torch.full((2, 11, 5), 9.0)], dim=-1)
    logp, entropy, grad = _values_and_grads(token_logprobs_and_entropy, padded, targets, upstream,
                                            vocab_size=40, temperature=0.7, chunk_tokens=3)
    ref = _values_and_grads(reference_logprobs_and_entropy, logits, targets, upstream, temperature=0.7)
    assert _max_diff(logp, ref[0]) <= FP32_TOLERANCE and _max_diff(entropy, ref[1]) <= FP32_TOLERANCE
    assert _max_diff(grad[..., :40], ref[2]) <= FP32_TOLERANCE
    assert torch.equal(grad[..., 40:], torch.zeros(2, 11, 5))


def test_bf16_logits_are_scored_in_fp32_and_get_a_bf16_gradient():
    logits, targets, upstream = _case(seed=13, shape=(2, 10), width=64, dtype=torch.bfloat16)
    logp, entropy, grad = _values_and_grads(token_logprobs_and_entropy, logits, targets, upstream,
                                            temperature=0.7, chunk_tokens=6)
    ref = _values_and_grads(reference_logprobs_and_entropy, logits, targets, upstream, temperature=0.7)
    assert logp.dtype == entropy.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert _max_diff(logp, ref[0]) <= BF16_TOLERANCE and _max_diff(entropy, ref[1]) <= BF16_TOLERANCE
    # the reference's gradient is also rounded to bf16 on its way into the leaf
    assert _max_diff(grad, ref[2]) <= 2 ** -8 * ref[2].abs().max().item()


def test_sliced_logits_like_the_trainers_are_read_without_a_copy_and_score_the_same():
    logits, targets, upstream = _case(seed=14, shape=(3, 8), width=30)
    full = torch.cat([logits, torch.randn(3, 1, 30)], dim=1).requires_grad_()
    logp, entropy = token_logprobs_and_entropy(full[:, :-1], targets, temperature=0.7, chunk_tokens=5)
    (grad,) = torch.autograd.grad((logp, entropy), full, upstream)
    ref = _values_and_grads(reference_logprobs_and_entropy, logits, targets, upstream, temperature=0.7)
    assert _max_diff(logp, ref[0]) <= FP32_TOLERANCE and _max_diff(entropy, ref[1]) <= FP32_TOLERANCE
    assert _max_diff(grad[:, :-1], ref[2]) <= FP32_TOLERANCE
    assert torch.equal(grad[:, -1], torch.zeros(3, 30))


def test_a_peaked_distribution_stays_finite():
    logits, targets, upstream = _case(seed=15, shape=(2, 5), width=50, scale=300.0)
    got = _values_and_grads(token_logprobs_and_entropy, logits, targets, upstream, chunk_tokens=3)
    expected = _values_and_grads(reference_logprobs_and_entropy, logits, targets, upstream)
    assert all(torch.isfinite(g).all() for g in got)
    assert _max_diff(got[0], expected[0]) <= 1e-3 and _max_diff(got[2], expected[2]) <= FP32_TOLERANCE


def test_only_the_requested_output_needs_an_upstream_gradient():
    logits, targets, upstream = _case(seed=16, shape=(2, 4), width=20)
    leaf = logits.clone().requires_grad_()
    logp, _ = token_logprobs_and_entropy(leaf, targets, chunk_tokens=3)
    (grad,) = torch.autograd.grad((logp * upstream[0]).sum(), leaf)
    ref_leaf = logits.clone().requires_grad_()
    ref_logp, _ = reference_logprobs_and_entropy(ref_leaf, targets)
    (ref_grad,) = torch.autograd.grad((ref_logp * upstream[0]).sum(), ref_leaf)
    assert _max_diff(grad, ref_grad) <= FP32_TOLERANCE


# ------------------------------------------------------------------------------ vocab-parallel, TP=2

TP_VOCAB, TP_WIDTH = 61, 31  # rank 1 holds 30 real columns and one padding column


def _tp_rank(rank: int, world: int, init: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        logits, targets, upstream = _case(seed=17, shape=(3, 7), width=TP_WIDTH * world)
        local = logits[..., rank * TP_WIDTH:(rank + 1) * TP_WIDTH]
        got = _values_and_grads(token_logprobs_and_entropy, local, targets, upstream,
                                tp_group=torch.distributed.group.WORLD, vocab_size=TP_VOCAB,
                                temperature=0.7, chunk_tokens=4)
        ref = _values_and_grads(reference_logprobs_and_entropy, logits, targets, upstream,
                                vocab_size=TP_VOCAB, temperature=0.7)
        ref_grad = torch.nn.functional.pad(ref[2], (0, TP_WIDTH * world - TP_VOCAB))
        diffs = {"logp": _max_diff(got[0], ref[0]), "entropy": _max_diff(got[1], ref[1]),
                 "grad": _max_diff(got[2], ref_grad[..., rank * TP_WIDTH:(rank + 1) * TP_WIDTH])}
        (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(diffs))
    finally:
        torch.distributed.destroy_process_group()


def test_vocab_parallel_tp2_values_and_gradients_equal_the_full_vocab_reference(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_tp_rank, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        diffs = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert all(d <= FP32_TOLERANCE for d in diffs.values()), (rank, diffs)
