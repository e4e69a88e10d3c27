"""A mixture-of-experts checkpoint's experts, between the names on disk and transformers' fused parameters.

    disk = unfuse_hf_experts(hf_model.state_dict())     # what save_pretrained writes, what the converter reads
    fused = fuse_hf_experts(disk)                       # what hf_model.load_state_dict takes

Qwen3-MoE (and Qwen2-MoE) checkpoints store each expert's projections on their own
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, [out, in]); transformers 5 holds a layer's
experts as two 3-D parameters, ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and
``mlp.experts.down_proj`` [E, H, I], converting on load and back on save (its ``conversion_mapping.py``,
``qwen2_moe``). The converter and the weight sync speak the disk names (SGLang loads those); the HF engine
fuses them for its model. A leaf: torch only.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

_FUSED = re.compile(r"^(?P<mlp>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_DISK = re.compile(r"^(?P<mlp>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


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


def is_expert_name(name: str) -> bool:
    """A per-expert projection's name as a checkpoint stores it."""
    return _DISK.match(name) is not None


def fuse_hf_experts(items: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert tensors (disk names) stacked into transformers' fused parameters; other names pass through.

    Every layer whose experts appear must have all `num_experts` of them (a partial set cannot be written into a
    fused parameter without the rest): raises ``KeyError`` naming the layer and the missing experts.
    """
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    for name, tensor in items:
        match = _DISK.match(name)
        if match is None:
            out[name] = tensor
        else:
            layers.setdefault(match["mlp"], {})[(match["proj"], int(match["e"]))] = tensor
    for mlp, parts in layers.items():
        missing = sorted({e for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
                          if (p, e) not in parts})
        if missing or len(parts) != 3 * num_experts:
            raise KeyError(f"{mlp}: experts {missing} missing (of {num_experts}); a fused parameter needs every expert")
        out[f"{mlp}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[("gate_proj", e)], parts[("up_proj", e)]]) for e in range(num_experts)])
        out[f"{mlp}.down_proj"] = torch.stack([parts[("down_proj", e)] for e in range(num_experts)])
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
