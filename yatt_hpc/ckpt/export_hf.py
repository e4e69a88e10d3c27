"""Export one checkpoint's model as a Hugging Face directory that ``from_pretrained`` loads, or a LoRA run's
adapters as a PEFT directory that ``PeftModel.from_pretrained`` loads onto the base model.

    yatt-hpc ckpt export-hf runs/demo --step 20 --out runs/demo/hf-step-20
    yatt-hpc ckpt export-peft runs/lora --step 20 --out runs/lora/adapter-step-20
    export_hf(run_dir, step=20, out=Path("hf"), model_dir=None)    # the same, from Python

Gathers every tensor shard of every pipeline stage (``model-tp{t}-pp{p}.safetensors``), merges them with
``yatt_hpc.train.convert.stages_to_hf`` (uneven stages by the split the checkpoint's trainer records hold) and
writes ``model.safetensors``. ``generation_config.json``
and the tokenizer files are copied from the original model directory, ``model.path`` of the config saved
in the checkpoint (or ``model_dir`` when given); so is ``config.json``, with its dtype set to the dtype
of the tensors written, so that a plain ``from_pretrained(out)`` loads the model as it was trained.

A LoRA run's checkpoint holds its adapters only (`yatt_hpc/lora/`): ``export_hf`` merges them into the base
model's weights (W + alpha/r x B A, in the base's dtype), read from the original model directory after checking it
is the base the adapters were trained on (`lora/identity.py`); ``export_peft`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` (PEFT's names and layout, `lora/peft.py`).

Checkpoints hold full-precision (float32) weights, the masters of a bf16 run included, and the export
keeps them unless ``dtype`` says otherwise. RL moves weights little: at a learning rate of 1e-6 most
updates are far below bfloat16's resolution (8 bits of mantissa), so a bf16 export can round most of
what training changed back to the original weights. ``export_hf`` measures that against the original
weights and returns it (`Export.lost_in_cast`); the CLI warns when it is not negligible.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.errors import CheckpointError
from yatt_hpc.ckpt.loader import read_weights, recorded_split
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.ckpt.state import read_records, read_shared

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")


def _model_dir_from_config(config_yaml: str, step_dir: Path) -> Path:
    try:
        path = (yaml.safe_load(config_yaml) or {})["model"]["path"]
    except (yaml.YAMLError, KeyError, TypeError):
        raise CheckpointError(f"{step_dir}: the saved config has no model.path; pass --model-dir") from None
    return Path(path)


def _ordered_shards(step_dir: Path) -> list[list[Path]]:
    """The parameter files as ``[pp][tp]``: every pipeline stage's tensor shards in order."""
    shards = layout.model_shards(step_dir)
    if not shards:
        raise CheckpointError(f"{step_dir} holds no model-tp*-pp*.safetensors files")
    tps, pps = sorted({tp for tp, _ in shards}), sorted({pp for _, pp in shards})
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or len(shards) != len(tps) * len(pps):
        raise CheckpointError(f"{step_dir}: parameter files {sorted(p.name for p in shards.values())} are not "
                              f"every (tp, pp) of tp 0..{len(tps) - 1} and pp 0..{len(pps) - 1}")
    return [[shards[tp, pp] for tp in tps] for pp in pps]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Export:
    out: Path
    dtype: str                 # of every floating-point tensor written, and config.json's
    lost_in_cast: float | None  # of the trained changes, the fraction the cast rounded away (None: no cast)


