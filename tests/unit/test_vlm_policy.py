"""The trainer's policy on a vision-language model: images in the batch as encoded bytes, decoded per group
on the trainer rank; the tower frozen or trained by `train.train_vision_tower`.

    .venv/bin/python -m pytest tests/unit/test_vlm_policy.py -q
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.unit.same_update import assert_same_update, linear_steps, parameters
from yatt_hpc.batch import SampleBatch, image_columns
from yatt_hpc.config.schema import TrainConfig
from yatt_hpc.demo.tiny_vlm import IMAGE_PAD_ID, save_tiny_vlm, tiny_qwen2_vl
from yatt_hpc.vision.processor import VISION_MARK, ImageProcessor

N = 2  # samples per prompt


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vlm") / "policy"
    save_tiny_vlm(tiny_qwen2_vl(seed=0), directory)
    return directory


def _png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _batch(vlm_dir) -> SampleBatch:
    """Two prompt groups of N samples: one image each, the responses differ per sample."""
    from yatt_hpc.data.tokenizer import load_tokenizer

    tok, proc = load_tokenizer(vlm_dir), ImageProcessor.from_model_dir(vlm_dir)
    images = [[_png(1)], [_png(2)]]
    prompts = [proc.expand(tok.encode(f"{VISION_MARK}how many red?"), [(56, 56)]) for _ in images]
    responses = [tok.encode(s) for s in ("1", "22", "3", "44")]
    rep = np.repeat(np.arange(len(images)), N)
    return SampleBatch(
        sample_id=np.arange(len(rep)), prompt_id=rep, owner=np.zeros(len(rep), np.int32),
        prompt_len=np.array([len(prompts[i]) for i in rep], np.int32),
        prompt_tokens=np.concatenate([prompts[i] for i in rep]).astype(np.int32),
        response_len=np.array([len(r) for r in responses], np.int32),
        response_tokens=np.concatenate(responses).astype(np.int32),
        logprobs=np.zeros(sum(map(len, responses)), np.float32),
        **image_columns(images, N))


def _policy(vlm_dir, one_rank_world, **train):
    from yatt_hpc.train.policy import MegatronPolicy

    torch.manual_seed(0)
    return MegatronPolicy.from_hf(vlm_dir, 0, 1, TrainConfig(micro_batch_size=3, lr=1e-2, **train))


def test_images_ride_once_per_group_as_their_encoded_bytes(vlm_dir):
    batch = _batch(vlm_dir)
    assert batch.image_count.tolist() == [1, 0, 1, 0]
    groups = batch.group_images()
    assert [g[0].tobytes() for g in groups.values()] == [_png(1), _png(2)]
    assert batch.images.nbytes == len(_png(1)) + len(_png(2))  # no pixel values, no per-sample copies
    moved = batch.select(np.array([3, 2]))  # a group moved whole keeps its carrier
    assert moved.group_images()[1][0].tobytes() == _png(2)


def test_policy_logprobs_on_image_prompts_equal_hf(vlm_dir, one_rank_world):
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.logprobs import token_logprobs_and_entropy
    from yatt_hpc.train.step_plan import pack_micro_batch

    policy = _policy(vlm_dir, one_rank_world)
    batch = _batch(vlm_dir)
    tokens, mask, _ = pack_micro_batch(batch)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        images = policy.vision_inputs(batch, inputs, policy._group_pixels(batch))
        ours, _ = token_logprobs_and_entropy(mm.forward_logits(policy.model, inputs, images=images), targets,
                                             policy.tp_group, policy.vocab_size, 1.0)
        hf = tiny_qwen2_vl(seed=0)
        pixels, grids = images.pixel_values, images.image_grid_thw
        logits = hf(input_ids=inputs, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(inputs == IMAGE_PAD_ID).int()).logits
        theirs = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert grids.tolist() == [[1, 4, 4]] * 4  # every row gets its group's image
    assert ((ours - theirs).abs() * mask).max().item() <= 1e-4


@pytest.mark.parametrize("train_tower", [False, True])
def test_train_vision_tower_decides_whether_the_tower_moves(vlm_dir, one_rank_world, train_tower):
    policy = _policy(vlm_dir, one_rank_world, train_vision_tower=train_tower)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    batch = _batch(vlm_dir)
    policy.update(batch, np.array([1.0, -1.0, 0.5, -0.5]))
    moved = {n for n, p in policy.model.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("decoder.") for n in moved)
    assert any(n.startswith("visual.") for n in moved) == train_tower
    synced = {n for n, _ in policy.hf_weights()}
    assert any(n.startswith("visual.") for n in synced) == train_tower


def test_train_vision_tower_on_a_text_model_is_refused(tmp_path, one_rank_world):
    from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model
    from yatt_hpc.train.policy import MegatronPolicy

    save_char_model(char_gpt2(seed=0), tmp_path / "text")
    with pytest.raises(ValueError, match="train.train_vision_tower=true but model.path=.* has no vision tower"):
        MegatronPolicy.from_hf(tmp_path / "text", 0, 1, TrainConfig(train_vision_tower=True))


def test_an_image_pad_the_policy_sampled_is_text_in_the_trainer_as_in_the_engine(vlm_dir, one_rank_world):
    """At temperature > 1 a policy can sample <|image_pad|>: the engine embeds it as a token at the next text
    position, so the trainer must too (it is not an image slot)."""
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.logprobs import token_logprobs_and_entropy
    from yatt_hpc.train.step_plan import pack_micro_batch

    policy = _policy(vlm_dir, one_rank_world)
    batch = _batch(vlm_dir).select(np.array([0]))
    batch.response_tokens = np.array([IMAGE_PAD_ID, batch.response_tokens[0]], np.int32)
    batch.response_len = np.array([2], np.int32)
    batch.logprobs = np.zeros(2, np.float32)
    tokens, mask, _ = pack_micro_batch(batch)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        images = policy.vision_inputs(batch, inputs, policy._group_pixels(batch))
        assert int(images.image_mask.sum()) == 4 and int((inputs == IMAGE_PAD_ID).sum()) == 5
        ours, _ = token_logprobs_and_entropy(mm.forward_logits(policy.model, inputs, images=images), targets,
                                             policy.tp_group, policy.vocab_size, 1.0)
        hf = tiny_qwen2_vl(seed=0)
        embeds = hf.model.get_input_embeddings()(inputs)
        features = hf.model.get_image_features(images.pixel_values, images.image_grid_thw).pooler_output[0]
        embeds[images.image_mask] = features
        logits = hf(inputs_embeds=embeds, position_ids=images.position_ids).logits
        theirs = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    last = int(batch.prompt_len[0])  # the sampled pad sits at the end of the prompt + 1: a text position
    assert images.position_ids[0, 0, last].item() == images.position_ids[0, 0, last - 1].item() + 1
    assert ((ours - theirs).abs() * mask).max().item() <= 1e-4


@pytest.mark.parametrize("train_tower", [False, True])
def test_shared_prompt_update_on_image_prompts_equals_the_padded_update(vlm_dir, one_rank_world, train_tower):
    """Each group's image prompt goes through the tower and the decoder once (train/shared_prompt.py): the
    same update as the padded rows, with a group split over two micro-batches (3 + 1 samples) and an image
    pad the policy sampled (text, not an image slot)."""
    shared = _policy(vlm_dir, one_rank_world, train_vision_tower=train_tower, share_prompts=True)
    padded = _policy(vlm_dir, one_rank_world, train_vision_tower=train_tower, share_prompts=False)
    assert shared.share_prompts and not padded.share_prompts
    embedded: dict[str, list[int]] = {"shared": [], "padded": []}
    for name, policy in (("shared", shared), ("padded", padded)):
        policy.model.embedding.register_forward_pre_hook(
            (lambda out: lambda _m, _a, kw: out.append(kw["input_ids"].numel()))(embedded[name]), with_kwargs=True)
    batch = _batch(vlm_dir)
    responses = batch.ragged("response_tokens")
    responses[1] = np.array([IMAGE_PAD_ID, *responses[1]], np.int32)
    batch.response_tokens = np.concatenate(responses).astype(np.int32)
    batch.response_len = np.array([len(r) for r in responses], np.int32)
    batch.response_mask = np.ones(batch.response_tokens.size, np.uint8)  # every token sampled
    batch.token_version = np.zeros(batch.response_tokens.size, np.int32)
    batch.logprobs = np.full(int(batch.response_len.sum()), -3.0, np.float32)
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    before = parameters(padded)
    a, b = linear_steps(shared).update(batch, adv), linear_steps(padded).update(batch, adv)
    for key in ("loss", "entropy", "clip_frac", "grad_norm", "tokens", "logp_diff_max"):
        assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-4, abs=1e-6), key
    assert 0 < sum(embedded["shared"]) < sum(embedded["padded"])
    assert_same_update(shared, padded, before)  # tests/unit/same_update.py
