"""The Qwen2-VL trainer model on CPU: Megatron-Core GPTModel with M-RoPE + HF's vision tower, against HF.

    .venv/bin/python -m pytest tests/unit/test_vlm_model.py -q

A tiny Qwen2-VL built from a config (yatt_hpc/demo/tiny_vlm.py), random images, a one-rank gloo
world; the TP=2 counterpart is tests/mpi/test_vlm_tp2.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from yatt_hpc.demo.tiny_vlm import IMAGE_PAD_ID, save_tiny_vlm, tiny_qwen2_vl
from yatt_hpc.train import convert
from yatt_hpc.vision.processor import ImageProcessor, ImageTokenError

MARK = "<|vision_start|><|image_pad|><|vision_end|>"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(HF model, its directory, our tokenizer, the image processor)."""
    from yatt_hpc.data.tokenizer import load_tokenizer

    directory = tmp_path_factory.mktemp("vlm") / "policy"
    hf = tiny_qwen2_vl(seed=0)
    save_tiny_vlm(hf, directory)
    return hf, directory, load_tokenizer(directory), ImageProcessor.from_model_dir(directory)


def _images(count: int, side: int = 56) -> list:
    rng = np.random.default_rng(7)  # seeded: the same images every run
    return [Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)) for _ in range(count)]


def _batch(tok, proc):
    """Two right-padded rows (one image; two images around text) and their images' inputs."""
    sizes = [(56, 56)]
    rows = [proc.expand(tok.encode(f"{MARK}how many red?"), sizes) + tok.encode("2"),
            proc.expand(tok.encode(f"ab{MARK}c{MARK}d"), sizes * 2)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in rows])
    pixels, grids = proc.pixel_inputs(_images(3))
    positions = np.stack([proc.mrope_positions(ids[0], grids[:1]), proc.mrope_positions(ids[1], grids[1:])], 1)
    return ids, torch.from_numpy(pixels), torch.from_numpy(grids), torch.from_numpy(positions)


def _twin(hf, directory, **kw):
    from transformers import AutoConfig

    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.policy import load_hf_state_dict

    config = AutoConfig.from_pretrained(str(directory))
    model = mm.build_gpt_model(config, tp_size=1, **kw)
    mm.load_megatron_shard(model, convert.hf_to_megatron(load_hf_state_dict(directory), config, 0, 1))
    return model.eval(), config


def test_mrope_positions_are_hf_get_rope_index(vlm):
    hf, _, tok, proc = vlm
    ids, _, grids, positions = _batch(tok, proc)
    theirs, _ = hf.model.get_rope_index(ids, (ids == IMAGE_PAD_ID).int(), image_grid_thw=grids)
    assert torch.equal(positions, theirs)


def test_megatron_vlm_logits_equal_hf_on_image_prompts(one_rank_world, vlm):
    from yatt_hpc.train import megatron_model as mm

    hf, directory, tok, proc = vlm
    ids, pixels, grids, positions = _batch(tok, proc)
    model, _ = _twin(hf, directory)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                      mm_token_type_ids=(ids == IMAGE_PAD_ID).int()).logits
        got = mm.forward_logits(model, ids, images=mm.VisionInputs(pixels, grids, positions))
        blind = mm.forward_logits(model, ids, images=mm.VisionInputs(pixels * 0, grids, positions))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE
    # the image is really read: other pixels, other logits after the first image token
    assert (blind - got).abs().max().item() > 1e-3


def test_the_vision_tower_is_frozen_unless_asked_and_then_gets_hf_gradients(one_rank_world, vlm):
    from yatt_hpc.train import megatron_model as mm

    hf, directory, tok, proc = vlm
    frozen, _ = _twin(hf, directory)
    assert not any(p.requires_grad for p in frozen.visual.parameters())
    model, _ = _twin(hf, directory, train_vision=True)
    ids, pixels, grids, positions = _batch(tok, proc)
    mm.forward_logits(model, ids, images=mm.VisionInputs(pixels, grids, positions)).float().pow(2).mean().backward()
    hf.zero_grad()
    hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
       mm_token_type_ids=(ids == IMAGE_PAD_ID).int()).logits.float().pow(2).mean().backward()
    ours = dict(model.visual.named_parameters())
    for name, param in hf.model.visual.named_parameters():
        assert (ours[name].grad - param.grad).abs().max().item() <= 1e-5 * (1 + param.grad.abs().max().item()), name
    hf.zero_grad()


def test_gathering_the_live_vlm_gives_back_the_checkpoint(one_rank_world, vlm):
    from yatt_hpc.train.policy import load_hf_state_dict

    hf, directory, _, _ = vlm
    model, config = _twin(hf, directory)
    saved = load_hf_state_dict(directory)
    back = convert.gather_hf_state_dict(model, config, one_rank_world, emit_tied_lm_head=False)
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[k], saved[k]) for k in saved)
    assert any(k.startswith("visual.") for k in back)


def test_pad_tokens_that_do_not_match_the_images_are_refused(one_rank_world, vlm):
    from yatt_hpc.train import megatron_model as mm

    hf, directory, tok, proc = vlm
    ids, pixels, grids, positions = _batch(tok, proc)
    model, _ = _twin(hf, directory)
    with pytest.raises(ValueError, match="image-pad tokens but its images give"):
        mm.forward_logits(model, ids, images=mm.VisionInputs(pixels[:32], grids[:2], positions))
    with pytest.raises(ImageTokenError, match="2 image placeholder.*1 image"):
        proc.expand(tok.encode(f"{MARK}{MARK}"), [(56, 56)])
    with pytest.raises(ImageTokenError, match="row 3: 4 image-pad token.*expand to 8"):
        proc.check_tokens(ids[0], grids[:2], "row 3")


def test_pad_count_follows_the_image_size_from_its_header(vlm):
    _, _, _, proc = vlm
    wide = ImageProcessor(image_token_id=IMAGE_PAD_ID, min_pixels=56 * 56, max_pixels=112 * 112)
    assert proc.image_tokens(56, 56) == 4
    assert proc.grid(200, 30) == (1, 2, 10) and proc.image_tokens(200, 30) == 5  # aspect kept, ~56*56 pixels
    assert wide.grid(112, 56) == (1, 4, 8) and wide.image_tokens(112, 56) == 8
    pixels, grids = wide.pixel_inputs(_images(1, side=112))
    assert grids.tolist() == [[1, 8, 8]] and pixels.shape == (64, 3 * 2 * 14 * 14)
