"""A checkpoint's config.json for the trainer and the judge, without transformers where it can be.

    config = load_hf_config(model_dir)        # then yatt_hpc.train.hf_arch.describe_hf_config(config, tp)

A leaf (json only). Importing transformers costs a rank ~0.9 s of CPU at start-up (its model registry is
scanned on import), which a trainer paid for one JSON file while its peers started on the same cores.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Every field describe_hf_config (and the trainer, the judge) reads from a GPT-2 config.json, and the names
# transformers' GPT2Config answers to besides its own (its attribute_map).
_GPT2_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon",
                "activation_function", "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx")
_GPT2_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                 "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}


class StatedConfig(SimpleNamespace):
    """A config.json exactly as written, for one that states every field it is asked for (no defaults)."""

    def get_text_config(self) -> StatedConfig:
        return self


def load_hf_config(model_dir: str | Path) -> Any:
    """A GPT-2 config.json that states every field read, read as written (with GPT2Config's other names
    for four of them); anything else through ``transformers.AutoConfig`` (its defaults, its renamed
    fields, vision configs). tests/unit/test_hf_config.py holds the two to the same description."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("model_type") == "gpt2" and all(k in raw for k in _GPT2_FIELDS) and not raw.get("quantization_config"):
        return StatedConfig(**raw, **{alias: raw[field] for alias, field in _GPT2_ALIASES.items()})
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))
