"""The tokenizer of a model directory: what the trainer, the rollout engines and the judge load.

    tok = load_tokenizer("models/demo/policy")   # the demo's character tokenizer there, else transformers'

A directory that holds `yatt_tokenizer.json` has the demo's character tokenizer
(`yatt_hpc/demo/char_tokenizer.py`); any other gets `transformers.AutoTokenizer`.
"""
from __future__ import annotations

from pathlib import Path

from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved with a model: our character tokenizer if present, else transformers'."""
    if (Path(model_dir) / TOKENIZER_FILE).is_file():
        return CharTokenizer.load(model_dir)
    from transformers import AutoTokenizer  # real models (Qwen, Llama) ship their own

    return AutoTokenizer.from_pretrained(str(model_dir))
