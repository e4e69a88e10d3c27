"""The HF engine honours the BaseEngine contract on a tiny random GPT-2 (no download, CPU).

Run: .venv/bin/python -m pytest tests/unit/test_hf_engine.py
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from yatt_hpc.rollout import GenerationRequest, build_engine
from yatt_hpc.rollout.sampling import _inverse_cdf, sample_next_tokens

EOS = 2
VOCAB = 64


def _save_tiny_gpt2(path, seed: int) -> str:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=4096, bos_token_id=1, eos_token_id=EOS
    )
    torch.manual_seed(seed)
    GPT2LMHeadModel(config).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _save_tiny_gpt2(tmp_path_factory.mktemp("gpt2_a"), seed=0)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> str:
    return _save_tiny_gpt2(tmp_path_factory.mktemp("gpt2_b"), seed=1)


@pytest.fixture(scope="module")
def engine(model_dir):
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as eng:
        yield eng


def _requests(count: int = 12, max_new_tokens: int = 24, **kwargs) -> list[GenerationRequest]:
    rng = np.random.default_rng(123)
    return [
        GenerationRequest(
            sample_id=i,
            prompt_ids=rng.integers(3, VOCAB, size=int(rng.integers(1, 9))),
            max_new_tokens=max_new_tokens,
            seed=1000 + i,
            **kwargs,
        )
        for i in range(count)
    ]


def _teacher_forced_logprobs(model, result, temperature: float) -> np.ndarray:
    ids = torch.tensor(np.concatenate([result.prompt_ids, result.response_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    start = len(result.prompt_ids) - 1
    logprobs = torch.log_softmax(logits[start:-1], dim=-1)
    return logprobs.gather(1, torch.from_numpy(result.response_ids).long()[:, None]).squeeze(1).numpy()


def test_generate_returns_one_result_per_request_in_request_order(engine):
    requests = _requests()
    results = engine.generate(requests)
    assert [r.sample_id for r in results] == [q.sample_id for q in requests]
    for request, result in zip(requests, results):
        assert result.response_ids.dtype == np.int32 and result.logprobs.dtype == np.float32
        assert result.response_ids.shape == result.logprobs.shape
        assert 1 <= len(result.response_ids) <= request.max_new_tokens
        np.testing.assert_array_equal(result.prompt_ids, request.prompt_ids)
        assert result.weight_version == 0
        assert np.all(result.logprobs <= 0)


def test_eos_ends_the_response_and_is_kept(engine):
    results = engine.generate(_requests(count=32, max_new_tokens=32))
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}, reasons  # 32 x 32 draws from a 64-token vocabulary hit eos
    for result in results:
        body = result.response_ids[:-1]
        assert EOS not in body
        if result.finish_reason == "stop":
            assert result.response_ids[-1] == EOS
        else:
            assert len(result.response_ids) == 32 and result.response_ids[-1] != EOS


@pytest.mark.parametrize("temperature", [pytest.param(1.0, id="t1"), pytest.param(0.7, id="t0.7")])
def test_logprobs_equal_a_teacher_forced_forward_pass(engine, model_dir, temperature):
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for result in engine.generate(_requests(temperature=temperature)):
        expected = _teacher_forced_logprobs(reference, result, temperature)
        np.testing.assert_allclose(result.logprobs, expected, rtol=0, atol=1e-5)


def test_same_seeds_give_same_samples_whatever_the_batch_order_or_size(engine):
    requests = _requests(count=10) + _requests(count=4, top_p=0.8)[2:]
    forward = engine.generate(requests)
    backward = engine.generate(requests[::-1])[::-1]
    one_by_one = [engine.generate([r])[0] for r in requests]
    for a, b, c in zip(forward, backward, one_by_one):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.response_ids, c.response_ids)
        # Different padding changes fp32 reduction order only.
        np.testing.assert_allclose(a.logprobs, c.logprobs, rtol=0, atol=1e-6)


def test_finished_rows_leave_the_micro_batch_and_the_others_sample_as_alone(engine, monkeypatch):
    # Rows end at different steps (their own max_new_tokens, or EOS): the micro-batch sheds them as it
    # goes, and what every row samples is what it samples alone.
    requests = [GenerationRequest(sample_id=i, prompt_ids=np.array([3 + i, 4, 5 + i]), max_new_tokens=1 + 3 * i,
                                  seed=50 + i) for i in range(10)]
    widths, forward = [], engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, *a, **kw: widths.append(len(ids)) or forward(ids, *a, **kw))
    together = engine.generate(requests)
    assert widths[0] == 10 and widths[-1] < 10 and widths == sorted(widths, reverse=True), widths
    monkeypatch.undo()
    for request, got in zip(requests, together):
        alone = engine.generate([request])[0]
        assert len(got.response_ids) <= request.max_new_tokens
        np.testing.assert_array_equal(got.response_ids, alone.response_ids)
        np.testing.assert_allclose(got.logprobs, alone.logprobs, rtol=0, atol=1e-6)
        assert got.finish_reason == alone.finish_reason


def test_requests_sharing_a_prompt_prefill_it_once_and_each_samples_as_alone(engine, monkeypatch):
    # A prompt group's n requests (same tokens, own seeds) are prefilled as one row, then decode as n rows.
    prompts = [np.array([3, 4, 5]), np.array([6, 7, 8])]
    requests = [GenerationRequest(sample_id=i, prompt_ids=prompts[i % 2].copy(), max_new_tokens=8, seed=70 + i)
                for i in range(8)]
    shapes, forward = [], engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, *a, **kw: shapes.append(tuple(ids.shape)) or forward(ids, *a, **kw))
    together = engine.generate(requests)
    assert shapes[:2] == [(2, 3), (8, 1)], shapes
    monkeypatch.undo()
    assert len({tuple(r.response_ids) for r in together}) > 2  # the seeds, not the shared prefill, decide
    for request, got in zip(requests, together):
        alone = engine.generate([request])[0]
        np.testing.assert_array_equal(got.response_ids, alone.response_ids)
        np.testing.assert_allclose(got.logprobs, alone.logprobs, rtol=0, atol=1e-6)


def test_different_seeds_give_different_samples(engine):
    prompt = [5, 6, 7]
    results = engine.generate(
        [GenerationRequest(sample_id=i, prompt_ids=prompt, max_new_tokens=16, seed=i) for i in range(8)]
    )
    assert len({tuple(r.response_ids) for r in results}) > 1


def test_unseeded_requests_derive_their_seed_from_engine_seed_and_sample_id(engine):
    request = GenerationRequest(sample_id=3, prompt_ids=[4, 5], max_new_tokens=16)
    first, second = engine.generate([request]), engine.generate([request])
    np.testing.assert_array_equal(first[0].response_ids, second[0].response_ids)
    assert request.effective_seed(0) != request.effective_seed(1)


def test_top_p_draws_only_inside_the_nucleus_and_temperature_zero_is_greedy():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(400, 1)
    uniform = torch.rand(400, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(400)
    tokens, logprobs = sample_next_tokens(logits, ones, torch.full((400,), 0.7), uniform)
    assert set(tokens.tolist()) == {1, 3}  # 0.5 + 0.3 covers 0.7
    np.testing.assert_allclose(logprobs.exp().numpy(), np.where(tokens.numpy() == 1, 0.5, 0.3), rtol=1e-5)
    tokens, _ = sample_next_tokens(logits, ones, ones, uniform)
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    tokens, logprobs = sample_next_tokens(logits, torch.zeros(400), ones, uniform)
    assert set(tokens.tolist()) == {1}
    np.testing.assert_allclose(logprobs.numpy(), np.log(0.5), rtol=1e-5)


def test_plain_sampling_is_the_general_path_at_temperature_one_without_top_p():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 4
    uniform = torch.rand(64, generator=torch.Generator().manual_seed(2))
    ones = torch.ones(64)
    general, plain = (sample_next_tokens(logits, ones, ones, uniform, plain=p) for p in (False, True))
    assert torch.equal(general[0], plain[0]) and torch.equal(general[1], plain[1])


def test_a_draw_at_the_total_takes_the_last_token_with_weight():
    # u * total rounding up to total puts searchsorted past the end; trailing tokens of weight 0 are never drawn
    weights = torch.tensor([[0.1, 0.3, 0.6, 0.0, 0.0], [0.2, 0.0, 0.3, 0.5, 0.0]])
    assert _inverse_cdf(weights, torch.tensor([1.0, 1.0])).tolist() == [2, 3]
    assert _inverse_cdf(weights, torch.tensor([0.0, 0.25])).tolist() == [0, 2]  # no row past the end


def test_update_weights_makes_the_engine_serve_the_new_model_exactly(model_dir, other_model_dir):
    new_model = AutoModelForCausalLM.from_pretrained(other_model_dir)
    # named_parameters() lists a tied tensor once (transformer.wte, not lm_head): exercises tying.
    named = list(new_model.named_parameters())
    half = len(named) // 2
    requests = _requests()
    with (
        build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine,
        build_engine("hf", other_model_dir, device="cpu", tp_size=1, seed=0) as reference,
    ):
        before = engine.generate(requests)
        engine.update_weights(((n, p.detach()) for n, p in named[:half]), final=False)
        engine.update_weights(((n, p.detach()) for n, p in named[half:]), final=True)
        after, expected = engine.generate(requests), reference.generate(requests)
        assert engine.weight_version == 1
    assert any(not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(before, after))
    for got, want in zip(after, expected):
        np.testing.assert_array_equal(got.response_ids, want.response_ids)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        assert got.weight_version == 1


def test_update_weights_takes_an_explicit_version_on_the_final_bucket(model_dir):
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine:
        engine.update_weights([], final=True, version=7)
        assert engine.weight_version == 7
        assert engine.generate(_requests(count=1))[0].weight_version == 7


def test_unknown_weight_name_raises_and_loads_nothing_of_the_bucket(model_dir):
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine:
        before = engine.generate(_requests())
        bucket = [("transformer.ln_f.weight", torch.zeros(32)), ("transformer.h.0.attn.c_atn.weight", torch.zeros(1))]
        with pytest.raises(ValueError, match=r"unknown weight name 'transformer\.h\.0\.attn\.c_atn\.weight'.*c_attn"):
            engine.update_weights(bucket, final=True)
        after = engine.generate(_requests())
        assert engine.weight_version == 0
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)


def test_shape_mismatch_raises_naming_both_shapes(model_dir):
    with (
        build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine,
        pytest.raises(ValueError, match=r"'transformer\.ln_f\.weight'.*\(32,\).*\(16,\)"),
    ):
        engine.update_weights([("transformer.ln_f.weight", torch.zeros(16))], final=True)


def test_tied_names_with_different_values_raise(model_dir):
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine:
        bucket = [("transformer.wte.weight", torch.zeros(VOCAB, 32)), ("lm_head.weight", torch.ones(VOCAB, 32))]
        with pytest.raises(ValueError, match="tied"):
            engine.update_weights(bucket, final=True)


def test_generate_refuses_to_run_between_buckets_of_one_version(model_dir):
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine:
        engine.update_weights([("transformer.ln_f.bias", torch.zeros(32))], final=False)
        with pytest.raises(RuntimeError, match="final=True"):
            engine.generate(_requests(count=1))
        engine.update_weights([], final=True)
        engine.generate(_requests(count=1))


def test_on_result_reports_each_request_once_as_it_finishes(engine):
    requests = _requests(count=32, max_new_tokens=32)
    seen: list[tuple[int, int]] = []  # (sample id, finished rows when it was reported)
    results = engine.generate(requests, on_result=lambda r: seen.append((r.sample_id, len(seen))))
    assert sorted(i for i, _ in seen) == [q.sample_id for q in requests], "each result exactly once"
    by_id = {r.sample_id: r for r in results}
    order = [i for i, _ in seen]
    # one micro-batch: rows come out in the order they finish, shorter responses first
    lengths = [len(by_id[i].response_ids) for i in order]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1], lengths
    # and the streamed results are the ones returned, equal to a run without the callback
    plain = engine.generate(requests)
    for a, b in zip(plain, results):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        assert a.finish_reason == b.finish_reason


def test_on_result_reports_aborted_rows_at_the_end(model_dir):
    requests = _requests(count=4, max_new_tokens=4000)
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0, stop_token_ids=[]) as engine:
        seen: list = []
        worker = threading.Thread(target=lambda: engine.generate(requests, on_result=seen.append))
        worker.start()
        while worker.is_alive():
            engine.abort()
            time.sleep(0.01)
        worker.join()
    assert sorted(r.sample_id for r in seen) == [0, 1, 2, 3] and {r.finish_reason for r in seen} == {"abort"}


def test_abort_from_another_thread_returns_partial_aborted_results(model_dir):
    requests = _requests(count=4, max_new_tokens=4000)
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0, stop_token_ids=[]) as engine:
        engine.abort()  # nothing in flight: must not poison the next call
        box: list = []
        worker = threading.Thread(target=lambda: box.extend(engine.generate(requests)))
        worker.start()
        while worker.is_alive():  # abort only acts once generate is in flight; keep asking until it is
            engine.abort()
            time.sleep(0.01)
        worker.join()
        assert engine.generate(_requests(count=1))[0].finish_reason != "abort"
    assert [r.finish_reason for r in box] == ["abort"] * 4
    assert all(len(r.response_ids) < 4000 for r in box)


def test_release_and_resume_memory_on_cpu(model_dir):
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine:
        before = engine.generate(_requests())
        engine.release_memory()
        with pytest.raises(RuntimeError, match="resume_memory"):
            engine.generate(_requests())
        engine.resume_memory()
        after = engine.generate(_requests())
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)


def test_dropped_weights_come_back_from_a_full_sync_and_serve_as_before(model_dir, other_model_dir):
    """CPU colocation: `drop_weights` frees every parameter until the sync's buckets refill it; the refilled engine
    serves exactly what an engine loaded with those weights serves, and nothing generates in between."""
    named = list(AutoModelForCausalLM.from_pretrained(other_model_dir).named_parameters())
    requests = _requests()
    with (
        build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine,
        build_engine("hf", other_model_dir, device="cpu", tp_size=1, seed=0) as reference,
    ):
        freed = engine.drop_weights()
        assert freed == sum(p.numel() * p.element_size() for _, p in named)  # the tied head counted once
        with pytest.raises(RuntimeError, match="after drop_weights"):
            engine.generate(requests)
        engine.update_weights(((n, p.detach()) for n, p in named[:3]), final=False)
        engine.update_weights(((n, p.detach()) for n, p in named[3:]), final=True)
        for got, want in zip(engine.generate(requests), reference.generate(requests)):
            np.testing.assert_array_equal(got.response_ids, want.response_ids)
            np.testing.assert_array_equal(got.logprobs, want.logprobs)


def test_take_weights_keeps_received_tensors_as_the_dropped_parameters(model_dir, other_model_dir):
    """`take_weights` (what a weight sync calls with the tensors it received): a dropped parameter keeps the tensor
    itself as its storage where dtype and shape fit, and one of another dtype is cast into an allocation; a
    parameter that was not dropped is copied into, never replaced. The engine then serves what one loaded with
    those weights serves."""
    named = [(n, p.detach().clone()) for n, p in AutoModelForCausalLM.from_pretrained(other_model_dir).named_parameters()]
    requests = _requests()
    with (
        build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine,
        build_engine("hf", other_model_dir, device="cpu", tp_size=1, seed=0) as reference,
    ):
        params = dict(engine._model.named_parameters())
        engine.drop_weights()
        cast = {"transformer.ln_f.weight"}  # sent in float64: the engine casts it to its own fp32
        sent = [(n, t.double() if n in cast else t) for n, t in named]
        engine.take_weights(sent[:3], final=False)
        engine.take_weights(sent[3:], final=True)
        for name, tensor in sent:
            kept = params[name].data_ptr() == tensor.data_ptr()
            assert kept == (name not in cast), name
        assert params["transformer.ln_f.weight"].dtype == torch.float32
        for got, want in zip(engine.generate(requests), reference.generate(requests)):
            np.testing.assert_array_equal(got.response_ids, want.response_ids)
            np.testing.assert_array_equal(got.logprobs, want.logprobs)

        before = {n: p.data_ptr() for n, p in params.items()}
        fresh = [(n, t.clone()) for n, t in named]
        engine.take_weights(fresh, final=True)  # nothing dropped: loaded into the engine's own storage
        assert {n: p.data_ptr() for n, p in params.items()} == before
        assert all(p.data_ptr() != t.data_ptr() for (_, t), p in zip(fresh, params.values()))


def test_a_sync_that_leaves_a_dropped_weight_unsent_raises_naming_it(model_dir, other_model_dir):
    named = list(AutoModelForCausalLM.from_pretrained(other_model_dir).named_parameters())
    with build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0) as engine:
        engine.drop_weights()
        with pytest.raises(RuntimeError, match=r"not sent: \['transformer\.ln_f\.bias'"):
            engine.update_weights(((n, p.detach()) for n, p in named if n != "transformer.ln_f.bias"), final=True)


def test_shutdown_engine_refuses_work(model_dir):
    engine = build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0)
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(_requests(count=1))


def test_request_longer_than_the_model_context_is_rejected(engine):
    with pytest.raises(ValueError, match="sample_id=9.*exceeds the model's 4096 positions"):
        engine.generate([GenerationRequest(sample_id=9, prompt_ids=[3] * 100, max_new_tokens=4000)])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="no-tokens"),
        pytest.param({"temperature": -0.1}, "temperature", id="negative-temperature"),
        pytest.param({"top_p": 0.0}, "top_p", id="zero-top-p"),
        pytest.param({"seed": -1}, "seed", id="negative-seed"),
        pytest.param({"prompt_ids": []}, "prompt_ids", id="empty-prompt"),
    ],
)
def test_invalid_request_fields_are_named_in_the_error(kwargs, field):
    fields = {"sample_id": 5, "prompt_ids": [1, 2], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=rf"sample_id=5\)\.{field}"):
        GenerationRequest(**fields)


def test_build_engine_rejects_an_unknown_kind_and_lists_the_valid_ones(model_dir):
    with pytest.raises(ValueError, match=r"unknown engine kind 'nope'; valid kinds: hf, sglang"):
        build_engine("nope", model_dir, device="cpu", tp_size=1, seed=0)


def test_hf_engine_rejects_tensor_parallelism(model_dir):
    with pytest.raises(ValueError, match="tp_size=2.*sglang"):
        build_engine("hf", model_dir, device="cpu", tp_size=2, seed=0)
