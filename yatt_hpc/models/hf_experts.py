"""A mixture-of-experts checkpoint's experts, between the names on disk and transformers' fused parameters.

    disk = unfuse_hf_experts(hf_model.state_dict())     # what save_pretrained writes, what the converter reads
    slots = expert_slots(shapes)                        # where each per-expert tensor goes in the fused parameters

Qwen3-MoE (and Qwen2-MoE) checkpoints store each expert's projections on their own
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, [out, in]); transformers 5 holds a layer's
experts as two 3-D parameters, ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``mlp.experts.down_proj`` [E, H, I], converting on load and back on save (its ``conversion_mapping.py``,
``qwen2_moe``). The converter and the weight sync speak the disk names (SGLang loads those); the HF engine
writes each into its row of its model's fused parameter (`expert_slots`). A leaf: torch only.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_FUSED = re.compile(r"^(?P<mlp>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def unfuse_hf_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every fused expert parameter split into the per-expert tensors a checkpoint holds."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        mlp = match["mlp"]
        for e, expert in enumerate(tensor.unbind(0)):
            if match["kind"] == "down_proj":
                out[f"{mlp}.{e}.down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2)
                out[f"{mlp}.{e}.gate_proj.weight"], out[f"{mlp}.{e}.up_proj.weight"] = gate, up
    return out


def expert_slots(fused_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[str, int, slice, tuple[int, ...]]]:
    """Every per-expert checkpoint name of a model holding fused expert parameters (`fused_shapes`: its state-dict
    shapes) -> (fused name, expert, rows of that expert's matrix, the per-expert tensor's shape): where a tensor
    sent under its checkpoint name is written, one expert at a time, whatever bucket it came in."""
    slots: dict[str, tuple[str, int, slice, tuple[int, ...]]] = {}
    for name, shape in fused_shapes.items():
        match = _FUSED.match(name)
        if match is None:
            continue
        experts, rows, cols = shape
        mlp = match["mlp"]
        for e in range(experts):
            if match["kind"] == "down_proj":
                slots[f"{mlp}.{e}.down_proj.weight"] = (name, e, slice(0, rows), (rows, cols))
            else:
                half = rows // 2
                slots[f"{mlp}.{e}.gate_proj.weight"] = (name, e, slice(0, half), (half, cols))
                slots[f"{mlp}.{e}.up_proj.weight"] = (name, e, slice(half, rows), (half, cols))
    return slots
