"""Config fields whose effect only a real run shows (STYLE.md 15), from two real `yatt-hpc run`s.

Both runs: `placement.mode=partial` with two rollout ranks (5 ranks on CPU: trainer DP=2, rollout 2,
GenRM 1), the tiny models, 3 steps of 8 prompts x 4 samples, a checkpoint every step, one prompt group
per streamed chunk. They differ in the fields under test, every value set with `--set`:

    field                           SET (non-defaults)  OTHER (defaults, keep_last and the bucket apart)
    checkpoint.keep_last            2                   5
    checkpoint.async                false               true
    logging.level                   WARNING             INFO
    logging.progress                true                false
    rollout.routing                 least_loaded        static
    rollout.stream_queue            1                   4
    rollout.weight_sync_bucket_mb   0.01                64 (more than the whole model)
    train.balance                   none                flops

Every assertion is an event or a count, never a duration. train.balance_flops_coeff and
slurm.step_exit_timeout_s are shown by unit tests (tests/unit/test_balance.py, test_step_watch.py).
"""
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, mpi_env
from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.metrics.writer import step_rows

STEPS, PROMPTS, N, DP, ROLLOUT_RANKS = 3, 8, 4, 2, 2
COMMON = {"placement.mode": "partial", "placement.rollout.tasks_per_node": ROLLOUT_RANKS, "train.steps": STEPS,
          "train.prompts_per_step": PROMPTS, "rollout.samples_per_prompt": N, "rollout.stream_chunk": N,
          "checkpoint.interval": 1}
SET = {"checkpoint.keep_last": 2, "checkpoint.async": "false", "logging.level": "WARNING",
       "logging.progress": "true", "rollout.routing": "least_loaded", "rollout.stream_queue": 1,
       "rollout.weight_sync_bucket_mb": 0.01, "train.balance": "none"}
OTHER = {"checkpoint.keep_last": 5, "checkpoint.async": "true", "checkpoint.staging_mb": 0, "logging.level": "INFO",
         "logging.progress": "false", "rollout.routing": "static", "rollout.stream_queue": 4,
         "rollout.weight_sync_bucket_mb": 64, "train.balance": "flops"}


def yatt_run(run_dir, models, fields: dict):
    sets = {**COMMON, "model.path": models["policy"], "reward.genrm_path": models["judge"], **fields}
    args = [x for key, value in sets.items() for x in ("--set", f"{key}={value}")]
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"),
                           "--run-dir", str(run_dir), *args], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=900)


class Run:
    def __init__(self, run_dir, proc):
        self.dir = run_dir
        self.stdout = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # the leader's console may style its lines
        self.metrics = step_rows(run_dir)

    def logs(self) -> dict[str, str]:
        return {p.name: p.read_text() for p in sorted((self.dir / "logs").glob("rank-*.log"))}

    def timeline(self, rank_file: str) -> list[dict]:
        return [json.loads(line) for line in (self.dir / "timeline" / rank_file).read_text().splitlines()]

    def committed_steps(self) -> list[int]:
        return [s.step for s in layout.list_steps(layout.checkpoints_dir(self.dir)) if s.committed]


@pytest.fixture(scope="module")
def runs(mpirun, tiny_models, tmp_path_factory):
    out = {}
    for name, fields in (("set", SET), ("other", OTHER)):
        run_dir = tmp_path_factory.mktemp(f"effects-{name}") / "run"
        proc = yatt_run(run_dir, tiny_models, fields)
        assert proc.returncode == 0, f"{name}: " + proc.stdout[-2000:] + proc.stderr[-4000:]
        out[name] = Run(run_dir, proc)
    for run in out.values():
        assert [r["step"] for r in run.metrics] == [1, 2, 3]
        for r in run.metrics:
            assert r["rollout/generated"] == r["reward/scored"] == PROMPTS * N
    return out


def test_keep_last_keeps_the_newest_committed_checkpoints(runs):
    assert runs["set"].committed_steps() == [2, 3], "checkpoint.keep_last=2 prunes step 1"
    assert runs["other"].committed_steps() == [1, 2, 3], "checkpoint.keep_last=5 keeps all three"


