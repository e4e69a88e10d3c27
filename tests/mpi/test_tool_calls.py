"""The tools group (`placement.tools`): real `yatt-hpc run`s of the lookup demo whose tool calls run on CPU ranks
of their own, never on the rollout rank.

    .venv/bin/python -m pytest tests/mpi/test_tool_calls.py -q                               # the CI case (~25 s)
    YATT_FULL_FAULT_MATRIX=1 .venv/bin/python -m pytest tests/mpi/test_tool_calls.py -q      # + equality, resume, ...

The tool (`tests.programs.agent_tools:look_where`, the demo's `look` that also logs the world rank running it)
is deterministic, so a run with a tools group trains bitwise the weights of the same run without one, and an
interrupted run with the group resumes bitwise.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    NO_EVAL,
    REPO,
    checkpoint_weights,
    full_matrix_only,
    kill_leftovers,
    leftover_pids,
    mpi_env,
    wait_for_file,
)
from yatt_hpc.metrics.writer import step_rows

CONFIG = str(REPO / "configs/demo_tools_cpu.yaml")
TOOL = "agent.tools=[{function: 'tests.programs.agent_tools:look_where', name: look}]"
SMALL = ("train.prompts_per_step=8", "rollout.samples_per_prompt=4", "logging.progress=false", TOOL, *NO_EVAL)
GROUP = "placement.tools.tasks_per_node=1"  # world rank 4, after trainer 0-1, rollout 2, genrm 3


def run(run_dir: Path, *sets: str, timeout: int = 600) -> tuple[list[dict], list[str]]:
    """The run's step metrics and the world ranks its tool calls ran on (one per call)."""
    log = run_dir.parent / f"{run_dir.name}-tool-ranks.txt"
    args = [a for kv in sets for a in ("--set", kv)]
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir), *args],
                          cwd=REPO, env={**mpi_env(), "YATT_TOOL_LOG": str(log)}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return step_rows(run_dir), log.read_text().split() if log.exists() else []


def same_weights(a: Path, b: Path, step: int) -> bool:
    wa, wb = checkpoint_weights(a, step), checkpoint_weights(b, step)
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


def test_the_tools_group_runs_every_call_and_the_rollout_rank_none(mpirun, tmp_path):
    rows, ranks = run(tmp_path / "run", "train.steps=2", "checkpoint.interval=2", GROUP, *SMALL)
    assert len(rows) == 2
    for m in rows:
        assert m["agent/tool_calls"] > 0 and m["agent/tools_group_calls"] == m["agent/tool_calls"]
        assert m["agent/tool_latency_mean_s"] >= 0.0 and m["time/tools"] >= 0.0
        assert "memory/peak_rss_mb/tools" in m and m["train/rollout_logp_diff_max"] < 1e-4
    assert ranks and set(ranks) == {"4"}, f"tool calls ran on world ranks {sorted(set(ranks))}, not the tools rank 4"
    assert "(loaded: no torch)" in (tmp_path / "run" / "logs" / "rank-0004-tools.log").read_text()


def test_as_ready_with_the_tools_group_takes_more_engine_calls_past_a_slow_call(mpirun, tmp_path):
    """One key in four takes the tool 0.5 s (`look_lagging`): under as_ready the tools rank answers each
    trajectory's calls as they finish and the rollout rank calls the engine for those back while others wait;
    the trainer's log-probs still equal the engine's."""
    lagging = ("agent.tools=[{function: 'tests.programs.agent_tools:look_lagging', name: look}]", "train.steps=2",
               "checkpoint.interval=0", GROUP, *SMALL[:3], *NO_EVAL)
    lock, _ = run(tmp_path / "lockstep", *lagging)
    ready, _ = run(tmp_path / "as_ready", *lagging, "agent.turn_schedule=as_ready")
    for a, r in zip(lock, ready):
        assert r["agent/tools_group_calls"] == r["agent/tool_calls"] > 0
        assert a["agent/engine_calls"] < r["agent/engine_calls"], (a["agent/engine_calls"], r["agent/engine_calls"])
        assert r["agent/tool_wait_mean_s"] > 0.0 and r["train/rollout_logp_diff_max"] < 1e-4


