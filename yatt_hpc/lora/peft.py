"""LoRA adapters between the trainer's shards and PEFT's files, and merged into HF weights (torch only, no collectives).

    peft_sd = megatron_to_peft(stage_shards, hf_config)                  # shards[pp][tp] -> adapter_model.safetensors
    shard = peft_to_megatron(peft_sd, hf_config, targets, tp_rank, tp_size, stage)
    hf_sd = merge_into_hf(base_hf_sd, peft_sd, scaling, hf_config)         # W + scaling * B A, per HF module
    config = adapter_config(rank, alpha, dropout, targets, hf_config, base_path)
    save_peft(out_dir, peft_sd, config)    # adapter_config.json + adapter_model.safetensors

PEFT's names are ``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight`` (A [r, in], B [out, r], also
for GPT-2's Conv1D modules, whose PEFT config says ``fan_in_fan_out``); each tensor's TP split is its
`lora/targets.py` rule, applied by `train/convert.py` as for weights.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from yatt_hpc.config.lora import family_modules
from yatt_hpc.lora.targets import PEFT_PREFIX, adapter_rules, targets_of
from yatt_hpc.train.convert import Stage, merge_tensor, split_tensor
from yatt_hpc.train.hf_arch import describe_hf_config

StateDict = dict[str, torch.Tensor]


def megatron_to_peft(stage_shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], hf_config: Any,
                     split: tuple[int, int] | None = None) -> StateDict:
    """Every stage's TP shards of adapter tensors (``stage_shards[pp][tp]``, Megatron names; the stages split as
    `split` says, `convert.Stage`) as one PEFT state dict."""
    tp = len(stage_shards[0])
    arch = describe_hf_config(hf_config, tp)
    targets = targets_of(stage_shards[0][0])
    out: StateDict = {}
    for stage, shards in zip(Stage(0, len(stage_shards), split).all(), stage_shards, strict=True):
        for rule in adapter_rules(arch, targets, stage):
            for name, tensor in merge_tensor(rule, [shard[rule.megatron] for shard in shards], arch):
                out[PEFT_PREFIX + name] = tensor
    return out


def peft_to_megatron(peft_sd: Mapping[str, torch.Tensor], hf_config: Any, targets: frozenset[str], tp_rank: int,
                     tp_size: int, stage: Stage | None = None) -> StateDict:
    """TP rank `tp_rank`'s adapter tensors of pipeline `stage` (Megatron names); KeyError naming what is missing."""
    arch = describe_hf_config(hf_config, tp_size)
    rules = adapter_rules(arch, targets, stage or Stage())
    missing = [PEFT_PREFIX + r.hf[0] for r in rules if PEFT_PREFIX + r.hf[0] not in peft_sd]
    if missing:
        raise KeyError(f"the PEFT adapters lack {missing[:4]} ({len(missing)} tensors)")
    return {r.megatron: split_tensor(r, [peft_sd[PEFT_PREFIX + r.hf[0]]], arch, tp_rank, tp_size)
            for r in rules}


def reshard(parts: Sequence[Sequence[Mapping[str, torch.Tensor]]], hf_config: Any, tp_rank: int, tp: int,
            saved_split: tuple[int, int] | None, stage: Stage) -> StateDict:
    """Adapter-shaped tensors saved as ``parts[pp][tp]`` (stages split as `saved_split` says) in TP shard
    `tp_rank` of `tp` of pipeline `stage`."""
    return peft_to_megatron(megatron_to_peft(parts, hf_config, saved_split), hf_config, targets_of(parts[0][0]),
                            tp_rank, tp, stage)


def merge_into_hf(hf_sd: Mapping[str, torch.Tensor], peft_sd: Mapping[str, torch.Tensor], scaling: float,
                  hf_config: Any) -> StateDict:
    """The HF state dict with each adapted module's weight W + scaling * B A (summed in float32, kept in W's
    dtype; GPT-2's Conv1D weights are [in, out], so its delta is transposed: PEFT's ``fan_in_fan_out``)."""
    conv1d = getattr(hf_config, "model_type", None) == "gpt2"
    out = dict(hf_sd)
    for key, a in peft_sd.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
        b = peft_sd[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        weight = out[f"{module}.weight"]
        delta = (b.float() @ a.float()) * scaling
        out[f"{module}.weight"] = (weight.float() + (delta.t() if conv1d else delta)).to(weight.dtype)
    return out


def adapter_config(rank: int, alpha: float, dropout: float, targets: frozenset[str], hf_config: Any,
                   base_model: str) -> dict:
    """adapter_config.json of these adapters, as `peft.LoraConfig` reads it (its other fields keep PEFT's
    defaults): the target modules by name, in the model's own order."""
    order = family_modules(describe_hf_config(hf_config, 1).family)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": [m for m in order if m in targets],
        "fan_in_fan_out": getattr(hf_config, "model_type", None) == "gpt2",
        "bias": "none",
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_peft(out: str | Path, peft_sd: Mapping[str, torch.Tensor], config: dict) -> Path:
    """Write a PEFT adapter directory: ``adapter_model.safetensors`` and ``adapter_config.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in peft_sd.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
