"""Real Slurm: `yatt-hpc submit` (submitit + het components), status/logs/cancel, failure handling.

The launch plumbing is checked with tests/programs/group_probe.py standing in for the worker (same
arguments, joins the plan's MPI world); the GRPO end-to-end runs use the real worker and need the
demo models (tools/make_demo_models.py). The dev cluster's virtual nodes share one host, so every
job sets slurm.env.OMPI_MCA_btl=self,tcp.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import NO_EVAL, PYTHON, REPO, full_matrix_only
from yatt_hpc.config import load_config
from yatt_hpc.launch.jobs import top_states, wait_job
from yatt_hpc.launch.submitit_exec import dry_run_text, submit_run
from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.placement import plan

DEV_ENV = "slurm.env.OMPI_MCA_btl=self,tcp"
PROBE = (PYTHON, str(REPO / "tests/programs/group_probe.py"))
DEMO = str(REPO / "configs/demo_cpu.yaml")
TWO_NODES = ("placement.trainer.nodes=2", "placement.rollout.nodes=2", "placement.genrm.nodes=2",
             "placement.trainer.dp=null")


def _submit_probe(run_dir: Path, *overrides: str, config: str = DEMO):
    cfg = load_config(config, (DEV_ENV, "slurm.time=00:20:00", *overrides))
    return submit_run(cfg, plan(cfg), run_dir, program=PROBE)


def _reports(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"),
                                                        key=lambda p: int(p.stem.split("-")[1]))]


def _log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "yatt_hpc.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_disjoint_submit_is_a_three_component_het_job_forming_one_world(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = _submit_probe(run_dir, "placement.mode=disjoint")
    states = wait_job(sub.job_id, poll_s=1, timeout_s=120, components=3)
    assert states == {f"{sub.job_id}+{i}": "COMPLETED" for i in range(3)}, (states, _log(run_dir))
    reps = _reports(run_dir)
    assert [r["group"] for r in reps] == ["trainer", "trainer", "rollout", "genrm"], _log(run_dir)
    nodes = {g: {r["node"] for r in reps if r["group"] == g} for g in ("trainer", "rollout", "genrm")}
    assert len(set.union(*nodes.values())) == 3, f"each group on its own node: {nodes}"
    assert sub.job.result().return_code == 0  # submitit's own result pickle: the launcher's RunSummary
    cfg = load_config(run_dir / "config.yaml")
    assert sub.script.read_text() == dry_run_text(cfg, plan(cfg), run_dir), "--dry-run must print what was sent"


def test_colocate_submit_spreads_every_group_over_the_shared_nodes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = _submit_probe(run_dir, *TWO_NODES)
    states = wait_job(sub.job_id, poll_s=1, timeout_s=120)
    assert states == {sub.job_id: "COMPLETED"}, (states, _log(run_dir))
    reps = _reports(run_dir)
    assert [r["group"] for r in reps] == ["trainer"] * 4 + ["rollout"] * 2 + ["genrm"] * 2
    assert {r["slurm_step"] for r in reps} == {"0"}, "one step, one MPI world"
    for group in ("trainer", "rollout", "genrm"):
        assert {r["node"] for r in reps if r["group"] == group} == {r["node"] for r in reps}, reps


def test_a_crashing_rank_takes_the_job_down_fast_and_is_named(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = _submit_probe(run_dir, "placement.mode=disjoint", "slurm.env.YATT_PROBE_CRASH_RANK=2",
                        "slurm.env.YATT_PROBE_SLEEP=2")
    states = wait_job(sub.job_id, poll_s=1, timeout_s=120, components=3)
    assert set(states.values()) == {"FAILED"}, states
    summary = json.loads(next((run_dir / "logs").glob(f"summary_{sub.job_id}_*.json")).read_text())
    assert summary["seconds"] < 30, summary
    assert summary["failure"].startswith("rollout (world rank 2)"), summary
    assert "first failure: rollout (world rank 2)" in _log(run_dir)


def test_status_logs_and_cancel_on_a_live_job(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    sub = _submit_probe(run_dir, "placement.mode=disjoint", "slurm.env.YATT_PROBE_SLEEP=300")
    try:
        deadline = time.monotonic() + 60
        while "starting 4 ranks" not in _log(run_dir) or set(top_states(sub.job_id).values()) != {"RUNNING"}:
            assert time.monotonic() < deadline, (top_states(sub.job_id), _log(run_dir))
            time.sleep(1)
        status = _cli("status", sub.job_id)
        assert status.returncode == 0, status.stderr
        for word in ("trainer", "rollout", "genrm", "RUNNING", f"{sub.job_id}+2"):
            assert word in status.stdout, status.stdout
        logs = _cli("logs", sub.job_id)
        assert logs.returncode == 0 and "starting 4 ranks (disjoint)" in logs.stdout, logs.stdout + logs.stderr
        assert _cli("logs", sub.job_id, "--group", "genrm").returncode == 0
        cancel = _cli("cancel", sub.job_id)
        assert cancel.returncode == 0 and f"cancelled job {sub.job_id}" in cancel.stdout, cancel.stderr
        states = wait_job(sub.job_id, poll_s=1, timeout_s=120, components=3)
        assert set(states.values()) == {"CANCELLED"}, states
    finally:
        subprocess.run(["scancel", sub.job_id])


def test_hand_written_disjoint_script_runs_the_same_launcher(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, CONFIG=str(REPO / "configs/disjoint_cpu.yaml"), RUN_DIR=str(run_dir), PYTHON=PYTHON)
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", f"--chdir={tmp_path}",
                          str(REPO / "sbatch/grpo_disjoint.sbatch"), "--set", DEV_ENV, "--program", *PROBE],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    states = wait_job(job, poll_s=1, timeout_s=120)
    assert set(states.values()) == {"COMPLETED"}, (states, _log(run_dir))
    assert [r["group"] for r in _reports(run_dir)] == ["trainer"] * 4 + ["rollout", "genrm"]


# --- the GRPO demo end to end, through the CLI ------------------------------------------------------------

needs_models = pytest.mark.skipif(not (REPO / "models/demo/policy").is_dir(),
                                  reason="demo models missing: run .venv/bin/python tools/make_demo_models.py")
FAST = ["--set", "train.steps=2", "--set", "train.prompts_per_step=8", "--set", "rollout.samples_per_prompt=4",
        "--set", "logging.progress=false", "--set", DEV_ENV, "--set", "slurm.time=00:20:00"]


# partial with a dynamic split of 3 engine ranks and over-dispatch: one srun step of 4 ranks (a
# virtual node has 4 CPUs), the STOP/END handshake and the per-step routes over TCP between ranks
POOL = ("placement.dynamic_split.enabled=true", "placement.trainer.tasks_per_node=1", "placement.trainer.dp=null",
        "placement.rollout.tasks_per_node=2", "rollout.over_dispatch_ratio=1.5", *NO_EVAL)


@needs_models
@pytest.mark.parametrize("mode, components, extra", [pytest.param("disjoint", 3, (), id="disjoint"),
                                                     pytest.param("colocate", 1, (), id="colocate"),
                                                     pytest.param("partial", 1, POOL, id="partial-split-overdispatch",
                                                                  marks=full_matrix_only)])
def test_submit_wait_runs_two_grpo_steps(slurm_cluster, tmp_path, mode, components, extra):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    proc = _cli("submit", DEMO, "--run-dir", str(run_dir), "--set", f"placement.mode={mode}", *FAST,
                *[a for e in extra for a in ("--set", e)], "--wait", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr + _log(run_dir)
    job = proc.stdout.split("submitted job ", 1)[1].split(":")[0]
    assert f"yatt-hpc status {job}" in proc.stdout and f"job_{job}_0.log" in proc.stdout
    states = top_states(job)
    assert len(states) == components and set(states.values()) == {"COMPLETED"}, states
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
    if extra:
        rows = step_rows(run_dir)
        # one trainer replica: it keeps 8 groups of the ceil(8 x 1.5) = 12 it dispatches (4 samples each)
        assert all(r["data/prompts_consumed"] == 8 and r["reward/scored"] == 32 for r in rows), rows
        assert all(r["rollout/aborted"] + r["rollout/generated"] == 48 for r in rows), rows
        assert [r["rollout/reused_prompts"] for r in rows] == [0, 4], rows


@pytest.mark.skipif(not (REPO / "models/demo_tools/policy").is_dir(),
                    reason="demo tools model missing: run .venv/bin/python tools/make_demo_tools_model.py")
@full_matrix_only
def test_the_tools_group_runs_as_a_heterogeneous_component_of_its_own(slurm_cluster, tmp_path):
    """configs/tools_disjoint_cpu.yaml: trainer, rollout, GenRM and the tools group each a het component on its own
    node; every tool call runs on the tools component's rank, which loads no torch."""
    run_dir = tmp_path / "run"
    proc = _cli("submit", str(REPO / "configs/tools_disjoint_cpu.yaml"), "--run-dir", str(run_dir), *FAST, "--wait",
                timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr + _log(run_dir)
    job = proc.stdout.split("submitted job ", 1)[1].split(":")[0]
    states = top_states(job)
    assert len(states) == 4 and set(states.values()) == {"COMPLETED"}, states
    rows = step_rows(run_dir)
    assert len(rows) == 2 and all(r["agent/tools_group_calls"] == r["agent/tool_calls"] > 0 for r in rows), rows
    tools_log = (run_dir / "logs" / "rank-0004-tools.log").read_text()
    assert "tools rank serves rollout ranks 2-2" in tools_log and "(loaded: no torch)" in tools_log
    assert "starting 5 ranks (disjoint)" in _log(run_dir)


def test_cli_outside_a_cluster_says_so_in_one_line(tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}  # no sbatch/squeue/... anywhere on PATH
    for verb in (["status"], ["logs", "1"], ["cancel", "1"], ["submit", DEMO, "--run-dir", str(tmp_path / "r")]):
        proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", *verb], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (verb, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "no Slurm cluster here" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists(), "nothing is written when there is no cluster"