def test_async_false_commits_before_the_next_step_and_async_true_writes_in_the_background(runs):
    """(and checkpoint.staging_mb=0: no staging copy, the tensors written before the step goes on)"""
    # checkpoint.async=false: checkpoint step 2 is committed before the leader starts step 3 (its
    # marker's time precedes every phase of that step in the leader's timeline: an order, not a duration)
    marker = json.loads((layout.step_dir(layout.checkpoints_dir(runs["set"].dir), 2) / layout.COMMIT_MARKER).read_text())
    third = [ev["start"] for ev in runs["set"].timeline("rank-0000-trainer.jsonl") if ev["step"] == 2]
    assert third and marker["created"] < min(third)
    # checkpoint.async=true: every rank hands each save to the writer thread; with checkpoint.staging_mb=0 a
    # trainer rank keeps no copy: it writes its tensors before the step goes on, the writer commits
    for name, text in runs["other"].logs().items():
        for step in range(1, STEPS + 1):
            if "trainer" in name:
                assert re.search(rf"checkpoint step {step}: \d+ tensors past checkpoint.staging_mb written before the "
                                 "step went on; the writer thread writes the rest in the background", text), name
            else:
                assert f"checkpoint step {step} snapshot taken; the writer thread writes it in the background" in text, name
        assert "written and committed before the step ended" not in text, name
    for step in range(1, STEPS + 1):
        assert verify_step(layout.step_dir(layout.checkpoints_dir(runs["other"].dir), step)) is None


def test_logging_level_warning_hides_the_info_lines_of_every_rank(runs):
    quiet, info = runs["set"].logs(), runs["other"].logs()
    assert len(quiet) == len(info) == 5
    for name, text in quiet.items():
        assert "started: pid" in text, name  # INFO until the config is read: the log is there
        assert "step 1 begins" not in text and "checkpoint step" not in text, name
    for name, text in info.items():
        assert "step 1 begins" in text and f"step {STEPS} begins" in text and "checkpoint step 1" in text, name


def test_logging_progress_prints_the_leaders_step_line(runs):
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS}  reward " in runs["set"].stdout, runs["set"].stdout[-2000:]
    assert f"/{STEPS}  reward " not in runs["other"].stdout


def test_weight_sync_bucket_mb_sets_the_buckets_of_a_sync(runs):
    # the tiny policy is some tens of KiB: many buckets of 0.01 MiB, one of 64 MiB
    assert all(r["weight_sync/buckets"] > 1 for r in runs["set"].metrics), [r["weight_sync/buckets"] for r in runs["set"].metrics]
    assert all(r["weight_sync/buckets"] == 1 for r in runs["other"].metrics)


def test_stream_queue_bounds_the_sends_in_flight_to_genrm(runs):
    assert all(r["rollout/stream_inflight_max"] == 1 for r in runs["set"].metrics)
    # static routing: each rollout rank streams its replica's 4 groups one per chunk, and a sent chunk is
    # waited for only once the queue is full (or at the step's gate): all 4 are in flight together
    assert all(r["rollout/stream_inflight_max"] == 4 for r in runs["other"].metrics)


def test_routing_least_loaded_sends_every_replica_to_every_rollout_rank(runs):
    # least_loaded: each replica sends one (maybe empty) prompt message to every rollout rank per wave;
    # static: replica d sends only to rollout rank d mod R, and the routed load is never measured
    assert all(r["rollout/prompt_messages"] == DP * ROLLOUT_RANKS for r in runs["set"].metrics)
    assert all(r["rollout/prompt_messages"] == DP for r in runs["other"].metrics)
    assert all(r["rollout/route_max_over_mean"] >= 1.0 for r in runs["set"].metrics)
    assert all(r["rollout/route_max_over_mean"] == 1.0 for r in runs["other"].metrics)


def test_balance_none_moves_nothing_and_flops_balances_every_step(runs):
    def balance_phases(run):
        return [ev["step"] for rank in ("rank-0000-trainer.jsonl", "rank-0001-trainer.jsonl")
                for ev in run.timeline(rank) if ev["phase"] == "balance"]

    assert balance_phases(runs["set"]) == [], "train.balance=none: no balancing phase"
    for r in runs["set"].metrics:
        assert r["balance/moved_groups"] == 0
        assert r["balance/max_over_mean_before"] == r["balance/max_over_mean_after"]
    # train.balance=flops: both replicas' owners balance every step, and never make it worse
    assert sorted(balance_phases(runs["other"])) == sorted(list(range(STEPS)) * DP)
    for r in runs["other"].metrics:
        assert r["balance/max_over_mean_after"] <= r["balance/max_over_mean_before"]
