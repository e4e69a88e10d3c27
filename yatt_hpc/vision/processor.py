"""A Qwen2-VL policy's image inputs, built where they are consumed: pad expansion, pixel values, M-RoPE.

    proc = ImageProcessor.from_model_dir("models/demo_vlm/policy")    # preprocessor_config.json + config.json
    proc.image_tokens(width=56, height=56)          # 4: image-pad tokens one image expands to
    ids = proc.expand(prompt_ids, [(56, 56)])       # one pad per image -> the image's pad run
    pixels, grids = proc.pixel_inputs([pil_image])  # float32 [patches, 1176], int64 [images, 3]
    positions = proc.mrope_positions(ids, grids)    # int64 [3, len(ids)], what HF's get_rope_index gives

What crosses between ranks is a row's encoded image bytes (and the token ids with the pads already
expanded, which need only the image's size, read from its header); every consumer (the trainer
replica, an HF engine, a judge) decodes the bytes and calls `pixel_inputs` itself, so `pixel_values`
never travel. The image processor is transformers' PIL backend (`Qwen2VLImageProcessorPil`): PyPI's
torchvision does not import beside the CPU torch build here, and the PIL path needs no torch.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from yatt_hpc.vision.images import PILLOW_PIXEL_LIMIT, ImageLimits, check_image_bytes, decode_image

IMAGE_PLACEHOLDER = "<image>"
"""Where a row's prompt text puts an image (the convention of the peers' datasets, e.g. geo3k)."""
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VISION_MARK = VISION_START + IMAGE_PAD + VISION_END
"""What one image is in a Qwen2-VL prompt's text before its pad is expanded."""


class ImageTokenError(ValueError):
    """A prompt whose image placeholders do not match its images; the message names the fix."""


CONSUMER_LIMITS = ImageLimits(max_bytes=1 << 40, max_pixels=PILLOW_PIXEL_LIMIT)
"""The row's owner checked the image against data.max_image_pixels when it read the row; a consumer
only refuses what Pillow itself cannot open."""


def image_size(data: bytes | np.ndarray, origin: str) -> tuple[int, int]:
    """(width, height) from an encoded image's header (no pixels decoded)."""
    width, height, _ = check_image_bytes(bytes(data), origin, CONSUMER_LIMITS)
    return width, height


def decode_rgb(data: bytes | np.ndarray, origin: str = "an image of the batch"):
    """An encoded image as an RGB PIL image (what every consumer does with the bytes it got)."""
    return decode_image(bytes(data), origin, CONSUMER_LIMITS)


def mark_images(text: str, count: int) -> str:
    """`text` with each `<image>` as the vision markers, or, when it has none, `count` markers before it."""
    if IMAGE_PLACEHOLDER in text:
        return text.replace(IMAGE_PLACEHOLDER, VISION_MARK)
    return VISION_MARK * count + text


def is_vision_model(model_dir: str | Path) -> bool:
    """True for a checkpoint whose config.json has a vision tower (Qwen2-VL)."""
    config = Path(model_dir) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


