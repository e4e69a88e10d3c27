"""The bounded stop on one GPU (configs/demo_1gpu.yaml: three colocated ranks sharing the device).

The CPU twin is tests/mpi/test_stop_grace.py; here the watchdog thread takes the checkpoint of
CUDA tensors (or of their pinned host copies while the trainer is released) while the loop thread
is still inside step 2 on the device. Step 2 is long by configuration: 64 prompts x 16 samples
trained one sample per micro-batch, all of it before the optimizer step.

Run on a CUDA machine: .venv/bin/python -m pytest tests/gpu/test_stop_on_gpu.py -ra
"""
from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU stop test needs a GPU: torch.cuda.is_available() is False", allow_module_level=True)

from tests.mpi.test_stop_grace import PROMPTS, K, interrupt_in_step_2, run_dir, start  # noqa: E402,F401
from yatt_hpc.metrics.writer import step_rows

CONFIG = "configs/demo_1gpu.yaml"
LONG = ("--set", "train.micro_batch_size=1", "--set", "checkpoint.interval=0")


def test_a_stop_in_a_long_colocated_gpu_step_commits_the_step_before_and_resumes(mpirun, run_dir):  # noqa: F811
    decided, committed, exited, _ = interrupt_in_step_2(run_dir, LONG, CONFIG)
    resumed = start(run_dir, LONG, CONFIG)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0 and "resumed from checkpoint step 1" in out, out[-3000:]
    rows = step_rows(run_dir)
    assert len(rows) == K
    positions = [p for line in (run_dir / "data" / "consumed-dp0.jsonl").read_text().splitlines()
                 for p in json.loads(line)["positions"]]
    assert sorted(positions) == list(range(K * PROMPTS)), "a prompt was lost or repeated"
    print(f"\nGPU colocate: signal -> give up {decided:.2f}s, -> committed {committed:.2f}s, -> exited {exited:.2f}s")
