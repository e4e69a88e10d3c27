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
