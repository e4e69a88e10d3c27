"""Rollout engines on a vision-language model: the HF engine decodes a request's encoded images itself and
scores its tokens as a teacher-forced HF forward does; SGLang gets the bytes as `image_data`.

    .venv/bin/python -m pytest tests/unit/test_vlm_engine.py -q
"""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from yatt_hpc.demo.tiny_vlm import IMAGE_PAD_ID, save_tiny_vlm, tiny_qwen2_vl
from yatt_hpc.rollout import GenerationRequest, build_engine
from yatt_hpc.rollout.sglang_engine import sglang_prompt_inputs
from yatt_hpc.vision.processor import VISION_MARK, ImageProcessor, decode_rgb


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from yatt_hpc.data.tokenizer import load_tokenizer

    directory = tmp_path_factory.mktemp("vlm") / "policy"
    save_tiny_vlm(tiny_qwen2_vl(seed=0), directory)
    engine = build_engine("hf", str(directory), device="cpu", tp_size=1, seed=0)
    yield directory, engine, load_tokenizer(directory), ImageProcessor.from_model_dir(directory)
    engine.shutdown()


def _png(seed: int, side: int = 56) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _request(tok, proc, sid: int, images: tuple[bytes, ...], text: str = "how many red?", **kw):
    sizes = [decode_rgb(b).size for b in images]
    ids = proc.expand(tok.encode(VISION_MARK * len(images) + text), sizes)
    return GenerationRequest(sample_id=sid, prompt_ids=ids, max_new_tokens=6, images=images, **kw)


def test_hf_engine_logprobs_are_a_teacher_forced_hf_forward_with_the_images(setup):
    directory, engine, tok, proc = setup
    image = (_png(1),)
    requests = [_request(tok, proc, 0, image, temperature=0.7), _request(tok, proc, 1, image, temperature=0.7),
                _request(tok, proc, 2, (), text="no image here, longer prompt", temperature=0.7)]
    results = engine.generate(requests)
    pixels, grids = proc.pixel_inputs([decode_rgb(image[0])])
    hf = tiny_qwen2_vl(seed=0)
    for request, result in zip(requests, results):
        seq = torch.tensor([np.concatenate([request.prompt_ids, result.response_ids])], dtype=torch.long)
        extra = {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.from_numpy(grids),
                 "mm_token_type_ids": (seq == IMAGE_PAD_ID).int()} if request.images else {}
        with torch.no_grad():
            logits = hf(input_ids=seq, **extra).logits[0]
        start = len(request.prompt_ids) - 1
        logp = torch.log_softmax(logits[start:start + len(result.response_ids)].float() / 0.7, -1)
        theirs = logp.gather(1, torch.from_numpy(result.response_ids.astype(np.int64))[:, None]).squeeze(1)
        assert np.abs(theirs.numpy() - result.logprobs).max() <= 1e-4, request.sample_id


def test_a_sample_does_not_depend_on_its_batch_and_the_image_changes_it(setup):
    _, engine, tok, proc = setup
    alone = engine.generate([_request(tok, proc, 5, (_png(1),), temperature=1.0, seed=11)])[0]
    mixed = engine.generate([_request(tok, proc, 6, (_png(3), _png(4)), temperature=1.0, seed=3),
                             _request(tok, proc, 5, (_png(1),), temperature=1.0, seed=11)])[1]
    assert np.array_equal(alone.response_ids, mixed.response_ids)
    assert np.abs(alone.logprobs - mixed.logprobs).max() <= 1e-5
    other = engine.generate([_request(tok, proc, 5, (_png(9),), temperature=1.0, seed=11)])[0]
    n = min(len(other.logprobs), len(alone.logprobs))
    assert not np.allclose(other.logprobs[:n], alone.logprobs[:n])  # same seed, other image: other scores


