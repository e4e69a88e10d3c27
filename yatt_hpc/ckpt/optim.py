"""A torch optimizer's state (AdamW: exp_avg, exp_avg_sq, step per parameter) as named flat tensors.

    tensors, meta = optimizer_tensors(optimizer, model.named_parameters())   # -> safetensors + metadata
    load_optimizer_tensors(optimizer, model.named_parameters(), tensors, meta)

Tensor names are ``<param name>.<state key>`` (e.g. ``decoder.layers.0.mlp.linear_fc1.weight.exp_avg``);
``meta["param_groups"]`` is the JSON of the hyper-parameters (lr, betas, ...) without the params.
"""
from __future__ import annotations

import json
from collections.abc import Iterable

import torch

StateDict = dict[str, torch.Tensor]


def _index_by_name(optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Parameter name -> the index ``optimizer.state_dict()`` uses for it."""
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return {name: order[id(p)] for name, p in named if id(p) in order}


def optimizer_tensors(optimizer: torch.optim.Optimizer,
                      named: Iterable[tuple[str, torch.Tensor]]) -> tuple[StateDict, dict[str, str]]:
    """The optimizer state as ``{"<param>.<key>": tensor}`` plus JSON metadata (views, not copies)."""
    named = list(named)
    sd = optimizer.state_dict()
    tensors = {}
    for name, idx in _index_by_name(optimizer, named).items():
        for key, value in sd["state"].get(idx, {}).items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            tensors[f"{name}.{key}"] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return tensors, {"param_groups": json.dumps(groups)}


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]],
                           tensors: StateDict, meta: dict[str, str]) -> None:
    """Inverse of ``optimizer_tensors``; ``KeyError`` if a saved tensor names an unknown parameter."""
    index = _index_by_name(optimizer, list(named))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for full, value in tensors.items():
        name, _, key = full.rpartition(".")
        if name not in index:
            raise KeyError(f"optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[key] = value
    sd = optimizer.state_dict()
    groups = json.loads(meta["param_groups"]) if "param_groups" in meta else None
    if groups is not None:
        if len(groups) != len(sd["param_groups"]):
            raise ValueError(f"saved {len(groups)} param groups, optimizer has {len(sd['param_groups'])}")
        for saved, live in zip(groups, sd["param_groups"], strict=True):
            saved = {k: tuple(v) if isinstance(live.get(k), tuple) else v for k, v in saved.items()}
            live.update(saved)
    sd["state"] = state
    optimizer.load_state_dict(sd)


def assemble_state(parts: list[tuple[dict[str, torch.Tensor], dict[str, str]]]) -> tuple[dict[str, torch.Tensor],
                                                                                         dict[str, str]]:
    """Whole-parameter optimizer state from the files of one tensor shard's DP ranks. Unsharded files (no
    "rows" metadata) each hold the whole state, so the first is the answer; sharded ones are put together
    row range by row range, and a gap (a missing rank's file) is an error naming the parameter."""
    if not parts:
        return {}, {}
    tensors, meta = parts[0]
    if "rows" not in meta:
        return tensors, meta
    pieces: dict[str, list[tuple[int, int, int, dict[str, torch.Tensor]]]] = {}
    for tensors, meta in parts:
        for name, (lo, hi, rows) in json.loads(meta["rows"]).items():
            pieces.setdefault(name, []).append((lo, hi, rows, {k.rpartition(".")[2]: v for k, v in tensors.items()
                                                              if k.rpartition(".")[0] == name}))
    full: dict[str, torch.Tensor] = {}
    for name, got in pieces.items():
        got.sort(key=lambda g: g[0])
        at = 0
        for lo, hi, _, _ in got:
            if lo != at:
                raise ValueError(f"optimizer state of {name!r} lacks rows {at}..{lo}: a data-parallel rank's "
                                 "optimizer file is missing from the checkpoint")
            at = hi
        if at != got[0][2]:
            raise ValueError(f"optimizer state of {name!r} lacks rows {at}..{got[0][2]}: a data-parallel rank's "
                             "optimizer file is missing from the checkpoint")
        for key in got[0][3]:
            if key == "step":
                full[f"{name}.step"] = got[0][3]["step"]
                continue
            chunks = [g[3][key] for g in got]
            whole = torch.cat([c.reshape(-1) if c.dim() == 0 else c for c in chunks])
            full[f"{name}.{key}"] = whole
    return full, {"param_groups": parts[0][1]["param_groups"]}
