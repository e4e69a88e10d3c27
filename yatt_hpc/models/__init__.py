"""Models as checkpoints describe them: reading a Hugging Face checkpoint's config.json.

    from yatt_hpc.models.hf_config import load_hf_config

The room for model description and HF conversion; a leaf (json, transformers lazily), read by the
trainer (`train/`), the judge (`reward/`) and the role controllers.
"""
