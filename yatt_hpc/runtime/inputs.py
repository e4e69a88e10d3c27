"""Checks of a run's inputs that need the filesystem (the error registry is `yatt_hpc/errors.py`).

    check_model_dirs(cfg)      # raises InputError naming the field, the path and the fix

`yatt-hpc run` calls these before launching, and every rank again at start (a cluster node may
not see what the login node saw).
"""
from __future__ import annotations

import json
from pathlib import Path

from yatt_hpc.config.schema import RunConfig, recompute_layers_problem
from yatt_hpc.errors import InputError


def check_model_dir(path: str, field: str) -> None:
    where = Path(path)
    hint = ("produce the demo models with `.venv/bin/python tools/make_demo_models.py`"
            if "models/demo" in path else f"point {field} at a Hugging Face model directory")
    if not where.is_dir():
        raise InputError(f"{field}={path!r}: no such directory (working directory {Path.cwd()}); {hint}")
    if not (where / "config.json").is_file():
        raise InputError(f"{field}={path!r} has no config.json, so it is not a Hugging Face model directory; {hint}")
    if not any(where.glob("*.safetensors")):
        raise InputError(f"{field}={path!r} has no *.safetensors weights (yatt-hpc never loads pickled "
                         f"checkpoints); convert the weights to safetensors or {hint}")


def check_model_arch(cfg: RunConfig) -> None:
    """A named `model.arch` must be what the policy's config.json says it is."""
    if cfg.model.arch == "auto":
        return
    path = Path(cfg.model.path) / "config.json"
    try:
        found = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError) as err:
        raise InputError(f"model.path={cfg.model.path!r}: config.json cannot be read ({err})") from None
    if found != cfg.model.arch:
        raise InputError(f"model.arch={cfg.model.arch} but {path} has model_type={found!r}; set model.arch=auto "
                         f"(or model.arch={found}), or point model.path at a {cfg.model.arch} model")


def check_recompute_layers(cfg: RunConfig) -> None:
    """`train.recompute_num_layers` must fit the policy's layer count (config.json, or its text_config)."""
    if cfg.train.recompute != "full":
        return
    path = Path(cfg.model.path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"model.path={cfg.model.path!r}: config.json cannot be read ({err})") from None
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers", text.get("n_layer"))
    problem = None if layers is None else recompute_layers_problem(cfg.train, int(layers))
    if problem:
        raise InputError(f"{problem} ({path})")


def check_model_dirs(cfg: RunConfig) -> None:
    check_model_dir(cfg.model.path, "model.path")
    check_model_arch(cfg)
    check_recompute_layers(cfg)
    if cfg.reward.mode != "rule_only":
        check_model_dir(cfg.reward.genrm_path, "reward.genrm_path")