@full_matrix_only
def test_a_run_with_the_tools_group_trains_bitwise_the_run_without_it(mpirun, tmp_path):
    alone, ranks_alone = run(tmp_path / "alone", "train.steps=3", "checkpoint.interval=3", *SMALL)
    group, ranks_group = run(tmp_path / "group", "train.steps=3", "checkpoint.interval=3", GROUP, *SMALL)
    assert set(ranks_alone) == {"2"} and set(ranks_group) == {"4"}  # the rollout rank, then the tools rank
    assert len(ranks_alone) == len(ranks_group) > 0
    assert same_weights(tmp_path / "alone", tmp_path / "group", 3)
    keys = [k for k in alone[0] if k.startswith(("reward/", "agent/", "train/loss", "train/kl"))
            and k not in ("agent/tool_latency_mean_s", "agent/tools_group_calls", "agent/tool_wait_mean_s",
                          "agent/engine_idle_s")]  # wall-clock times
    for a, g in zip(alone, group):
        assert {k: a[k] for k in keys} == {k: g[k] for k in keys}


@full_matrix_only
def test_an_interrupted_run_with_the_tools_group_resumes_bitwise(mpirun, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, "train.steps=4", "checkpoint.interval=2", GROUP, *SMALL)
    run(resumed, "train.steps=2", "checkpoint.interval=2", GROUP, *SMALL)
    run(resumed, "train.steps=4", "checkpoint.interval=2", GROUP, *SMALL)  # the same command resumes from step 2
    assert same_weights(straight, resumed, 4)
    for dp in (0, 1):
        name = f"data/consumed-dp{dp}.jsonl"
        assert (straight / name).read_text() == (resumed / name).read_text()


@full_matrix_only
@pytest.mark.parametrize("sets, tool_ranks", [
    pytest.param(("placement.mode=disjoint", "placement.tools.tasks_per_node=2"), {"4", "5"}, id="disjoint-2-tool-ranks"),
    pytest.param(("placement.mode=partial", "rollout.over_dispatch_ratio=1.5", "rollout.stream_chunk=4", GROUP), {"4"},
                 id="partial-over-dispatch"),
    pytest.param(("placement.mode=partial", "rollout.over_dispatch_ratio=1.5", "rollout.stream_chunk=4", GROUP,
                  "agent.turn_schedule=as_ready"), {"4"}, id="partial-over-dispatch-as-ready"),
    pytest.param(("placement.rollout.tasks_per_node=2", "placement.tools.tasks_per_node=2",
                  "eval.sources=[models/demo_tools/heldout.jsonl]", "eval.every=1", "eval.max_prompts=8"), {"5", "6"},
                 id="2-rollout-2-tool-ranks-with-validation"),
])
def test_the_tools_group_serves_other_placements(mpirun, tmp_path, sets, tool_ranks):
    rows, ranks = run(tmp_path / "run", "train.steps=2", "checkpoint.interval=2", *SMALL, *sets)
    assert len(rows) == 2 and all(m["agent/tools_group_calls"] == m["agent/tool_calls"] > 0 for m in rows)
    assert set(ranks) == tool_ranks


@full_matrix_only
def test_a_stop_while_a_tool_rank_is_inside_a_call_gives_the_step_up_and_resumes_bitwise(mpirun, tmp_path):
    """SIGTERM while the tools rank runs a call that never returns (the rollout rank waiting on it, the trainers on
    the rollout): within checkpoint.stop_grace_s the step is given up, step 1 is committed, every process exits;
    the same command then ends bitwise where an uninterrupted run ends."""
    held = ("agent.tools=[{function: 'tests.programs.agent_tools:look_held', name: look}]", "agent.tool_timeout_s=300",
            "checkpoint.interval=0", "checkpoint.stop_grace_s=1", "train.steps=2", GROUP, *SMALL[:3], *NO_EVAL)
    straight_rows, _ = run(tmp_path / "straight", *held)
    calls_in_step_1 = int(straight_rows[0]["agent/tool_calls"])
    hold, run_dir = tmp_path / "hold", tmp_path / "run"
    hold.mkdir()
    before = set(leftover_pids())
    args = [a for kv in held for a in ("--set", kv)]
    proc = subprocess.Popen([sys.executable, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir), *args],
                            cwd=REPO, env={**mpi_env(), "YATT_TOOL_HOLD": f"{hold}:{calls_in_step_1}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for_file(hold / "holding", alive=lambda: proc.poll() is None)  # step 2's first call, on the tools rank
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        (hold / "release").write_text("")
        kill_leftovers(before)
    assert proc.returncode == 0, out[-3000:]
    record = json.loads((run_dir / "logs" / "stop_local_0.json").read_text())
    assert record["step"] == 1 and "gave up step 2" in record["abandoned"], record
    assert (run_dir / "checkpoints" / "step-1" / "COMMITTED").exists()
    run(run_dir, *held)  # the same command resumes from step 1
    assert same_weights(tmp_path / "straight", run_dir, 2)
