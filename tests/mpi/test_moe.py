"""Real `mpirun -np 2`: a Qwen3-MoE, and a Qwen2-MoE with its gated shared expert, converted to Megatron's MoE layers
compute transformers' logits and gradients at ep1, tp2 and ep2, and give back the HF tensors they were loaded from,
each expert from the rank that holds it.

    .venv/bin/python -m pytest tests/mpi/test_moe.py -q

One mpirun runs the layouts (tests/mpi/moe_worker.py), with HF's router renormalising the top-k probabilities
(``norm_topk_prob``) and without; the tests assert on both ranks' reports. CI runs each layout once and both
router normalisations, and Qwen2-MoE at tp2 and ep2; `make test-faults` (YATT_FULL_FAULT_MATRIX=1) runs all twelve.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import FULL_MATRIX, PYTHON, REPO, full_matrix_only, mpi_env
from tests.mpi.moe_worker import CASES as ALL_CASES
from tests.mpi.moe_worker import RAGGED

WORKER = str(REPO / "tests/mpi/moe_worker.py")
CI_CASES = ("ep1-norm0", "tp2-norm1", "ep2-norm1", "qwen2moe-tp2-norm1", "qwen2moe-ep2-norm0")
RUN = [*(ALL_CASES if FULL_MATRIX else CI_CASES), *RAGGED]
CASES = [pytest.param(case, id=case, marks=() if case in CI_CASES else full_matrix_only) for case in ALL_CASES]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def moe_reports(mpirun, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("moe")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", PYTHON, WORKER, str(out), *RUN]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", CASES)
def test_moe_logits_equal_transformers_logits(moe_reports, case):
    for report in moe_reports:
        assert report[case]["logits_max_abs_diff_vs_hf"] <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_moe_gradients_of_every_parameter_equal_transformers_gradients(moe_reports, case):
    """Each dp rank backpropagates its own batch; dense gradients summed over dp, experts' over the ranks holding
    the same experts; HF backpropagates every batch. The router's gradient is checked on its own too."""
    for report in moe_reports:
        got = report[case]
        assert got["grads_max_rel_diff_vs_hf"] <= TOLERANCE
        assert got["router_grad_max_abs_diff_vs_hf"] <= TOLERANCE * got["router_grad_scale"]


@pytest.mark.parametrize("case", [c for c in CASES if c.values[0].startswith("qwen2moe-")])
def test_qwen2_moe_shared_expert_and_its_gate_get_transformers_gradients(moe_reports, case):
    """The shared expert (gate, up, down) and its sigmoid gate of both layers: under tp2 and ep2 it runs on the
    whole unsplit input (TokenSplitMoELayer), a tp-split dense MLP."""
    for report in moe_reports:
        got = report[case]
        assert got["shared_expert_tensors"] == 2 * 4  # layers x (gate, up, down, shared_expert_gate)
        assert got["shared_expert_grad_max_rel_diff_vs_hf"] <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_moe_weights_gathered_to_hf_are_the_loaded_tensors(moe_reports, case):
    for report in moe_reports:
        assert report[case]["gathered_bitwise_equal"]
        assert report[case]["gathered_non_expert_keys_equal"]


@pytest.mark.parametrize("case", CASES)
def test_expert_load_counts_each_real_tokens_experts_as_transformers_routes_them(moe_reports, case):
    """`ExpertLoad` on a batch with padded positions: per layer and expert, the real tokens HF's router sends there
    (under tp each rank counts its slice and the counts are summed)."""
    for report in moe_reports:
        assert report[case]["expert_load_equals_hf_routing"]
        assert report[case]["expert_load_tokens"] == 2 * (11 + 7) * 2  # layers x real tokens x top-k


def test_ep2_ranks_hold_and_give_back_disjoint_halves_of_the_experts(moe_reports):
    """Expert e of 4 lives on ep rank e // 2 only; each rank sends its own, and together they are all."""
    names = [set(report["ep2-norm1"]["expert_names"]) for report in moe_reports]
    assert [r["ep2-norm1"]["local_experts"] for r in moe_reports] == [2, 2]
    assert not names[0] & names[1]
    every = set(moe_reports[0]["ep1-norm0"]["expert_names"])
    assert names[0] | names[1] == every and len(every) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    assert all(".experts.0." in n or ".experts.1." in n for n in names[0])


def test_ep2_replicas_with_micro_batches_of_other_counts_and_shapes_get_ep1s_gradients(moe_reports):
    """Rank 0 two micro-batches ([2, 11] and [3, 4]), rank 1 one ([1, 5]), with a load-balancing loss: at ep2 each
    MoE layer pads to the expert group's token count and rank 1 runs one idle pass; the gradients (aux loss
    included, so the pads stayed out of it) equal ep1's, where no rank pads or waits."""
    assert [r["ragged-ep1"]["idle_passes"] for r in moe_reports] == [0, 0]
    assert [r["ragged-ep2"]["idle_passes"] for r in moe_reports] == [0, 1]
    for report in moe_reports:
        got = report["ragged-ep2"]
        assert got["experts_compared"] == 2 * 2 * 3  # layers x this rank's experts x (gate, up, down)
        assert got["grads_max_rel_diff_vs_ep1"] <= TOLERANCE, got


def test_tp2_ranks_each_hold_every_expert_half_wide(moe_reports):
    assert [r["tp2-norm1"]["local_experts"] for r in moe_reports] == [4, 4]
