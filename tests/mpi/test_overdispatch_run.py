"""Real `yatt-hpc run` with rollout.over_dispatch_ratio=1.5: stragglers aborted, prompts reused, none lost.

Per step each of the 2 replicas needs 4 groups and dispatches ceil(4 x 1.5) = 6, so every step
sends 12 groups (48 samples) and keeps 8. Whatever the timing, the counts must close: every
dispatched sample is generated or aborted, every generated one is scored or unused, exactly the
kept samples are scored, and every prompt position handed out is consumed once (consumed logs)
or waits at the front of its replica's queue (checkpoint data position).
"""
import json
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, mpi_env
from yatt_hpc.ckpt.loader import read_rank
from yatt_hpc.metrics.writer import step_rows

PROMPTS, N, STEPS, DP = 8, 4, 3, 2
DS = ("rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_refill_waves=1", "reward.mode=rule_only")
DISJOINT = ("placement.trainer.tasks_per_node=2", "placement.rollout.tasks_per_node=2", "rollout.routing=least_loaded")


def run(run_dir, models, mode, extra):
    sets = {"placement.mode": mode, "model.path": models["policy"], "reward.genrm_path": models["judge"],
            "train.steps": STEPS, "train.prompts_per_step": PROMPTS, "rollout.samples_per_prompt": N,
            "rollout.stream_chunk": N, "rollout.over_dispatch_ratio": 1.5, "logging.progress": "false"}
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")] + [a for e in extra for a in ("--set", e)]
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"),
                           "--run-dir", str(run_dir), *args], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)


def assert_every_position_consumed_once_or_queued(run_dir, steps: int = STEPS):
    consumed, queued = [], []
    for dp in range(DP):
        for line in (run_dir / "data" / f"consumed-dp{dp}.jsonl").read_text().splitlines():
            consumed += json.loads(line)["positions"]
        position = read_rank(run_dir / "checkpoints" / f"step-{steps}", f"trainer/dp{dp}/tp0/pp0").data_position
        queued += [int(p) for p in position["returned"]]
        handed_out = {j * DP + dp for j in range(position["next_index"])}
        mine = [p for p in consumed + queued if p % DP == dp]
        assert sorted(mine) == sorted(handed_out), f"replica {dp}: a prompt was lost or duplicated"
    assert len(consumed) == len(set(consumed)), "a prompt was consumed twice"
    assert not set(consumed) & set(queued), "a queued prompt was also consumed"
    return consumed, queued


@pytest.mark.parametrize("mode, extra", [
    pytest.param("partial", (), id="partial"),
    pytest.param("partial", ("rollout.streaming=finished_groups",), id="partial-finished-groups"),
    pytest.param("colocate", DS, id="colocate-dynamic-sampling"),
    pytest.param("disjoint", DISJOINT, id="disjoint-2-rollouts-least-loaded"),
])
def test_over_dispatch_loses_and_repeats_no_prompt(mpirun, tiny_models, tmp_path, mode, extra):
    proc = run(tmp_path, tiny_models, mode, extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(tmp_path)
    assert len(rows) == STEPS
    waves = extra == DS  # dynamic sampling: 1 + 1 refill wave per step (nothing is valid), sizes from the EMA
    for i, r in enumerate(rows):
        assert r["reward/scored"] == r["data/prompts_consumed"] * N, "GenRM scores exactly the kept samples, once"
        assert r["rollout/generated"] == r["reward/scored"] + r["rollout/unused_samples"]
        assert r["rollout/returned_prompts"] > 0
        if waves:
            assert r["sampling/waves"] == 2 and r["rollout/reused_prompts"] > 0  # the refill takes wave 1's returns
        else:
            assert r["data/prompts_consumed"] == PROMPTS
            assert r["rollout/generated"] + r["rollout/aborted"] == 12 * N
            assert r["rollout/returned_prompts"] == 4
            assert r["rollout/reused_prompts"] == (0 if i == 0 else 4)
    consumed, queued = assert_every_position_consumed_once_or_queued(tmp_path)
    if mode == "partial" and not extra:
        # one rollout rank generates in sample-id order, so each replica's lowest groups are scored
        # first: over-dispatch keeps exactly what ratio 1.0 would, step by step
        for dp in range(DP):
            lines = (tmp_path / "data" / f"consumed-dp{dp}.jsonl").read_text().splitlines()
            per_step = [json.loads(line)["positions"] for line in lines]
            assert per_step == [[(4 * i + j) * DP + dp for j in range(4)] for i in range(STEPS)]
    assert len(consumed) == sum(r["data/prompts_consumed"] for r in rows)
    assert waves or len(queued) == 4
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    for tag in ("rollout/aborted", "rollout/reused_prompts", "rollout/returned_prompts", "rollout/route_max_over_mean"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3], tag
    assert sum(e.value for e in acc.Scalars("rollout/reused_prompts")) > 0
