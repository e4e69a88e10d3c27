"""Real `mpirun -np 2`: the value model split over two tensor ranks or two pipeline stages, or its samples over two
data-parallel ranks, gives the values and the updates of one rank (GPT-2 with tied embeddings, and a Llama with
GQA and an untied head; pipeline stages on the Llama, whose 2 layers split in two), every rank the same values.

    .venv/bin/python -m pytest tests/mpi/test_critic_layouts.py -q     (in `make test-faults`)
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.conftest import PYTHON, REPO, full_matrix_only, mpi_env
from tests.mpi.convert_tp2_worker import tiny_hf_model

pytestmark = full_matrix_only
DEMO_POLICY = str(REPO / "models" / "demo" / "policy")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[str]:
    llama = tmp_path_factory.mktemp("llama") / "model"
    tiny_hf_model("llama-gqa-untied-vocab61").save_pretrained(llama)
    return [DEMO_POLICY, str(llama)]


def _layout(mpirun, out, ranks: int, tp: int, models: list[str], pp: int = 1) -> list[dict]:
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), PYTHON, "-m",
           "tests.programs.critic_update", "--out", str(out), "--tp", str(tp), "--pp", str(pp),
           *(a for m in models for a in ("--model", m))]
    proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [dict(np.load(out / f"rank-{r}.npz")) for r in range(ranks)]


def test_tensor_pipeline_and_data_parallel_critics_give_the_single_rank_values_and_updates(mpirun, tmp_path, models):
    one = _layout(mpirun, tmp_path / "one", 1, 1, models)[0]
    tp2 = _layout(mpirun, tmp_path / "tp2", 2, 2, models)
    dp2 = _layout(mpirun, tmp_path / "dp2", 2, 1, models)
    pp2 = _layout(mpirun, tmp_path / "pp2", 2, 1, models[1:], pp=2)
    for report in pp2:  # both stages report the last stage's values
        for key in ("before", "after"):
            np.testing.assert_allclose(report[f"{key}0"], one[f"{key}1"], atol=2e-5, err_msg=f"pp2 {key}")
    for index in range(len(models)):
        ids = one[f"ids{index}"]
        for key in ("before", "after"):
            ref = one[f"{key}{index}"]
            for report in tp2:  # both tensor ranks hold every sample and the same values
                np.testing.assert_allclose(report[f"{key}{index}"], ref, atol=2e-5, err_msg=f"tp2 {key} {models[index]}")
            # the dp ranks hold disjoint groups; put their values back in the reference's sample order
            held = {}
            for report in dp2:
                counts = _lengths(report, index)
                for sample, values in zip(report[f"ids{index}"], np.split(report[f"{key}{index}"], np.cumsum(counts)[:-1])):
                    held[int(sample)] = values
            np.testing.assert_allclose(np.concatenate([held[int(s)] for s in ids]), ref, atol=2e-5,
                                       err_msg=f"dp2 {key} {models[index]}")
        assert np.abs(one[f"after{index}"] - one[f"before{index}"]).max() > 1e-3  # the updates moved the values


def _lengths(report: dict, index: int) -> np.ndarray:
    from tests.programs.dp_update import global_batch

    batch = global_batch()
    by_id = dict(zip(batch.sample_id.tolist(), batch.response_len.tolist()))
    return np.array([by_id[int(s)] for s in report[f"ids{index}"]])
