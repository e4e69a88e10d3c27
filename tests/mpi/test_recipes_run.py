"""Real runs of the recipe layer: every advantage/loss family learns the demo, an update split over two
data-parallel ranks and into micro-batches equals the single-rank one for every aggregation, and validation
runs on its schedule through a resume.

    .venv/bin/python -m pytest tests/mpi/test_recipes_run.py -q
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, full_matrix_only, mpi_env

CONFIG = str(REPO / "configs/demo_cpu.yaml")
PYTHON = sys.executable


def yatt_run(run_dir, *sets: str, timeout=600):
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir),
                           "--set", "logging.progress=false", *args],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ each family learns the demo

FAMILIES = {
    "grpo": [],  # the default: grpo (sample std), vanilla clip-higher, token-mean, k3 in the loss
    "dr_grpo": ["train.norm_adv_by_std=false", "train.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": ["train.adv_estimator=rloo"],
    "reinforce_plus_plus_baseline": ["train.adv_estimator=reinforce_plus_plus_baseline"],
    "gspo": ["train.loss_mode=gspo"],
    "cispo": ["train.loss_mode=cispo"],
    "ppo_gae": ["train.adv_estimator=gae", "train.critic.lr=1e-3", "train.critic.warmup_steps=3"],  # docs/critic.md
}
IN_CI = ("dr_grpo", "cispo")  # another estimator+aggregation and another loss; the rest in `make test-faults`
# (the default grpo learns in every demo run: tests/mpi/test_grpo_run.py)


@pytest.mark.parametrize("family", [f if f in IN_CI else pytest.param(f, marks=full_matrix_only) for f in FAMILIES])
def test_each_family_learns_the_demo(mpirun, tmp_path, family):
    yatt_run(tmp_path / family, "train.steps=60", "checkpoint.interval=0", *FAMILIES[family])
    summary = json.loads((tmp_path / family / "summary.json").read_text())
    assert summary["reward_gain"] >= 0.2, (family, summary)


# ------------------------------------------------------------------ exact over ranks and micro-batches


def _update(mpirun, out, ranks: int, *sets: str) -> dict:
    out.mkdir(exist_ok=True)
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", str(ranks), PYTHON, "-m", "tests.programs.dp_update",
                           "--out", str(out), *(a for s in sets for a in ("--set", s))],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out / f"params-{ranks}.npz"))


@pytest.mark.parametrize("sets", [
    pytest.param(["loss_agg_mode=token-mean"], id="token-mean"),
    # the other sequence-level aggregations: `make test-faults` (the same sums, another normaliser; hand-checked in
    # tests/unit)
    pytest.param(["loss_agg_mode=seq-mean-token-mean"], id="seq-mean-token-mean", marks=full_matrix_only),
    pytest.param(["loss_agg_mode=seq-mean-token-sum"], id="seq-mean-token-sum", marks=full_matrix_only),
    pytest.param(["loss_agg_mode=seq-mean-token-sum-norm", "norm_adv_by_std=false"], id="seq-mean-token-sum-norm"),
    pytest.param(["loss_mode=gspo", "mini_batches=2", "mask_truncated=true"], id="gspo-minibatches-masked"),
    pytest.param(["adv_estimator=reinforce_plus_plus_baseline", "kl_coef=0.1", "kl_estimator=k3+"],
                 id="rpp-baseline-whitened-k3plus"),
])
def test_two_data_parallel_ranks_and_small_micro_batches_give_the_single_rank_update(mpirun, tmp_path, sets):
    # the reference: one rank, the whole batch in one micro-batch; then 2 ranks x micro-batches of 3 samples
    one = _update(mpirun, tmp_path / "one", 1, *sets, "micro_batch_size=24")
    two = _update(mpirun, tmp_path / "two", 2, *sets, "micro_batch_size=3")
    start = _update(mpirun, tmp_path / "zero", 1, *sets, "micro_batch_size=24", "lr=1e-12")
    moved = max(float(np.abs(one[n] - start[n]).max()) for n in one)
    assert moved > 1e-4, "the update must move the weights for the comparison to mean anything"
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------ validation


EVAL = ["eval.sources=[demo:heldout]", "eval.max_prompts=16", "eval.samples_per_prompt=4", "eval.every=2",
        "checkpoint.interval=2"]


def test_validation_runs_on_schedule_and_a_resumed_run_keeps_it(mpirun, tmp_path):
    run = tmp_path / "run"
    yatt_run(run, "train.steps=4", *EVAL)
    yatt_run(run, "train.steps=6", *EVAL)  # resumes from checkpoint step 4 and goes on to 6
    got = rows(run)
    assert [r["step"] for r in got] == list(range(0, 7)), "every step once, the validation before step 1 at 0"
    validated = [r["step"] for r in got if "val/demo_heldout/accuracy" in r]
    assert validated == [0, 2, 4, 6]
    for r in got:
        if r["step"] in validated:
            assert r["val/demo_heldout/prompts"] == 16
            assert {f"val/demo_heldout/pass@{k}" for k in (1, 2, 4)} <= r.keys()
            assert r["val/demo_heldout/pass@1"] == pytest.approx(r["val/demo_heldout/accuracy"])
            assert r["val/demo_heldout/pass@1"] <= r["val/demo_heldout/pass@2"] <= r["val/demo_heldout/pass@4"]
            assert r["time/eval"] > 0
    assert "reward/mean" not in got[0] and all("reward/mean" in r for r in got[1:])
    subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "report", str(run)], cwd=REPO, check=True, capture_output=True)
    assert (run / "report.png").stat().st_size > 0


def test_greedy_validation_of_two_sources_after_every_step(mpirun, tmp_path):
    run = tmp_path / "run"
    yatt_run(run, "train.steps=2", "checkpoint.interval=0", "eval.sources=[demo:heldout, demo:train]",
             "eval.max_prompts=8", "eval.samples_per_prompt=1", "eval.temperature=0", "eval.before_train=false", "eval.every=1")
    got = rows(run)
    assert [r["step"] for r in got] == [1, 2]  # no validation before training
    for r in got:
        for name in ("demo_heldout", "demo_train"):
            assert r[f"val/{name}/prompts"] == 8 and f"val/{name}/pass@2" not in r  # one greedy sample each