def export_hf(run_dir: str | Path, step: int, out: str | Path, model_dir: str | Path | None = None,
              dtype: str | None = None) -> Export:
    """Write ``out/model.safetensors`` (in ``dtype``, default the checkpoint's) + config and tokenizer files."""
    from yatt_hpc.train.convert import stages_to_hf

    step_dir, src, hf_config, lora = _open_step(run_dir, step, model_dir)
    shards = [[read_weights(step_dir, tp, pp) for tp, _ in stage] for pp, stage in enumerate(_shard_grid(step_dir))]
    split = recorded_split(step_dir)
    if lora is None:
        hf_sd = stages_to_hf(shards, hf_config, emit_tied_lm_head=False, split=split)
    else:
        from yatt_hpc.lora.peft import megatron_to_peft, merge_into_hf

        base = {k: v for k, v in _original_weights(src).items()
                if not (k == "lm_head.weight" and getattr(hf_config, "tie_word_embeddings", False))}
        hf_sd = merge_into_hf(base, megatron_to_peft(shards, hf_config, split), lora["alpha"] / lora["rank"], hf_config)
    stored = _float_dtype(hf_sd)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    target = dtype or stored
    lost = None
    if target != stored:
        cast = {k: v.to(DTYPES[target]) if v.is_floating_point() else v for k, v in hf_sd.items()}
        lost = _changes_lost(hf_sd, cast, src)
        hf_sd = cast
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in sorted(src.iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != "config.json":
            shutil.copy2(item, out / item.name)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(_with_dtype(config, target), indent=2, sort_keys=True) + "\n")
    return Export(out, target, lost)