@dataclass(frozen=True)
class ImageProcessor:
    """The image side of a Qwen2-VL checkpoint (see the module docstring)."""

    image_token_id: int
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ImageProcessor:
        """From a checkpoint directory's `config.json` (token id, tower geometry) and, when present, its
        `preprocessor_config.json` (pixel bounds)."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        vision = config.get("vision_config") or {}
        pre_file = path / "preprocessor_config.json"
        pre = json.loads(pre_file.read_text()) if pre_file.exists() else {}
        size = pre.get("size") or {}
        return cls(image_token_id=int(config["image_token_id"]),
                   patch_size=int(vision.get("patch_size", 14)),
                   merge_size=int(vision.get("spatial_merge_size", 2)),
                   temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                   min_pixels=int(size.get("shortest_edge", pre.get("min_pixels", 56 * 56))),
                   max_pixels=int(size.get("longest_edge", pre.get("max_pixels", 28 * 28 * 1280))))

    @classmethod
    def from_hf_config(cls, config) -> ImageProcessor:
        """From a loaded transformers config: its directory's files when it was loaded from one, else the
        tower's geometry with the processor's default pixel bounds."""
        path = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
        if path and (Path(path) / "config.json").is_file():
            return cls.from_model_dir(path)
        vision = config.vision_config
        return cls(image_token_id=int(config.image_token_id), patch_size=int(vision.patch_size),
                   merge_size=int(vision.spatial_merge_size), temporal_patch_size=int(vision.temporal_patch_size))

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(temporal, height, width) patch grid of an image of this size after `smart_resize`."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def image_tokens(self, width: int, height: int) -> int:
        """How many image-pad tokens an image of this size becomes in the language model's input."""
        t, h, w = self.grid(width, height)
        return t * h * w // self.merge_size ** 2

    def expand(self, ids: Sequence[int], sizes: Sequence[tuple[int, int]]) -> list[int]:
        """`ids` with the k-th single image-pad token replaced by image k's run of pads (sizes are
        (width, height)). The prompt must hold exactly one pad per image."""
        ids = [int(i) for i in ids]
        at = [k for k, i in enumerate(ids) if i == self.image_token_id]
        if len(at) != len(sizes):
            raise ImageTokenError(f"the prompt has {len(at)} image placeholder(s) ({IMAGE_PLACEHOLDER}) but the row "
                                  f"has {len(sizes)} image(s); put one {IMAGE_PLACEHOLDER} per image in the prompt")
        out: list[int] = []
        last = 0
        for k, (width, height) in zip(at, sizes, strict=True):
            out += ids[last:k] + [self.image_token_id] * self.image_tokens(width, height)
            last = k + 1
        return out + ids[last:]

    def pixel_inputs(self, images: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [patches, 3 * temporal * patch * patch] float32, image_grid_thw [images, 3] int64)
        of RGB PIL images, through transformers' PIL image processor."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = Qwen2VLImageProcessorPil(
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}, patch_size=self.patch_size,
            merge_size=self.merge_size, temporal_patch_size=self.temporal_patch_size)
        out = processor(images=list(images), return_tensors="np")
        return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)

    def check_tokens(self, ids: Sequence[int], grids: np.ndarray, origin: str) -> None:
        """Raise naming `origin` when the pad tokens of `ids` are not what the images expand to."""
        grids = np.asarray(grids, np.int64).reshape(-1, 3)
        want = int(grids.prod(axis=1).sum()) // self.merge_size ** 2
        have = int(sum(1 for i in ids if int(i) == self.image_token_id))
        if have != want:
            raise ImageTokenError(f"{origin}: {have} image-pad token(s) in the prompt but its image(s) (grids "
                                  f"{grids.tolist()}) expand to {want}; the prompt was tokenized for "
                                  "other image sizes or another processor: re-tokenize it with this model's "
                                  "preprocessor_config.json")

    def mrope_positions(self, ids: Sequence[int], grids: np.ndarray, prompt_len: int | None = None) -> np.ndarray:
        """[3, T] (temporal, height, width) positions of one sequence: text tokens count up on all three
        axes; an image's pads get (start, start + row, start + column) over its merged grid and the text
        after it continues at start + max(rows, columns). The rule of HF's `Qwen2VLModel.get_rope_index`.
        Only the first `prompt_len` tokens hold images: a pad token the policy sampled is text."""
        ids = np.asarray(ids, np.int64)
        limit = len(ids) if prompt_len is None else prompt_len
        out = np.zeros((3, len(ids)), np.int64)
        pos, k, i = 0, 0, 0
        while i < len(ids):
            if ids[i] != self.image_token_id or i >= limit:
                out[:, i] = pos
                pos, i = pos + 1, i + 1
                continue
            t, h, w = (int(x) for x in grids[k])
            h, w = h // self.merge_size, w // self.merge_size
            count = t * h * w
            out[0, i:i + count] = np.repeat(np.arange(t), h * w) + pos
            out[1, i:i + count] = np.tile(np.repeat(np.arange(h), w), t) + pos
            out[2, i:i + count] = np.tile(np.arange(w), t * h) + pos
            pos, k, i = pos + max(h, w), k + 1, i + count
        return out
