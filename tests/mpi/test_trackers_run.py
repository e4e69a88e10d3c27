"""Experiment trackers under real mpirun, read back through the trackers' own readers.

A run stopped in a step (its step 3 held until the stop: tests/programs/held_engine.py) and resumed logs
every step once to MLflow (its own client) and to W&B (the offline runs' files, read as the W&B
transaction log they are, with W&B's own record type: tests/trackers.py), in the same run of each; TensorBoard holds the
sample tables (its own EventAccumulator). A run killed outright (SIGKILL of every process) after a
step past its checkpoint redoes that step on resume, and the tracker still has it once. A tracker whose
disk fills mid-run is reported once and dropped; the run and its checkpoints go on. Only the leader
ever loads a tracker's library.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, full_matrix_only, kill_leftovers, kill_tree, leftover_pids, mpi_env, wait_for_file
from tests.programs.held_engine import held_env, holding_marker, release
from tests.trackers import wandb_history

K = 4
BASE = ["--set", f"train.steps={K}", "--set", "train.prompts_per_step=8", "--set", "rollout.samples_per_prompt=4",
        "--set", "logging.progress=false", "--set", "logging.samples_every=1"]
EVAL = ["--set", "eval.every=3", "--set", "eval.max_prompts=8"]  # validation after steps 0, 3 and 4 (the last)


def cmd(run_dir, *extra):
    return [sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"), "--run-dir",
            str(run_dir), *BASE, *extra]


def start(run_dir, extra, held: Path, until: str, at_version: int):
    env = mpi_env() | held_env(held, until=until, at_version=at_version)
    return subprocess.Popen(cmd(run_dir, *extra), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(run_dir, extra):
    proc = subprocess.run(cmd(run_dir, *extra), cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture
def alive_before():
    before = set(leftover_pids())
    yield before
    kill_leftovers(before)


def mlflow_run(run_dir):
    from mlflow.tracking import MlflowClient

    entry = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=entry["tracking_uri"])
    return client, client.get_run(entry["run_id"])


def wait_logged_through(run_dir, tracker: str, step: int, alive, timeout_s: float = 120) -> None:
    """Until RUN_DIR/trackers.json says `tracker` took step `step` (its thread logs after the step loop moved on)."""
    path, deadline = run_dir / "trackers.json", time.monotonic() + timeout_s
    while True:
        try:
            if json.loads(path.read_text()).get(tracker, {}).get("logged_through", -1) >= step:
                return
        except (OSError, json.JSONDecodeError):
            pass
        assert alive(), f"the run ended before {tracker} took step {step}"
        assert time.monotonic() < deadline, f"{tracker} did not take step {step} within {timeout_s:g}s"
        time.sleep(0.02)


def steps_of(history) -> list[int]:
    return sorted(m.step for m in history)


def wandb_runs(run_dir) -> tuple[str, list[list[dict]]]:
    """(run id, per offline run of it in time order: its history rows {key: value}) from RUN_DIR/wandb."""
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]
    runs = []
    for path in sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        runs.append(wandb_history(path))
    return run_id, runs


# ------------------------------------------------------------------ the tests

def test_a_stopped_and_resumed_run_logs_every_step_once_in_one_mlflow_and_one_wandb_run(mpirun, tmp_path,
                                                                                      alive_before):
    run_dir = tmp_path / "run"
    extra = [*EVAL, "--set", "logging.trackers=[tensorboard,wandb,mlflow]", "--set", "logging.samples_per_replica=3",
             "--set", "checkpoint.interval=0",
             "--set", "checkpoint.stop_grace_s=1"]
    proc = start(run_dir, extra, tmp_path / "held", until="stopped", at_version=2)  # step 3 holds until stopped
    wait_for_file(holding_marker(tmp_path / "held"), alive=lambda: proc.poll() is None)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "gave up step 3" in out, out[-3000:]
    client, first = mlflow_run(run_dir)
    assert first.info.status == "KILLED", "a stopped attempt leaves its run KILLED until the resume"
    assert steps_of(client.get_metric_history(first.info.run_id, "reward/mean")) == [1, 2]

    out = finish(run_dir, extra)
    assert "resumed from checkpoint step 2" in out
    client, run = mlflow_run(run_dir)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1, "the resume continued the run, made no other"
    assert steps_of(client.get_metric_history(run.info.run_id, "reward/mean")) == list(range(1, K + 1))
    assert steps_of(client.get_metric_history(run.info.run_id, "val/demo_heldout/pass_4")) == [0, 3, 4]
    assert run.data.params["train.steps"] == str(K) and run.data.params["code_version"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "report.png", "samples"} <= artifacts
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "samples/train")}
    assert tables == {f"samples/train/step-{s:06d}.json" for s in range(1, K + 1)}
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "samples/train/step-000004.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert len(table["data"]) == 3 * 2, "logging.samples_per_replica=3 rows from each of the 2 trainer replicas"
    assert sorted(row[table["columns"].index("replica")] for row in table["data"]) == [0, 0, 0, 1, 1, 1]
    assert {"prompt", "response", "reward", "term/rule", "term/genrm", "verdict"} <= set(table["columns"])

    run_id, attempts = wandb_runs(run_dir)
    assert len(attempts) == 2, "one offline run per attempt, both with the run's id"
    logged = [row["_step"] for rows in attempts for row in rows if "reward/mean" in row]
    assert sorted(logged) == list(range(1, K + 1)), f"W&B history steps {logged}"
    tables = [row["_step"] for rows in attempts for row in rows if row.get("samples/train/_type") == "table-file"]
    assert sorted(tables) == list(range(1, K + 1)), f"W&B sample tables at steps {tables}"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("samples/train/text_summary")
    assert sorted(e.step for e in texts) == list(range(1, K + 1))
    markdown = texts[-1].tensor_proto.string_val[0].decode()
    assert markdown.startswith("| step | table | replica | sample | prompt | response |") and "reverse" in markdown
    assert sorted(e.step for e in acc.Tensors("samples/val/demo_heldout/text_summary")) == [0, 3, 4]
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted((r["step"], r["table"]) for r in rows) == sorted(
        [(s, "train") for s in range(1, K + 1)] + [(s, "val/demo_heldout") for s in (0, 3, 4)])

    for log in sorted((run_dir / "logs").glob("rank-*.log")):
        ends = [line for line in log.read_text().splitlines() if "done: " in line]
        loaded = {m for line in ends for m in ("wandb", "mlflow") if m in line.split("loaded:")[-1]}
        assert loaded == ({"wandb", "mlflow"} if log.name.startswith("rank-0000") else set()), (log.name, ends)


@full_matrix_only  # a fault on top of the resume above: `make test-faults`
def test_a_step_logged_past_the_checkpoint_of_a_killed_run_reaches_mlflow_once(mpirun, tmp_path, alive_before):
    run_dir = tmp_path / "run"
    extra = ["--set", "logging.trackers=[mlflow]", "--set", "checkpoint.interval=2"]
    proc = start(run_dir, extra, tmp_path / "held", until="stopped", at_version=3)  # step 4 holds
    wait_for_file(holding_marker(tmp_path / "held"), alive=lambda: proc.poll() is None)
    wait_logged_through(run_dir, "mlflow", 3, alive=lambda: proc.poll() is None)
    client, run = mlflow_run(run_dir)
    assert steps_of(client.get_metric_history(run.info.run_id, "reward/mean")) == [1, 2, 3]
    kill_tree(proc.pid)  # every rank, mpirun and the launcher: nobody saves, step 3 is past checkpoint 2
    proc.communicate(timeout=60)
    assert not (run_dir / "checkpoints" / "step-3").exists()

    out = finish(run_dir, extra)
    assert "resumed from checkpoint step 2" in out
    client, again = mlflow_run(run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert steps_of(client.get_metric_history(run.info.run_id, "reward/mean")) == list(range(1, K + 1))
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == \
        list(range(K + 1)), "metrics.jsonl redoes step 3 in place (step 0: the validation before training)"


@full_matrix_only  # a fault: `make test-faults`
def test_a_tracker_whose_disk_fills_mid_run_is_reported_once_and_training_and_checkpoints_go_on(
        mpirun, tmp_path, small_disk, alive_before):
    run_dir = tmp_path / "run"
    store = small_disk.mount(run_dir / "mlflow", "16m")
    extra = ["--set", "logging.trackers=[tensorboard,mlflow]", "--set", "checkpoint.interval=2"]
    proc = start(run_dir, extra, tmp_path / "held", until="released", at_version=2)  # step 3 waits for us
    wait_for_file(holding_marker(tmp_path / "held"), alive=lambda: proc.poll() is None)
    wait_logged_through(run_dir, "mlflow", 2, alive=lambda: proc.poll() is None)
    with open(store / "filler", "wb") as f:  # the store's disk is full from step 3 on
        try:
            while True:
                f.write(b"\0" * 2**20)
                f.flush()
        except OSError:
            pass
    release(tmp_path / "held")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert out.count("the mlflow tracker failed") == 1, out[-3000:]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(K + 1))
    committed = sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/COMMITTED"))
    assert committed == [2, 4], "the checkpoint schedule is untouched"
    (store / "filler").unlink()
    client, run = mlflow_run(run_dir)
    assert steps_of(client.get_metric_history(run.info.run_id, "reward/mean")) == [1, 2], "dropped at step 3"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(1, K + 1)), "the other tracker went on"
