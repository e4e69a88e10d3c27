"""PPO with a critic under real mpirun (the demo: 2 trainer ranks, colocated): it learns the demo, the critic trains
alone in its warm-up, a resume from a checkpoint ends bitwise where the straight run ends (policy, critic and both
AdamW states), and `ckpt export-hf --critic` writes a value model transformers loads.

    .venv/bin/python -m pytest tests/mpi/test_critic_run.py -q     (bf16 sharded, and pp=3: make test-faults)
"""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, full_matrix_only, mpi_env

CONFIG = str(REPO / "configs/demo_cpu.yaml")
PPO = ["train.adv_estimator=gae", "train.critic.lr=1e-3", "train.critic.warmup_steps=3"]
STEPS, SAVED = 20, 15


def yatt(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", *args], cwd=REPO, env=mpi_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def run(run_dir, *sets: str) -> None:
    sets = (f"train.steps={STEPS}", f"checkpoint.interval={SAVED}", "checkpoint.keep_last=2", "eval.sources=[]",
            "eval.samples_per_prompt=1", "eval.max_prompts=null",
            "logging.progress=false", *PPO, *sets)
    yatt("run", CONFIG, "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s)))


@pytest.mark.parametrize("sets", [
    pytest.param([], id="fp32"),
    # the critic's AdamW sharded over the two dp ranks, bf16 parameters with fp32 masters
    pytest.param(["train.shard_optimizer=true", "model.dtype=bfloat16"], id="bf16-sharded", marks=full_matrix_only),
    # three pipeline stages, one layer of the policy and of the critic each (the head on the last)
    pytest.param(["placement.trainer.tasks_per_node=3", "placement.trainer.pp=3", "placement.trainer.dp=1"],
                 id="pp3", marks=full_matrix_only),
])
def test_ppo_with_a_critic_learns_the_demo_and_resumes_bitwise(mpirun, tmp_path, sets):
    straight = tmp_path / "straight"
    run(straight, *sets)
    summary = json.loads((straight / "summary.json").read_text())
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    print("PPO+critic reward:", [round(r["reward/mean"], 3) for r in rows])
    print("critic:", [{k.split("/")[1]: round(v, 3) for k, v in r.items() if k.startswith("critic/")} for r in rows[-1:]])
    assert summary["reward_gain"] >= 0.2, summary
    # the warm-up: the critic trains alone for 3 steps, then both
    assert [r["train/optimizer_steps"] for r in rows[:5]] == [0, 0, 0, 1, 1]
    assert all(r["critic/value_loss"] > 0 and r["critic/lr"] == 1e-3 for r in rows)
    assert abs(rows[-1]["critic/value_mean"] - rows[-1]["critic/return_mean"]) < 0.25, rows[-1]  # it tracks R
    assert all(-1.0 <= r["critic/explained_var"] <= 1.0 and 0 <= r["critic/value_clip_frac"] <= 1 for r in rows)

    # resume: the run directory as it was after step SAVED, run on to STEPS
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS}")
    run(resumed, *sets)
    end_a, end_b = straight / "checkpoints" / f"step-{STEPS}", resumed / "checkpoints" / f"step-{STEPS}"
    files = sorted(p.name for p in end_a.glob("*.safetensors"))
    policy_files = [f for f in files if f.startswith(("model-", "optim-"))]
    assert sorted(f"critic-{f.removeprefix('model-')}" if f.startswith("model-") else f"critic-{f}"
                  for f in policy_files) == [f for f in files if f.startswith("critic-")]  # one per policy file
    assert files == sorted(p.name for p in end_b.glob("*.safetensors"))
    for name in files:
        a, b = load_file(str(end_a / name)), load_file(str(end_b / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after resume"

    # the critic as a transformers value model
    from transformers import AutoModelForTokenClassification

    yatt("ckpt", "export-hf", str(straight), "--step", str(STEPS), "--out", str(tmp_path / "critic"), "--critic")
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert model.config.num_labels == 1
    last = sorted(end_a.glob("critic-tp0-pp*.safetensors"))[-1]  # the head is on the last stage
    head = load_file(str(last))["output_layer.weight"]
    assert torch.equal(model.classifier.weight.detach(), head)
