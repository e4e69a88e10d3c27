"""Tiny Qwen2-VL models from configs, with a character-level HF tokenizer: the visual demo's policy and judge.

    model = tiny_qwen2_vl(seed=0)                    # random weights, ~0.1 M parameters
    save_tiny_vlm(model, Path("out/policy"))         # safetensors, tokenizer.json, preprocessor_config.json
    tok = char_vlm_tokenizer()                       # PreTrainedTokenizerFast: one id per character

The language model is a Qwen2 with M-RoPE (mrope_section sums to head_dim / 2), the vision tower
Qwen2-VL's (patch 14, 2x2 merge), so a 56x56 image is a 4x4 patch grid and 4 image-pad tokens.
The tokenizer is a real `tokenizers` model (WordLevel over single characters, special tokens for
the vision markers) saved as `tokenizer.json`, so `data/tokenizer.py` loads it through
`AutoTokenizer` like any hub model's. Built in code, seeded: no download.
"""
from __future__ import annotations

import string
from pathlib import Path

import torch

# Qwen2-VL's own names for the vision markers (yatt_hpc/vision/processor.py expands prompts with them)
SPECIAL = ("<|pad|>", "<|endoftext|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
CHARS = string.ascii_letters + string.digits + " ?.,:=+-<>/"
PAD_ID, EOS_ID, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, VIDEO_PAD_ID = range(len(SPECIAL))
VOCAB_SIZE = 80  # len(SPECIAL) + len(CHARS) = 79, rounded up
IMAGE_SIDE = 56
"""min_pixels = max_pixels = 56 * 56: every image is resized to 56x56 (4 image tokens)."""


def char_vlm_tokenizer():
    """A character-level `PreTrainedTokenizerFast` over `CHARS` with the Qwen2-VL special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)} | {c: len(SPECIAL) + i for i, c in enumerate(CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   additional_special_tokens=list(SPECIAL[2:]))


def tiny_qwen2_vl(hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, vision_depth: int = 1,
                  vision_width: int = 32, seed: int | None = None):
    """A random Qwen2-VL of this shape over the character tokenizer (tied embeddings, no dropout)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    head_dim = hidden // heads
    t = head_dim // 4  # M-RoPE: (temporal, height, width) frequency pairs, summing to head_dim / 2
    text = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                rms_norm_eps=1e-6, tie_word_embeddings=True, attention_dropout=0.0, use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [head_dim // 2 - 2 * t, t, t]},
                bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden, num_heads=heads, mlp_ratio=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD_ID,
                           video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
                           vision_end_token_id=VISION_END_ID, tie_word_embeddings=True,
                           bos_token_id=EOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).eval()


def save_tiny_vlm(model, directory: Path) -> str:
    """`save_pretrained` (safetensors) plus the tokenizer and the image processor's pixel bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    char_vlm_tokenizer().save_pretrained(directory)
    side = IMAGE_SIDE * IMAGE_SIDE
    Qwen2VLImageProcessorPil(size={"shortest_edge": side, "longest_edge": side}, patch_size=14, merge_size=2,
                             temporal_patch_size=2).save_pretrained(directory)
    return str(directory)