def test_a_group_sharing_prompt_and_image_is_prefilled_once_and_each_samples_as_alone(setup, monkeypatch):
    """Same tokens with another image is another prompt: three requests of one image share a prefill
    row, the fourth (other image) gets its own; every request samples what it samples alone."""
    _, engine, tok, proc = setup
    group = [_request(tok, proc, 20 + s, (_png(1),), temperature=1.0, seed=s) for s in range(3)] + \
        [_request(tok, proc, 23, (_png(2),), temperature=1.0, seed=0)]
    rows, forward = [], engine._forward
    monkeypatch.setattr(engine, "_forward", lambda ids, *a, **kw: rows.append(len(ids)) or forward(ids, *a, **kw))
    together = engine.generate(group)
    assert rows[:2] == [2, 4], rows
    monkeypatch.undo()
    for request, got in zip(group, together):
        alone = engine.generate([request])[0]
        assert np.array_equal(got.response_ids, alone.response_ids), request.sample_id
        assert np.abs(got.logprobs - alone.logprobs).max() <= 1e-5, request.sample_id


def test_images_for_a_text_model_and_wrong_pad_counts_are_refused(setup, tmp_path):
    from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model

    _, engine, tok, proc = setup
    bad = GenerationRequest(sample_id=7, prompt_ids=tok.encode(VISION_MARK + "hi"), max_new_tokens=2,
                            images=(_png(1),))  # one pad, but the image expands to 4
    with pytest.raises(ValueError, match="request sample_id=7: 1 image-pad token.*expand to 4"):
        engine.generate([bad])
    text = build_engine("hf", save_char_model(char_gpt2(seed=0), tmp_path / "text"), device="cpu", tp_size=1, seed=0)
    with pytest.raises(ValueError, match="sample_id=3 has 1 image.*text model"):
        text.generate([GenerationRequest(sample_id=3, prompt_ids=[5, 6], max_new_tokens=2, images=(_png(1),))])
    text.shutdown()


def test_sglang_gets_one_pad_per_image_and_the_bytes_as_image_data():
    prompt = [9, 2, 3, 3, 3, 3, 4, 8, 2, 3, 3, 4]
    image = _png(1)
    out = sglang_prompt_inputs([GenerationRequest(sample_id=0, prompt_ids=prompt, max_new_tokens=2,
                                                  images=(image, image))], image_token_id=3)
    assert out["input_ids"] == [[9, 2, 3, 4, 8, 2, 3, 4]]
    url = out["image_data"][0][0]
    assert base64.b64decode(url.split(",", 1)[1]) == image
    plain = sglang_prompt_inputs([GenerationRequest(sample_id=0, prompt_ids=prompt, max_new_tokens=2)], None)
    assert plain == {"input_ids": [prompt]}
    with pytest.raises(ValueError, match="no vision tower"):
        sglang_prompt_inputs([GenerationRequest(sample_id=0, prompt_ids=prompt, max_new_tokens=2,
                                                images=(image,))], None)



def test_a_vision_judge_sees_the_image_and_a_text_judge_reads_the_question_without_it(setup):
    from tests.conftest import REPO
    from yatt_hpc.reward.judge import GenRMJudge

    directory, _, _, _ = setup
    judge = GenRMJudge.from_pretrained(directory, max_new_tokens=3, template="Q: {question}\nA: {response}\nok?")
    assert judge.images is not None
    pair = [("<image>how many red?", "2")]
    sent = []
    real = judge.engine.generate
    judge.engine.generate = lambda requests: sent.extend(requests) or real(requests)
    seen = judge.generate_verdicts(pair, images=[(_png(1),)])
    other = judge.generate_verdicts(pair, images=[(_png(5),)])
    assert sent[0].images == (_png(1),) and int((sent[0].prompt_ids == IMAGE_PAD_ID).sum()) == 4
    assert np.array_equal(sent[0].prompt_ids, sent[1].prompt_ids) and sent[1].images == (_png(5),)
    assert isinstance(seen[0], str) and isinstance(other[0], str)
    judge.shutdown()
    text = GenRMJudge.from_pretrained(REPO / "models" / "demo" / "judge")
    assert text.images is None
    assert text._question("<image>reverse abcdab=", ()) == "reverse abcdab="
    assert text.score(pair, references=["2"], images=[(_png(1),)])[0] in (None, 0.0, 1.0)
    text.shutdown()
