"""Real `mpirun -np 3`: the multi-rank commit protocol, exact RNG/data resume, and a TP=2 HF export.

    .venv/bin/python -m pytest tests/mpi/test_ckpt_commit.py -q

Ranks 0, 1 are trainer TP shards (TP=2, dp0), rank 2 a rollout rank that saves only its RNG state.
One mpirun saves (tests/programs/ckpt_ranks.py save), a second one resumes in fresh processes.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env
from tests.unit.test_ckpt_export import TOLERANCE, max_logit_diff
from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.export_hf import export_hf
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.ckpt.state import identities, read_manifest

PROGRAM = str(REPO / "tests/programs/ckpt_ranks.py")
NP = 3


def _mpirun(mpirun, *args) -> None:
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(NP), PYTHON, PROGRAM, *map(str, args)]
    proc = subprocess.run(cmd, env=mpi_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(mpirun, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_mpi")
    out, run_dir, model_dir = root / "out", root / "run", root / "model"
    out.mkdir()
    _mpirun(mpirun, "save", out, run_dir, model_dir)
    saved = {r: json.loads((out / f"save-{r}.json").read_text()) for r in range(NP)}
    incomplete_after_save = [p.name for p in layout.list_incomplete(layout.checkpoints_dir(run_dir))]
    _mpirun(mpirun, "resume", out, run_dir)
    resumed = {r: json.loads((out / f"resume-{r}.json").read_text()) for r in range(NP)}
    return {"saved": saved, "resumed": resumed, "run_dir": run_dir, "model_dir": model_dir,
            "incomplete_after_save": incomplete_after_save}


def test_three_ranks_commit_one_checkpoint_with_every_rank_in_it(runs):
    ckpt = layout.checkpoints_dir(runs["run_dir"])
    assert [(s.step, s.committed) for s in layout.list_steps(ckpt)] == [(2, True), (3, True)]  # keep_last=2
    step3 = ckpt / "step-3"
    assert verify_step(step3) is None
    assert sorted(e.name for e in read_manifest(step3 / "state.h5")) == [
        "model-tp0-pp0.safetensors", "model-tp1-pp0.safetensors",
        "optim-tp0-pp0-dp0.safetensors", "optim-tp1-pp0-dp0.safetensors"]
    assert identities(step3 / "state.h5") == {
        "trainer/dp0/tp0/pp0": {"world_rank": 0, "coords": {"dp": 0, "pp": 0, "tp": 0}},
        "trainer/dp0/tp1/pp0": {"world_rank": 1, "coords": {"dp": 0, "pp": 0, "tp": 1}},
        "rollout/r0": {"world_rank": 2, "coords": {}}}


def test_writer_thread_collectives_run_beside_the_training_loops_collectives(runs):
    for rep in runs["saved"].values():
        assert rep["thread_level"] == rep["multiple"]
        assert [rep[f"allreduce_{s}"] for s in (1, 2, 3)] == [3 + 3 * s for s in (1, 2, 3)]


def test_a_failure_on_the_leader_is_raised_on_every_rank_and_commits_nothing(runs):
    errors = {r: rep["step4_error"] for r, rep in runs["saved"].items()}
    assert all(e and "checkpoint step 4 was not committed" in e and "without pickle" in e for e in errors.values())
    assert len(set(errors.values())) == 1
    assert runs["incomplete_after_save"] == ["step-4.incomplete"]
    assert layout.list_incomplete(layout.checkpoints_dir(runs["run_dir"])) == []  # removed by the restart


def test_resume_restores_each_ranks_tensors_data_position_and_random_streams(runs):
    for rank in range(NP):
        saved, resumed = runs["saved"][rank], runs["resumed"][rank]
        assert resumed["step"] == 3 and resumed["saved_world_rank"] == rank
        assert resumed["counters"] == {"step": 3}
        assert resumed["draws_after_resume"] == saved["draws_after_save"]
        assert resumed["model_equal"] and resumed["optim_equal"]
    for rank in range(2):
        assert runs["resumed"][rank]["data_next"] == 48
        assert runs["resumed"][rank]["data_ids"] == [100 * rank + i for i in range(3)]
        assert runs["resumed"][rank]["model_keys"] > 0 and runs["resumed"][rank]["optim_keys"] > 0
    assert runs["resumed"][2]["model_keys"] == 0 and runs["resumed"][2]["data_next"] is None


def test_tp2_checkpoint_exports_to_hf_with_the_original_logits(runs, tmp_path):
    from tests.mpi.convert_tp2_worker import tiny_hf_model

    out = export_hf(runs["run_dir"], 3, tmp_path / "hf").out
    assert max_logit_diff(tiny_hf_model("gpt2-tied").eval(), out) <= TOLERANCE
