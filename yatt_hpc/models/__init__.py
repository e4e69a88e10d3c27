"""Models as checkpoints describe them: reading a Hugging Face checkpoint's config.json.

    from yatt_hpc.models.hf_config import load_hf_config
    from yatt_hpc.models.hf_experts import unfuse_hf_experts     # a MoE model's experts as its files hold them

The room for model description and HF conversion; a leaf (json, torch, transformers lazily), read by the
trainer (`train/`), the engines (`rollout/`), the judge (`reward/`) and the role controllers.
"""
