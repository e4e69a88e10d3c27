"""Real `yatt-hpc run` of a mixture-of-experts policy: a random tiny Qwen3-MoE over the demo's tokenizer, trainer
dp 2 (every rank every expert) or tp 2 (each expert split, each tensor rank routing half the tokens), and a tiny
Qwen2-MoE (its gated shared expert) at tp 2, the HF engine taking the experts one by one by their checkpoint names
(the shared expert as plain linears), then `ckpt export-hf` loaded by transformers; and
runs with routing replay (`train.moe_routing_replay`) at dp 2 and tp 2.

    YATT_FULL_FAULT_MATRIX=1 .venv/bin/python -m pytest tests/mpi/test_moe_run.py -q   # ~3 min on 2 busy cores; make test-faults
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import NO_EVAL, PYTHON, REPO, full_matrix_only, mpi_env
from yatt_hpc.demo.tiny_models import char_qwen2_moe, char_qwen3_moe, save_char_model
from yatt_hpc.metrics.writer import step_rows

pytestmark = full_matrix_only
CONFIG = str(REPO / "configs/demo_cpu.yaml")
FAST = {"train.steps": "2", "train.prompts_per_step": "8", "rollout.samples_per_prompt": "4",
        "checkpoint.interval": "2", "checkpoint.async": "false", "logging.progress": "false",
        **dict(item.split("=", 1) for item in NO_EVAL)}


def _run(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", *args], cwd=REPO, env=mpi_env(),
                          capture_output=True, text=True, timeout=timeout)


LAYOUTS = {"dp2": "{nodes: 1, tasks_per_node: 2, tp: 1, dp: 2}", "tp2": "{nodes: 1, tasks_per_node: 2, tp: 2, dp: 1}"}
RUNS = {"dp2": (char_qwen3_moe, "dp2"), "tp2": (char_qwen3_moe, "tp2"), "qwen2moe-tp2": (char_qwen2_moe, "tp2")}


@pytest.fixture(scope="module", params=list(RUNS))
def moe_run(request, mpirun, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"moe_run_{request.param}")
    model, layout = RUNS[request.param]
    policy = save_char_model(model(seed=0), root / "policy")
    overrides = {**FAST, "model.path": policy, "placement.trainer": LAYOUTS[layout]}
    sets = [x for key, value in overrides.items() for x in ("--set", f"{key}={value}")]
    proc = _run("run", CONFIG, "--run-dir", str(root / "run"), *sets)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return root


def test_a_moe_policy_trains_and_its_engine_holds_the_synced_experts(moe_run):
    rows = step_rows(moe_run / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0
        # step 2 samples with the weights step 1 synced: a stale or misplaced expert would show here
        assert r["train/rollout_logp_diff_max"] < 1e-4, r
        # 2 layers of 4 experts, 2 per token: a layer's busiest expert has 1x to 2x the mean
        assert 1.0 <= r["moe/load_max_over_mean"] <= 2.0 and "moe/load_max_over_mean/layer1" in r


def test_export_hf_of_a_moe_checkpoint_loads_in_transformers_with_the_trainers_logits(moe_run):
    out = moe_run / "hf"
    proc = _run("ckpt", "export-hf", str(moe_run / "run"), "--step", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step_dir = next((moe_run / "run" / "checkpoints").glob("step-2*"))
    check = subprocess.run([PYTHON, str(REPO / "tests/mpi/moe_worker.py"), "export", str(step_dir), str(out)],
                           env=mpi_env(), capture_output=True, text=True, timeout=300, check=False)
    assert check.returncode == 0, check.stderr[-3000:]
    gap = json.loads(check.stdout.strip().splitlines()[-1])["export_logits_max_abs_diff"]
    assert gap <= 1e-5


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_a_run_with_routing_replay_trains_and_reports_the_gap_and_the_agreement(layout, mpirun, tmp_path):
    """train.moe_routing_replay in a real run: the rollout ranks' engines record, the batches carry the experts
    to the trainer (over tp 2, each tensor rank replaying its half of the tokens), and the update trains with
    them. fp32 engine and trainer route alike, so the replayed routing changes no log-prob beyond rounding
    (a token replayed at another position would go to other experts) and the agreement is ~1."""
    policy = save_char_model(char_qwen3_moe(seed=0), tmp_path / "policy")
    overrides = {**FAST, "model.path": policy, "placement.trainer": LAYOUTS[layout], "train.moe_routing_replay": "true"}
    sets = [x for key, value in overrides.items() for x in ("--set", f"{key}={value}")]
    proc = _run("run", CONFIG, "--run-dir", str(tmp_path / "run"), *sets)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = step_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["train/rollout_logp_diff_max"] < 1e-4, r
        assert r["moe/routing_agreement"] > 0.99, r
