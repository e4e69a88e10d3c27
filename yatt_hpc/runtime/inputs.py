"""Checks of a run's inputs that need the filesystem (the error registry is `yatt_hpc/errors.py`).

    check_model_dirs(cfg)      # raises InputError naming the field, the path and the fix

`yatt-hpc run` calls these before launching, and every rank again at start (a cluster node may
not see what the login node saw).
"""
from __future__ import annotations

import json
from pathlib import Path

from yatt_hpc.config.lora import targets_problem
from yatt_hpc.config.placement import split_problem, stage_layers
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


def _policy_layers(cfg: RunConfig) -> tuple[int | None, Path, dict]:
    """The policy's transformer layer count (config.json, or its text_config), the file, and the config."""
    path = Path(cfg.model.path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"model.path={cfg.model.path!r}: config.json cannot be read ({err})") from None
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers", text.get("n_layer"))
    return (None if layers is None else int(layers)), path, config


def policy_layer_count(cfg: RunConfig) -> int | None:
    """The policy's transformer layers, or None when its config.json cannot be read here (`yatt-hpc plan` on a
    login node without the model: the plan then shows the stages' ranks without their layers)."""
    try:
        return _policy_layers(cfg)[0]
    except InputError:
        return None


def check_pipeline_stages(cfg: RunConfig) -> None:
    """`placement.trainer.pp` (and `pp_layers`) must split the policy's layers as Megatron splits them
    (`config.placement.stage_layers`), and a vision-language policy trains on one stage."""
    pp, split = cfg.placement.trainer.pp, cfg.placement.trainer.pp_layers
    if pp == 1:
        return
    layers, path, config = _policy_layers(cfg)
    if "vision_config" in config:
        raise InputError(f"placement.trainer.pp={pp}: pipeline parallelism with a vision-language policy "
                         f"({path}) is not supported; set placement.trainer.pp=1 and use tp and dp")
    problem = None if layers is None else split_problem(layers, pp, split)
    if problem:
        raise InputError(f"{problem} ({path})")


def check_recompute_layers(cfg: RunConfig) -> None:
    """`train.recompute_num_layers` must fit the layers of a pipeline stage (all of them without pp)."""
    if cfg.train.recompute != "full":
        return
    layers, path, _ = _policy_layers(cfg)
    pp, split = cfg.placement.trainer.pp, cfg.placement.trainer.pp_layers
    if layers is None or split_problem(layers, pp, split):
        return  # check_pipeline_stages names the split
    held = sorted({len(stage_layers(s, pp, layers, split)) for s in range(pp)})  # each stage checks its own
    problem = next(filter(None, (recompute_layers_problem(cfg.train, n) for n in held)), None)
    if problem:
        raise InputError(f"{problem}{' (per pipeline stage)' if pp > 1 else ''} ({path})")


def check_lora_targets(cfg: RunConfig) -> None:
    """`train.lora.target_modules` must name linear layers the policy has (GPT-2's or the Llama family's)."""
    if not cfg.train.lora.enabled:
        return
    _, path, config = _policy_layers(cfg)
    problem = targets_problem(cfg.train.lora, str(config.get("model_type")))
    if problem:
        raise InputError(f"{problem} ({path})")


def check_agent_budget(cfg: RunConfig) -> None:
    """A multi-turn trajectory must fit the policy: data.max_prompt_tokens + agent.max_response_tokens positions."""
    if not cfg.agent.enabled:
        return
    _, path, config = _policy_layers(cfg)
    config = config.get("text_config", config)
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    need = cfg.data.max_prompt_tokens + cfg.agent.max_response_tokens
    if limit is not None and need > int(limit):
        raise InputError(f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + agent.max_response_tokens="
                         f"{cfg.agent.max_response_tokens} = {need} exceeds the policy's {limit} positions ({path}); "
                         "lower one of them")


def check_critic(cfg: RunConfig) -> None:
    """`train.adv_estimator: gae`: the value model's directory, a text model reading the policy's tokens (the same
    vocabulary size, and with pipeline stages a layer count they divide), with synchronous steps (docs/critic.md)."""
    if cfg.train.adv_estimator != "gae":
        return
    if cfg.rollout.max_staleness:
        raise InputError(f"train.adv_estimator=gae with rollout.max_staleness={cfg.rollout.max_staleness}: the "
                         "critic's values and update run in the synchronous step only; set rollout.max_staleness=0")
    _, path, policy = _policy_layers(cfg)
    if "vision_config" in policy:
        raise InputError(f"train.adv_estimator=gae with a vision-language policy ({path}): the value model reads "
                         "text only; use a group estimator (grpo, rloo, ...) for this policy")
    if cfg.train.critic.path is None:
        return
    check_model_dir(cfg.train.critic.path, "train.critic.path")
    critic = json.loads((Path(cfg.train.critic.path) / "config.json").read_text())
    layers, pp = critic.get("num_hidden_layers", critic.get("n_layer")), cfg.placement.trainer.pp
    if layers is not None and int(layers) % pp:
        raise InputError(f"train.critic.path={cfg.train.critic.path!r} has {layers} transformer layers, which "
                         f"placement.trainer.pp={pp} pipeline stages do not split evenly; use a critic whose layer "
                         "count pp divides")
    vocab = ((policy.get("text_config") or policy).get("vocab_size"), critic.get("vocab_size"))
    if vocab[0] != vocab[1]:
        raise InputError(f"train.critic.path={cfg.train.critic.path!r} has vocab_size={vocab[1]} but the policy "
                         f"({path}) has {vocab[0]}: the critic reads the policy's token ids; use a critic with the "
                         "policy's tokenizer")


def check_model_dirs(cfg: RunConfig) -> None:
    check_model_dir(cfg.model.path, "model.path")
    check_model_arch(cfg)
    check_pipeline_stages(cfg)
    check_recompute_layers(cfg)
    check_lora_targets(cfg)
    check_agent_budget(cfg)
    check_critic(cfg)
    if cfg.reward.mode != "rule_only":
        check_model_dir(cfg.reward.genrm_path, "reward.genrm_path")
