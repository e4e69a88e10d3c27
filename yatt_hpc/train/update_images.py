"""A vision-language policy's image inputs for one update: pixels decoded once per group, and each
micro-batch's pixels, grids, M-RoPE positions and image slots, for the padded rows or the shared stream.

    pixels = group_pixels(images, batch)                                   # {prompt_id: (values, grids)}
    vision = padded_inputs(images, mb, inputs, pixels, device)            # rows of `forward_logits`
    vision = shared_inputs(images, mb, layout, pixels, device)            # `shared_prompt.forward_shared`

`images` is the policy's `vision.processor.ImageProcessor`. A pad token the policy sampled in its
response is text, not an image slot, in both layouts (as in the engine).
"""
from __future__ import annotations

import numpy as np
import torch

from yatt_hpc.batch import SampleBatch
from yatt_hpc.train.megatron_model import VisionInputs
from yatt_hpc.train.shared_prompt import SharedLayout
from yatt_hpc.vision.processor import ImageProcessor, decode_rgb

Pixels = dict[int, tuple[np.ndarray, np.ndarray]]
_NONE = (np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int64))  # a group without images


def group_pixels(images: ImageProcessor, batch: SampleBatch) -> Pixels:
    """{prompt_id: (pixel values, grids)} of every group with images, decoded once per group here."""
    return {pid: images.pixel_inputs([decode_rgb(b) for b in encoded])
            for pid, encoded in batch.group_images().items()}


def padded_inputs(images: ImageProcessor, mb: SampleBatch, inputs: torch.Tensor, pixels: Pixels,
                  device: torch.device) -> VisionInputs:
    """The padded rows' pixels (each row its group's images), grids and M-RoPE positions [3, B, T]."""
    rows = [pixels.get(int(pid), _NONE) for pid in mb.prompt_id]
    lengths = mb.prompt_len.tolist()
    for ids, (_, grids), n, origin in zip(inputs, rows, lengths, mb.sample_id):
        images.check_tokens(ids[:n].tolist(), grids, f"sample {int(origin)}")
    positions = np.stack([images.mrope_positions(ids.tolist(), grids, n)
                          for ids, (_, grids), n in zip(inputs, rows, lengths)], axis=1)
    in_prompt = torch.arange(inputs.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    slots = (inputs == images.image_token_id) & in_prompt.to(inputs.device)
    return _inputs(rows, torch.from_numpy(positions), slots, device)


def shared_inputs(images: ImageProcessor, mb: SampleBatch, layout: SharedLayout, pixels: Pixels,
                  device: torch.device) -> VisionInputs:
    """The shared stream's inputs (a CPU `layout`): each distinct prompt's images once, in stream order,
    and every stream token's M-RoPE position [3, 1, S] (a response token continues its prompt's text
    positions as in its padded row)."""
    prompts = mb.ragged("prompt_tokens")
    rows, prompt_positions, shift = [], [], []
    for i in layout.group_first.tolist():
        prompt, (values, grids) = prompts[i], pixels.get(int(mb.prompt_id[i]), _NONE)
        images.check_tokens(prompt.tolist(), grids, f"sample {int(mb.sample_id[i])}")
        # positions of the prompt and of one text token after it (where every response starts)
        both = images.mrope_positions(np.append(prompt, 0).tolist(), grids, len(prompt))
        rows.append((values, grids))
        prompt_positions.append(both[:, :-1])
        shift.append(int(both[0, -1]) - len(prompt))  # response token j sits at P + j in the layout
    in_prompt, text = layout.in_prompt.numpy(), layout.positions.numpy()
    positions = np.empty((3, len(text)), np.int64)
    positions[:, in_prompt] = np.concatenate(prompt_positions, axis=1)
    positions[:, ~in_prompt] = text[~in_prompt] + np.array(shift)[layout.token_group.numpy()[~in_prompt]]
    slots = (layout.tokens == images.image_token_id) & layout.in_prompt
    return _inputs(rows, torch.from_numpy(positions)[:, None, :], slots[None], device)


def _inputs(rows: list[tuple[np.ndarray, np.ndarray]], positions: torch.Tensor, slots: torch.Tensor,
            device: torch.device) -> VisionInputs:
    with_images = [r for r in rows if len(r[1])]
    return VisionInputs(
        torch.from_numpy(np.concatenate([p for p, _ in with_images])).to(device) if with_images else None,
        torch.from_numpy(np.concatenate([g for _, g in with_images])).to(device) if with_images else None,
        positions.to(device), slots.to(device))
