"""What a rollout rank does differently with `agent:` set: the multi-turn loop instead of one engine call.

    agent = build_rollout_agent(cfg)                   # None without tools or an environment
    results, extra = agent.generate(engine, prompts, requests, cancelled)   # {sample_id: GenerationResult}, ...
    batch.select(rows, ..., **extra_columns(extra, sample_ids))            # + response_mask, env_reward (code_reward)

Tool calls run in a thread pool on this rank (`agent.tool_workers`), or, with a tools group
(`placement.tools`), on its ranks: `tools` is then the `tools_group.RemoteToolBox` the rollout controller built,
and this rank imports no tool and runs no call.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from yatt_hpc.agent.loop import AgentLoop
from yatt_hpc.agent.tools import build_toolbox
from yatt_hpc.batch import SampleBatch
from yatt_hpc.rollout.engine import GenerationRequest, GenerationResult


class RolloutAgent:
    def __init__(self, cfg, tools=None) -> None:
        from yatt_hpc.data.tokenizer import load_tokenizer  # transformers, for an HF tokenizer: only with agent:

        template = Path(cfg.data.chat_template).read_text(encoding="utf-8") if cfg.data.chat_template else None
        toolbox = tools if tools is not None else build_toolbox(cfg.agent) if cfg.agent.tools else None
        self.loop = AgentLoop(cfg.agent, load_tokenizer(cfg.model.path), max_new_tokens=cfg.rollout.max_new_tokens,
                              engine_seed=cfg.train.seed, toolbox=toolbox, template=template)
        self.toolbox = toolbox

    def generate(self, engine, prompts: SampleBatch, requests: Sequence[GenerationRequest],
                 cancelled: Callable[[], bool] = lambda: False) -> tuple[dict[int, GenerationResult], dict]:
        rows = [{"prompt": q, "answer": a, "metadata": m}
                for q, a, m in zip(prompts.questions(), prompts.answers(), prompts.metadatas())]
        out = self.loop.run(engine, requests, rows, cancelled)
        results = {r.result.sample_id: r for r in out}
        return {sid: r.result for sid, r in results.items()}, {
            "masks": {sid: r.mask for sid, r in results.items()},
            "env_reward": {sid: r.env_reward for sid, r in results.items()}}

    def take_stats(self) -> dict[str, float]:
        return self.loop.take_stats()

    def close(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()


def extra_columns(extra: dict | None, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
    """`SampleBatch.select`'s given columns: an agent's masks and environment rewards, a code term's scores (none
    for a single-turn rollout without a code term)."""
    ids = [int(s) for s in sample_ids]
    out = {}
    if extra and "masks" in extra:
        masks = [extra["masks"][s] for s in ids]
        out["response_mask"] = np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, np.uint8)
        out["env_reward"] = np.array([extra["env_reward"][s] for s in ids], np.float32)
    if extra and "code_reward" in extra:
        out["code_reward"] = np.array([extra["code_reward"][s] for s in ids], np.float32)
    return out


def build_rollout_agent(cfg, tools=None) -> RolloutAgent | None:
    """The agent of a rollout rank (None without `agent:`); `tools` runs the calls elsewhere (the tools group)."""
    return RolloutAgent(cfg, tools) if cfg.agent.enabled else None
