"""The critic on CUDA: its values and update there, and full colocation's release/resume of its device memory
(parameters and AdamW state to host and back) leaving the next update bitwise the same.

Run on a CUDA machine: .venv/bin/python -m pytest tests/gpu/test_critic_cuda.py -ra
Skips, printing why, without CUDA. The CPU twin is tests/unit/test_critic.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("critic CUDA tests need a GPU: torch.cuda.is_available() is False", allow_module_level=True)

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the bitwise checks
torch.use_deterministic_algorithms(True)

from tests.batches import random_update_batch  # noqa: E402
from yatt_hpc.config.schema import RunConfig  # noqa: E402

DEMO_POLICY = Path(__file__).resolve().parents[2] / "models" / "demo" / "policy"


def _critic(dtype: str):
    from yatt_hpc.critic.update import MegatronCritic

    cfg = RunConfig.model_validate({"model": {"path": str(DEMO_POLICY), "dtype": dtype}, "train": {
        "adv_estimator": "gae", "micro_batch_size": 4, "critic": {"lr": 1e-3, "head_init_std": 0.05}}})
    return MegatronCritic.from_run_config(cfg, 0, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_critic_update_on_cuda_and_release_resume_is_exact(one_rank_world, dtype):
    from yatt_hpc.train.step_plan import whole_batch_plan

    kept, moved = _critic(dtype), _critic(dtype)
    assert kept.device.type == "cuda"
    batch, _ = random_update_batch(kept.vocab_size)
    returns = [np.full(n, 0.5, np.float32) for n in batch.response_len]
    plan = whole_batch_plan(batch, kept.cfg)
    for critic in (kept, moved):
        stats = critic.update_values(batch, critic.values(batch), returns, plan)
        assert np.isfinite(stats.loss) and stats.grad_norm > 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved.release_memory()
    assert all(p.device.type == "cpu" for p in moved.model.parameters())
    assert torch.cuda.memory_allocated() < before
    moved.resume_memory()
    assert moved.device.type == "cuda"
    for critic in (kept, moved):
        critic.update_values(batch, critic.values(batch), returns, plan)
    for (name, a), (_, b) in zip(kept.model.named_parameters(), moved.model.named_parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(kept.values(batch), moved.values(batch)):
        assert np.array_equal(a, b)