def export_critic(run_dir: str | Path, step: int, out: str | Path, model_dir: str | Path | None = None,
                  dtype: str | None = None) -> Export:
    """A `train.adv_estimator: gae` run's value model as a transformers `*ForTokenClassification` with one label
    (`critic/model.py`): ``AutoModelForTokenClassification.from_pretrained(out)`` gives V_t as ``logits[..., 0]``.
    Config and tokenizer files come from the critic's start directory (`train.critic.path`, else `model.path`)."""
    from yatt_hpc.critic.model import to_token_classification, token_classification_config

    step_dir, src, hf_config, _ = _open_step(run_dir, step, model_dir or _critic_dir(run_dir, step))
    if not any(step_dir.glob("critic-tp*-pp*.safetensors")):
        raise CheckpointError(f"checkpoint step {step} at {step_dir} holds no value model (its run had no "
                              "train.adv_estimator=gae); export the policy without --critic")
    stages = [[load_file(str(step_dir / layout.critic_file(tp, pp))) for tp, _ in stage]
              for pp, stage in enumerate(_shard_grid(step_dir))]
    hf_sd = to_token_classification(stages, hf_config)
    target = dtype or _float_dtype(hf_sd)
    hf_sd = {k: v.to(DTYPES[target]).contiguous() if v.is_floating_point() else v for k, v in hf_sd.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in sorted(src.iterdir()):
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name not in ("config.json",
                                                                                           "generation_config.json"):
            shutil.copy2(item, out / item.name)
    config = token_classification_config(json.loads((src / "config.json").read_text()))
    (out / "config.json").write_text(json.dumps(_with_dtype(config, target), indent=2, sort_keys=True) + "\n")
    return Export(out, target, None)


def _shard_grid(step_dir: Path) -> list[list[tuple[int, int]]]:
    """(tp, pp) of every parameter shard as ``[pp][tp]`` (the critic has the policy's layout)."""
    return [[(int(p.name.split("-tp")[1].split("-")[0]), pp) for p in stage]
            for pp, stage in enumerate(_ordered_shards(step_dir))]


def _critic_dir(run_dir: str | Path, step: int) -> Path:
    """The directory the critic started from: `train.critic.path` of the saved config, else `model.path`."""
    step_dir = layout.step_dir(layout.resolve_checkpoints_dir(run_dir), step)
    if not (step_dir / layout.STATE_FILE).is_file():
        raise CheckpointError(f"no checkpoint step {step} at {step_dir}")
    _, shared = read_shared(step_dir / layout.STATE_FILE)
    train = (yaml.safe_load(shared.config_yaml) or {}).get("train") or {}
    path = (train.get("critic") or {}).get("path")
    return Path(path) if path else _model_dir_from_config(shared.config_yaml, step_dir)


def export_peft(run_dir: str | Path, step: int, out: str | Path, model_dir: str | Path | None = None) -> Path:
    """Write a LoRA checkpoint's adapters as ``out/adapter_config.json`` + ``out/adapter_model.safetensors``."""
    from yatt_hpc.lora.peft import adapter_config, megatron_to_peft, save_peft
    from yatt_hpc.lora.targets import targets_of

    step_dir, src, hf_config, lora = _open_step(run_dir, step, model_dir)
    if lora is None:
        raise CheckpointError(f"checkpoint step {step} at {step_dir} holds fully trained weights, not LoRA adapters "
                              "(its run had train.lora.rank=0); use `yatt-hpc ckpt export-hf`")
    shards = [[load_file(str(p)) for p in stage] for stage in _ordered_shards(step_dir)]
    config = adapter_config(lora["rank"], lora["alpha"], lora.get("dropout", 0.0), targets_of(shards[0][0]),
                            hf_config, str(src))
    return save_peft(out, megatron_to_peft(shards, hf_config, recorded_split(step_dir)), config)


def _open_step(run_dir: str | Path, step: int, model_dir: str | Path | None):
    """(step directory, original model directory, its HF config, the LoRA record or None) of a verified step; a
    LoRA checkpoint's base is checked against the model directory's identity."""
    from transformers import AutoConfig

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
    lora = next((r.extra["lora"] for r in read_records(step_dir / layout.STATE_FILE)
                 if r.identity.startswith("trainer/") and "lora" in r.extra), None)
    if lora is not None:
        from yatt_hpc.lora.identity import base_fingerprint

        if base_fingerprint(src) != lora["base_sha256"]:
            raise CheckpointError(f"checkpoint step {step} holds LoRA adapters of the base model at "
                                  f"{lora['base_path']}, and {src} is another model (its weights differ); pass "
                                  "--model-dir with the base the adapters were trained on")
    return step_dir, src, AutoConfig.from_pretrained(src), lora


def _float_dtype(state: dict[str, torch.Tensor]) -> str:
    """The one floating-point dtype of a checkpoint's tensors, by its config.json name."""
    found = {v.dtype for v in state.values() if v.is_floating_point()}
    names = sorted(name for name, d in DTYPES.items() if d in found)
    if len(names) != 1 or len(found) != 1:
        raise CheckpointError(f"the checkpoint's tensors are of {sorted(map(str, found))}, not one of "
                              f"{', '.join(DTYPES)}; pass --dtype to write one")
    return names[0]


def _with_dtype(config: dict, dtype: str) -> dict:
    """`config` with its dtype (transformers 5: `dtype`; earlier: `torch_dtype`) and any sub-config's set
    to `dtype`: with neither given, from_pretrained loads in what the config says."""
    config = {k: _with_dtype(v, dtype) if isinstance(v, dict) and "model_type" in v else v
              for k, v in config.items()}
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    return config


def _original_weights(src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the original model directory's safetensors files."""
    original: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        original.update(load_file(str(path)))
    return original


def _changes_lost(trained: dict[str, torch.Tensor], cast: dict[str, torch.Tensor], src: Path) -> float | None:
    """Of the elements training changed (trained != the original model's), the fraction whose cast equals
    the cast original: changes the lower precision cannot hold. None when the original's weights cannot
    be read (no safetensors files, or damaged ones); elements under other names are not counted."""
    try:
        original = _original_weights(src)
    except (OSError, ValueError):
        return None
    changed = lost = 0
    for name, value in trained.items():
        before = original.get(name)
        if before is None or before.shape != value.shape or not value.is_floating_point():
            continue
        moved = value != before.to(value.dtype)
        changed += int(moved.sum())
        lost += int((moved & (cast[name] == before.to(cast[name].dtype))).sum())
    return lost / changed if changed else 0.0
