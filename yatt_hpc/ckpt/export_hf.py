"""Export one checkpoint's model as a Hugging Face directory that ``from_pretrained`` loads.

    yatt-hpc ckpt export-hf runs/demo --step 20 --out runs/demo/hf-step-20
    export_hf(run_dir, step=20, out=Path("hf"), model_dir=None)    # the same, from Python

Gathers every tensor-parallel shard (``model-tp{t}-pp0.safetensors``), merges them with
``yatt_hpc.train.convert.megatron_to_hf`` and writes ``model.safetensors``. ``config.json``,
``generation_config.json`` and the tokenizer files are copied from the original model directory,
``model.path`` of the config saved in the checkpoint (or ``model_dir`` when given).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from safetensors.torch import load_file, save_file

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.errors import CheckpointError
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.ckpt.state import read_shared

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")


def _model_dir_from_config(config_yaml: str, step_dir: Path) -> Path:
    try:
        path = (yaml.safe_load(config_yaml) or {})["model"]["path"]
    except (yaml.YAMLError, KeyError, TypeError):
        raise CheckpointError(f"{step_dir}: the saved config has no model.path; pass --model-dir") from None
    return Path(path)


def _ordered_tp_shards(step_dir: Path) -> list[Path]:
    shards = layout.model_shards(step_dir)
    if not shards:
        raise CheckpointError(f"{step_dir} holds no model-tp*-pp*.safetensors files")
    pps = sorted({pp for _, pp in shards})
    if pps != [0]:
        raise CheckpointError(f"{step_dir}: pipeline-parallel checkpoints (pp stages {pps}) cannot be "
                              "exported yet; export a pp=1 checkpoint")
    tps = sorted(tp for tp, _ in shards)
    if tps != list(range(len(tps))):
        raise CheckpointError(f"{step_dir}: tensor-parallel shards {tps} are not 0..{len(tps) - 1}")
    return [shards[tp, 0] for tp in tps]


def export_hf(run_dir: str | Path, step: int, out: str | Path, model_dir: str | Path | None = None) -> Path:
    """Write ``out/model.safetensors`` + config and tokenizer files; return ``out``."""
    from transformers import AutoConfig

    from yatt_hpc.train.convert import megatron_to_hf

    step_dir = layout.step_dir(layout.resolve_checkpoints_dir(run_dir), step)
    if not step_dir.is_dir():
        raise CheckpointError(f"no checkpoint step {step} at {step_dir}")
    problem = verify_step(step_dir)
    if problem:
        raise CheckpointError(f"checkpoint step {step} does not verify: {problem}")
    _, shared = read_shared(step_dir / layout.STATE_FILE)
    src = Path(model_dir) if model_dir else _model_dir_from_config(shared.config_yaml, step_dir)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} has no config.json (the original model directory is needed for the "
                              "config and tokenizer); pass --model-dir")
    hf_config = AutoConfig.from_pretrained(src)
    shards = [load_file(str(p)) for p in _ordered_tp_shards(step_dir)]
    hf_sd = megatron_to_hf(shards, hf_config, emit_tied_lm_head=False)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in sorted(src.iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, out / item.name)
    return out
