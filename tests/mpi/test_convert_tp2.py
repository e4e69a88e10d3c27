"""Real `mpirun -np 2`: a TP=2 Megatron model loaded from HF weights computes HF's logits and log-probs.

    .venv/bin/python -m pytest tests/mpi/test_convert_tp2.py -q

One mpirun runs every tiny architecture (tests/mpi/convert_tp2_worker.py); each rank writes a JSON
report and the tests below assert on both ranks' reports, one architecture per test.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env
from tests.mpi.convert_tp2_worker import TINY_CASES

WORKER = str(REPO / "tests/mpi/convert_tp2_worker.py")
CASES = [pytest.param(name, id=name) for name in TINY_CASES]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tp2_reports(mpirun, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("convert_tp2")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", PYTHON, WORKER, str(out)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    return reports


@pytest.mark.parametrize("case", CASES)
def test_tp2_logits_gathered_over_ranks_equal_hf_logits(tp2_reports, case):
    for report in tp2_reports:
        assert report["cases"][case]["logits_max_abs_diff_vs_hf"] <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_tp2_logprobs_entropy_and_gradients_equal_tp1_values(tp2_reports, case):
    for report in tp2_reports:
        got = report["cases"][case]
        assert got["logp_tp_vs_tp1_max_abs_diff"] <= TOLERANCE
        assert got["entropy_tp_vs_tp1_max_abs_diff"] <= TOLERANCE
        assert got["grad_tp_vs_tp1_max_abs_diff"] <= TOLERANCE
        assert got["logp_vs_hf_log_softmax_max_abs_diff"] <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_tp2_parameter_gradients_on_every_rank_equal_hf_gradients(tp2_reports, case):
    for report in tp2_reports:
        assert report["cases"][case]["param_grads_vs_hf_max_rel_diff"] <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_tp2_shared_prompt_forward_gives_the_padded_logprobs(tp2_reports, case):
    """train/shared_prompt.py with vocab-parallel logits and heads split over TP (the unit test is TP=1)."""
    for report in tp2_reports:
        assert report["cases"][case]["shared_prompt_vs_padded_logp_max_abs_diff"] <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_tp2_shards_gathered_to_hf_equal_the_original_state_dict(tp2_reports, case):
    for report in tp2_reports:
        assert report["cases"][case]["gathered_keys_equal"]
        assert report["cases"][case]["gathered_bitwise_equal"]


def test_each_tp2_rank_holds_half_of_the_padded_vocab(tp2_reports):
    widths = {case: {r["cases"][case]["local_vocab_width"] for r in tp2_reports} for case in TINY_CASES}
    assert widths == {"gpt2-tied": {32}, "llama-gqa-untied-vocab61": {31}, "llama3-rope-scaling": {32},
                      "llama-linear-rope": {32}, "qwen2-gqa-qkv-bias-tied": {32},
                      "qwen3-qk-norm-head-dim32-tied": {32}, "qwen3-qk-norm-untied-vocab61": {31}}


def test_tp2_vision_language_model_scores_image_prompts_as_hf_and_gathers_back(tp2_reports):
    """Qwen2-VL at TP=2: M-RoPE language model sharded, HF vision tower replicated and trained."""
    for report in tp2_reports:
        vlm = report["vlm"]
        assert vlm["logp_vs_hf_max_abs_diff"] <= 1e-4
        assert vlm["tower_grad_vs_hf_max_rel_diff"] <= 1e-4  # every TP rank holds the whole tower gradient
        assert vlm["gathered_keys_equal"] and vlm["gathered_bitwise_equal"]
