"""The CUDA paths that CPU runs cannot reach: Megatron on the GPU (NCCL, one rank), the GRPO update
there, and full colocation's release/resume of all three groups' device memory.

Run on a CUDA machine: .venv/bin/python -m pytest tests/gpu/test_cuda_paths.py -ra
Skips, printing why, without CUDA. The CPU twins are tests/unit/test_convert.py and
tests/unit/test_hf_engine.py; the whole loop on one GPU is configs/demo_1gpu.yaml.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA path tests need a GPU: torch.cuda.is_available() is False", allow_module_level=True)

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the bitwise checks
torch.use_deterministic_algorithms(True)

from tests.batches import random_update_batch as _batch  # noqa: E402
from tests.mpi.convert_tp2_worker import TINY_CASES, tiny_hf_model  # noqa: E402
from yatt_hpc.config.schema import TrainConfig  # noqa: E402
from yatt_hpc.rollout import GenerationRequest, build_engine  # noqa: E402
from yatt_hpc.train import convert  # noqa: E402

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
MIB = 2**20


@pytest.fixture(scope="module")
def nccl_world(one_rank_world):
    assert torch.distributed.get_backend() == "nccl"  # the shared one-rank world, on CUDA
    return one_rank_world


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_megatron_logits_on_cuda_equal_hf_logits(nccl_world, case):
    from yatt_hpc.train import megatron_model as mm

    hf = tiny_hf_model(case).cuda()
    model = mm.build_gpt_model(hf.config, tp_size=1)
    mm.load_megatron_shard(model, convert.hf_to_megatron(hf.state_dict(), hf.config, 0, 1))
    assert next(model.parameters()).is_cuda
    ids = torch.randint(0, hf.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        expected = hf(ids).logits
        got = mm.forward_logits(model.eval(), ids)
    assert (got - expected).abs().max().item() <= 1e-4




def _policy():
    from yatt_hpc.train.policy import MegatronPolicy

    return MegatronPolicy.from_hf(DEMO / "policy", 0, 1, TrainConfig(lr=1e-3, kl_coef=0.01, micro_batch_size=4))


def _device_bytes(policy) -> int:
    tensors = list(policy.model.parameters()) + list(policy.reference.parameters())
    tensors += [v for s in policy.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_grpo_update_on_cuda_and_release_resume_is_exact(nccl_world):
    kept, moved = _policy(), _policy()
    assert kept.device.type == "cuda"
    batch, adv = _batch(kept.hf_config.vocab_size)
    tokens = float(batch.response_len.sum())
    first = kept.update(batch, adv)
    moved.update(batch, adv)
    assert math.isfinite(first.loss) and first.grad_norm > 0 and first.tokens == tokens

    footprint = _device_bytes(moved)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved.release_memory()
    freed = before - torch.cuda.memory_allocated()
    assert all(p.device.type == "cpu" for p in moved.model.parameters())
    assert freed >= 0.95 * footprint, (freed / MIB, footprint / MIB)

    moved.resume_memory()
    assert moved.device.type == "cuda"
    kept.update(batch, adv)
    moved.update(batch, adv)
    for (name, a), (_, b) in zip(kept.model.named_parameters(), moved.model.named_parameters()):
        assert torch.equal(a, b), name


def test_rollout_engine_and_judge_release_their_device_memory():
    from yatt_hpc.reward.judge import GenRMJudge

    engine = build_engine("hf", str(DEMO / "policy"), device="cuda", tp_size=1, seed=0)
    request = GenerationRequest(sample_id=7, prompt_ids=np.array([5, 6, 7, 8], np.int32), max_new_tokens=8,
                                temperature=1.0, top_p=1.0)
    before = engine.generate([request])[0]
    held = torch.cuda.memory_allocated()
    engine.release_memory()
    assert torch.cuda.memory_allocated() < held
    engine.resume_memory()
    after = engine.generate([request])[0]
    assert np.array_equal(before.response_ids, after.response_ids)  # same seed, same weights after the round trip
    engine.shutdown()

    judge = GenRMJudge.from_pretrained(DEMO / "judge", device="cuda")
    verdict = judge.generate_verdicts([("reverse abcdab=", "badcba")])
    held = torch.cuda.memory_allocated()
    judge.release_memory()
    assert torch.cuda.memory_allocated() < held
    judge.resume_memory()
    assert judge.generate_verdicts([("reverse abcdab=", "badcba")]) == verdict
