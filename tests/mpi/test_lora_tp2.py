"""Real `mpirun -np 2`: LoRA adapters on a TP=2 Megatron model compute what the real peft library computes on the HF model.

    .venv/bin/python -m pytest tests/mpi/test_lora_tp2.py -q

One mpirun runs three tiny architectures (tests/mpi/lora_tp2_worker.py): GPT-2 (fused c_attn, Conv1D), Qwen2 (GQA,
q/k/v biases, every linear layer) and Llama with some of a fused layer's modules only. Column-parallel layers split
B and replicate A, row-parallel ones split A and replicate B; each rank's report says what it measured.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env
from tests.mpi.lora_tp2_worker import CASES

WORKER = str(REPO / "tests/mpi/lora_tp2_worker.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reports(mpirun, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lora_tp2")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", PYTHON, WORKER, str(out)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", [pytest.param(c, id=c) for c in CASES])
def test_tp2_adapters_give_peft_logits_and_gradients_on_every_rank(reports, case):
    for report in reports:
        got = report["cases"][case]
        assert got["logits_vs_peft_max_abs_diff"] <= TOLERANCE
        assert got["adapter_grad_keys_equal"]
        assert got["adapter_grads_vs_peft_max_rel_diff"] <= TOLERANCE  # replicated ones: this rank's own copy
        assert got["split_tensors"] > 0


@pytest.mark.parametrize("case", [pytest.param(c, id=c) for c in CASES])
def test_tp2_merged_weights_gathered_equal_the_merge_by_hand(reports, case):
    for report in reports:
        got = report["cases"][case]
        assert got["merged_keys_equal"] and got["merged_vs_hand_max_abs_diff"] <= 1e-6


@pytest.mark.parametrize("case", [pytest.param(c, id=c) for c in CASES])
def test_tp2_dropout_keeps_replicated_adapter_gradients_equal_over_the_ranks(reports, case):
    for report in reports:
        got = report["cases"][case]
        assert got["dropout_grads_nonzero"] and got["dropout_replicated_grad_spread"] == 0.0
