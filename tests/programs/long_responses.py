"""A GRPO run whose every response is `max_new_tokens` long: the setup of the long-response test and bench.

    config = long_run_config(tmp / "long", max_new_tokens=3000)       # writes the model and the config
    yatt-hpc run {config} --run-dir RUN --set train.recompute=full --set train.max_tokens_per_micro_batch=4096

The policy is a random tiny GPT-2 (width 64, 3 layers) with room for the prompt and `max_new_tokens`
positions and no end-of-sequence token (its config names none), so the engine writes until the limit:
every response has exactly `max_new_tokens` tokens. The reward is the rule verifier alone (the demo judge
reads 64 positions); one trainer rank, one rollout rank, no validation, no checkpoints.
"""
from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def long_run_config(root: Path, max_new_tokens: int, prompts: int = 1, samples: int = 4, steps: int = 1) -> Path:
    from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model

    root.mkdir(parents=True, exist_ok=True)
    model = char_gpt2(n_embd=64, n_layer=3, n_head=4, n_positions=max_new_tokens + 64, seed=0)
    model.config.eos_token_id = model.generation_config.eos_token_id = None  # writes until max_new_tokens
    policy = save_char_model(model, root / "policy")
    cfg = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    del cfg["eval"]
    cfg["model"]["path"] = policy
    cfg["reward"] = {"mode": "rule_only"}
    cfg["train"].update(steps=steps, prompts_per_step=prompts, micro_batch_size=8, kl_coef=0.0)
    cfg["rollout"].update(samples_per_prompt=samples, max_new_tokens=max_new_tokens)
    cfg["placement"]["trainer"] = {"nodes": 1, "tasks_per_node": 1, "tp": 1, "dp": 1}
    cfg["checkpoint"]["interval"] = 0
    cfg["logging"] = {"trackers": [], "progress": False}
    path = root / "long_responses.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
