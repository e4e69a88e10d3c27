"""Real `yatt-hpc run` with dynamic sampling: refill waves, EMA, padding, nothing lost or repeated.

A random tiny policy under `rule_only` never answers right, so every group has zero reward variance:
each step runs the first wave plus `max_refill_waves` refills and pads. That makes every count
exact and hand-computable (per replica: target 4 groups, oversampling 1.2, EMA decay 0.9, cap 10).
"""
import json
import math
import subprocess
import sys

from tests.conftest import REPO, mpi_env
from yatt_hpc.metrics.writer import step_rows


def test_waves_pad_and_update_the_ema(mpirun, tiny_models, tmp_path):
    args = {"model.path": tiny_models["policy"], "reward.genrm_path": tiny_models["judge"], "reward.mode": "rule_only",
            "train.steps": 2, "train.prompts_per_step": 8, "rollout.samples_per_prompt": 4,
            "rollout.dynamic_sampling.enabled": "true", "rollout.dynamic_sampling.max_refill_waves": 2,
            "logging.progress": "false"}
    sets = [a for k, v in args.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"),
                           "--run-dir", str(tmp_path), *sets], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(tmp_path)
    ema = 1.0
    for r in rows:
        refill = math.ceil(4 * ema * 1.2)
        per_replica = 4 + 2 * refill                      # first wave + 2 refills, nothing valid
        assert r["data/prompts_consumed"] == 2 * per_replica
        assert r["rollout/generated"] == r["reward/scored"] == 2 * per_replica * 4
        assert r["sampling/waves"] == 3 and r["sampling/valid_group_ratio"] == 0.0
        assert r["sampling/padded_groups"] == 8           # 4 per replica trained with zero advantage
        ema = 0.9 * ema + 0.1 * 10.0                      # expansion of a step with no valid group = cap
        assert abs(r["sampling/ema_expansion"] - ema) < 1e-9
    positions = []
    for dp in (0, 1):
        for line in (tmp_path / "data" / f"consumed-dp{dp}.jsonl").read_text().splitlines():
            ps = json.loads(line)["positions"]
            assert all(p % 2 == dp for p in ps), "replica d consumes positions j*dp + d"
            positions += ps
    assert len(positions) == len(set(positions)) == sum(r["data/prompts_consumed"] for r in rows)
