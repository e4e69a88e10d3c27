"""`train.off_policy` on real runs: the ratio against the trainer's recomputed (proximal) log-probabilities, and
the importance weight pi_proximal / pi_behavior corrected as configured, measured per step.

    .venv/bin/python -m pytest tests/mpi/test_off_policy_run.py -q

fp32: the engine and the trainer hold the same weights, so every weight is 1 up to float order (|log w| < 1e-4)
and a cap of exactly 1 truncates about the half of the tokens whose weight rounds above 1. bf16 engines differ
from the trainer by ~1e-2 in log-probability: a mask of [0.99, 1.01] drops some of their tokens.
"""

from tests.mpi.test_sharded_optimizer import yatt_run
from yatt_hpc.metrics.writer import step_rows

FAST = ["train.steps=2", "train.prompts_per_step=8", "rollout.samples_per_prompt=4", "eval.every=0",
        "checkpoint.interval=0", "train.off_policy.proximal=recompute"]


def test_the_ratio_is_taken_against_the_trainers_own_weights(mpirun, tmp_path):
    yatt_run(tmp_path / "fp32", *FAST, "train.off_policy.correction=token_truncate", "train.off_policy.cap=1.0")
    rows = step_rows(tmp_path / "fp32")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert abs(r["off_policy/is_weight_mean"] - 1.0) < 1e-4, r
        assert 1.0 <= r["off_policy/is_weight_max"] < 1.0 + 1e-3
        assert 0.02 < r["off_policy/truncated_frac"] < 0.98 and r["off_policy/masked_frac"] == 0.0
        assert r["train/rollout_logp_diff_max"] < 1e-4  # the behavior/proximal gap, measured before the update
        assert r["train/grad_norm"] > 0


def test_bf16_engines_are_corrected_and_measured(mpirun, tmp_path):
    yatt_run(tmp_path / "bf16", *FAST, "model.dtype=bfloat16", "train.off_policy.correction=token_mask",
             "train.off_policy.mask_low=0.99", "train.off_policy.mask_high=1.01")
    rows = step_rows(tmp_path / "bf16")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 < r["off_policy/masked_frac"] < 1.0, r
        assert r["off_policy/truncated_frac"] == 0.0
        assert r["off_policy/is_weight_max"] > 1.01  # the weights the mask dropped are measured, raw
        assert 1e-3 < r["train/rollout_logp_diff_max"] < 1.0
