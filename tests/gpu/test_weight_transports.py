"""The device-to-device weight transports on CUDA: CUDA IPC on one GPU, NCCL broadcast into SGLang across two.

Run on a CUDA machine: .venv/bin/python -m pytest tests/gpu/test_weight_transports.py -ra
Skips, printing why, without CUDA (all), without sglang (the SGLang cases) or with one GPU (the NCCL case).
The trainer owner is a process of its own (multiprocessing `spawn`), as a trainer rank is; the engine
side is this process. The CPU twins: tests/mpi/test_weight_collective.py (Gloo, HF engine) and
tests/unit/test_sglang_weights.py (the SGLang adapter against a stand-in).
"""
from __future__ import annotations

import importlib.util
import multiprocessing

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("weight transport GPU tests need CUDA: torch.cuda.is_available() is False", allow_module_level=True)

from yatt_hpc.comm.weight_ipc import ipc_payload, rebuild_ipc_bucket  # noqa: E402
from yatt_hpc.device.weight_group import BucketManifest, PairGroup, Rendezvous, host_pair_store  # noqa: E402

needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang: pip install -e '.[gpu]'")
TIMEOUT_S = 300


def tensors(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [("a", torch.randn(64, 32, generator=g).to(device)), ("b", torch.randn(7, generator=g).bfloat16().to(device)),
            ("c", torch.randn(3, 4, generator=g).t().to(device))]  # c: not contiguous


def model_buckets(model_dir: str, device: str) -> list[list[tuple[str, torch.Tensor]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    named = [(n, p.detach().to(device)) for n, p in model.named_parameters()]
    half = len(named) // 2
    return [named[:half], named[half:]]


def ipc_owner(conn, what: str, model_dir: str | None) -> None:
    """A trainer owner on GPU 0: each bucket's IPC handles as bytes, then wait until the engine has its copies."""
    buckets = [tensors("cuda:0")] if what == "tensors" else model_buckets(model_dir, "cuda:0")
    for bucket in buckets:
        payload, shared = ipc_payload(bucket)
        conn.send_bytes(payload.tobytes())
        assert conn.recv() == "done"
        del shared


def nccl_owner(conn, model_dir: str) -> None:
    """A trainer owner on GPU 0: hosts the pair's store, connects as rank 0, broadcasts each bucket when told."""
    torch.cuda.set_device(0)
    rendezvous, store = host_pair_store("yatt-weights-gpu-test", engine_ranks=1, backend="nccl")
    conn.send(rendezvous.as_dict())
    group = PairGroup.connect(rendezvous, 0, store)
    for bucket in model_buckets(model_dir, "cuda:0"):
        assert conn.recv() == "go"
        group.broadcast([t.contiguous() for _, t in bucket])
    conn.send("sent")


def start(target, *args):
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, *args), daemon=True)
    proc.start()
    theirs.close()
    return mine, proc


def answer(conn):
    assert conn.poll(TIMEOUT_S), f"the owner process said nothing for {TIMEOUT_S} s"
    return conn.recv()


def test_ipc_handles_rebuild_the_owners_tensors_bitwise_and_the_copies_outlive_the_owner():
    conn, proc = start(ipc_owner, "tensors", None)
    assert conn.poll(TIMEOUT_S)
    bucket = rebuild_ipc_bucket(np.frombuffer(conn.recv_bytes(), np.uint8))
    conn.send("done")
    proc.join(60)
    assert proc.exitcode == 0
    for (name, got), (_, want) in zip(bucket, tensors("cuda:0")):
        assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), name


def _sglang_engine(model_dir: str, device: str):
    from yatt_hpc.rollout import build_engine

    return build_engine("sglang", model_dir, device=device, tp_size=1, seed=0, deterministic=True,
                        mem_fraction_static=0.3, enable_memory_saver=False)


def _serves(engine, model_dir: str, other_model_dir: str) -> None:
    from tests.gpu.test_sglang_engine import LOGPROB_ATOL, _fp32_model, _requests, _teacher_forced_logprobs

    results = engine.generate(_requests())
    new_reference, old_reference = _fp32_model(other_model_dir), _fp32_model(model_dir)
    new_error = max(np.abs(r.logprobs - _teacher_forced_logprobs(new_reference, r)).max() for r in results)
    old_error = max(np.abs(r.logprobs - _teacher_forced_logprobs(old_reference, r)).max() for r in results)
    assert new_error <= LOGPROB_ATOL < old_error, (new_error, old_error)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.gpu.test_sglang_engine import _save_tiny_llama

    return (_save_tiny_llama(tmp_path_factory.mktemp("llama_a"), seed=0),
            _save_tiny_llama(tmp_path_factory.mktemp("llama_b"), seed=1))


@needs_sglang
def test_ipc_buckets_into_update_weights_from_tensor_serve_the_owners_model(models):
    model_dir, other_model_dir = models
    engine = _sglang_engine(model_dir, "cuda:0")
    try:
        conn, proc = start(ipc_owner, "model", other_model_dir)
        for i in range(2):
            assert conn.poll(TIMEOUT_S)
            engine.update_weights(rebuild_ipc_bucket(np.frombuffer(conn.recv_bytes(), np.uint8)), final=i == 1)
            conn.send("done")
        proc.join(60)
        assert proc.exitcode == 0 and engine.weight_version == 1
        _serves(engine, model_dir, other_model_dir)
    finally:
        engine.shutdown()


@needs_sglang
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL holds one rank per GPU: the owner and the engine need 2")
def test_nccl_broadcast_into_update_weights_from_distributed_serves_the_owners_model(models):
    model_dir, other_model_dir = models
    engine = _sglang_engine(model_dir, "cuda:1")
    try:
        conn, proc = start(nccl_owner, other_model_dir)
        engine.join_weight_group(Rendezvous.from_dict(answer(conn)))
        buckets = model_buckets(other_model_dir, "cpu")  # the manifests: names, dtypes, shapes
        for i, bucket in enumerate(buckets):
            conn.send("go")
            engine.update_weights_from_group(BucketManifest.of("yatt-weights-gpu-test", bucket, final=i == len(buckets) - 1))
        assert answer(conn) == "sent"
        proc.join(60)
        assert proc.exitcode == 0 and engine.weight_version == 1
        _serves(engine, model_dir, other_model_dir)
    finally:
        engine.shutdown()
