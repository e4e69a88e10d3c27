"""Real `yatt-hpc run` in every placement mode: phases from the per-rank timelines, exact counts.

colocate: no two heavy phases (rollout / reward / train) overlap anywhere, since the groups share
devices. partial and disjoint: GenRM starts scoring before the last sample is generated
(streaming). Every mode: every generated sample is scored exactly once and trained on once.
"""
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, mpi_env
from yatt_hpc.metrics.writer import step_rows

HEAVY = {"rollout": "rollout", "genrm": "reward", "trainer": "train"}
PROMPTS, N = 8, 4


def run_mode(run_dir, models, mode, extra=()):
    args = [*extra, "--set", f"placement.mode={mode}", "--set", f"model.path={models['policy']}",
            "--set", f"reward.genrm_path={models['judge']}", "--set", "train.steps=2",
            "--set", f"train.prompts_per_step={PROMPTS}", "--set", f"rollout.samples_per_prompt={N}",
            "--set", "rollout.stream_chunk=4", "--set", "logging.progress=false"]
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"),
                           "--run-dir", str(run_dir), *args], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)


def heavy_phases(run_dir):
    out = []
    for path in sorted((run_dir / "timeline").glob("rank-*.jsonl")):
        group = path.stem.split("-")[-1]
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev["phase"] == HEAVY[group]:
                out.append((group, ev["step"], ev["start"], ev["end"]))
    return out


TP2 = ("--set", "placement.trainer.tasks_per_node=4", "--set", "placement.trainer.tp=2",
       "--set", "placement.trainer.dp=null", "--set", "train.kl_coef=0.01")


def assert_mode(run_dir, mode: str, steps: int) -> None:
    rows = step_rows(run_dir)
    assert len(rows) == steps
    for r in rows:
        assert r["rollout/generated"] == r["reward/scored"] == PROMPTS * N
        assert r["data/prompts_consumed"] == PROMPTS
        # the rollout engine samples with exactly the weights the trainer holds (weight sync, TP gather)
        assert r["train/rollout_logp_diff_max"] < 1e-4
    phases = heavy_phases(run_dir)
    for step in range(steps):
        mine = [p for p in phases if p[1] == step]
        if mode == "colocate":
            for a in mine:
                for b in mine:
                    if a[0] != b[0]:
                        assert a[3] <= b[2] or b[3] <= a[2], f"{a} overlaps {b} on shared devices"
        else:
            first_score = min(p[2] for p in mine if p[0] == "genrm")
            last_generated = max(p[3] for p in mine if p[0] == "rollout")
            assert first_score < last_generated, "GenRM must score while rollout still generates"


def test_colocate_runs_no_two_heavy_phases_at_once_and_scores_every_sample_once(reference_run):
    """Colocate is the session's reference run (tests/conftest.py): the demo models, 8 prompts x 4, 20 steps."""
    assert_mode(reference_run.dir, "colocate", reference_run.STEPS)


@pytest.mark.parametrize("mode, extra", [
    pytest.param("disjoint", TP2, id="disjoint-trainer-tp2-dp2"),
])
def test_mode_runs_and_scores_every_sample_once(mpirun, tiny_models, tmp_path, mode, extra):
    proc = run_mode(tmp_path, tiny_models, mode, extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_mode(tmp_path, mode, 2)


DEMO_MODELS = {"policy": "models/demo/policy", "judge": "models/demo/judge"}  # they learn: rewards vary, weights move


@pytest.fixture(scope="module")
def partial_run(mpirun, tmp_path_factory):
    """The partial-mode run of the demo models with rollout.weight_transport=collective: weights go by
    broadcast over each trainer owner's Gloo group with its engine (MPI transport in partial mode is the
    over-dispatch and config-effects runs'; bitwise delivery over the group is tests/mpi/test_weight_collective.py's)."""
    run_dir = tmp_path_factory.mktemp("partial-collective")
    proc = run_mode(run_dir, DEMO_MODELS, "partial", ("--set", "rollout.weight_transport=collective"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_partial_runs_and_scores_every_sample_once(partial_run):
    assert_mode(partial_run, "partial", 2)


def test_collective_weight_transport_serves_the_trainers_weights_and_moves_no_tensor_over_mpi(partial_run):
    rows = step_rows(partial_run)
    # the weights move between syncs (the demo models learn), and the engine samples with exactly the
    # trainer's (assert_mode: logprob gap < 1e-4 every step; a receiver that drops the tensors gives 0.7)
    assert all(r["train/grad_norm"] > 0 for r in rows) and any(r["reward/mean"] > 0 for r in rows), rows
    for r in rows:
        # the tensors went by broadcast: MPI carried the manifests (and the first time the rendezvous)
        assert r["weight_sync/bytes"] > 0 and r["weight_sync/mpi_bytes"] < r["weight_sync/bytes"] / 20, r


@pytest.fixture(scope="module")
def long_tail_models(tiny_models, tmp_path_factory):
    """A policy whose responses end with P(eos) ~ 3% per token (lengths from 1 to the cap) and the tiny judge.
    The wave's decode must last well beyond the first groups' (~60 ms of a 32-row wave here with the
    native engine, the first group done in a few ms): at 8% and a 64-token cap it took 19-22 ms and the
    sender thread could be scheduled after the last sample."""
    from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model, set_eos_rate

    model = char_gpt2(n_embd=64, n_positions=256, seed=0)
    set_eos_rate(model, 0.03)
    return {"policy": save_char_model(model, tmp_path_factory.mktemp("long_tail") / "policy"),
            "judge": tiny_models["judge"]}


@pytest.mark.parametrize("streaming", ["finished_groups", "finished_samples"])
def test_finished_groups_are_scored_while_the_long_tail_still_decodes(mpirun, long_tail_models, tmp_path, streaming):
    # finished_samples: groups reach GenRM in pieces and the trainers still get them whole
    # (ReplicaWave's per-sample count: tests/unit/test_overdispatch.py)
    extra = ("--set", f"rollout.streaming={streaming}", "--set", "rollout.max_new_tokens=192")
    proc = run_mode(tmp_path, long_tail_models, "partial", extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/generated"] == r["reward/scored"] == PROMPTS * N
        assert r["train/rollout_logp_diff_max"] < 1e-4
    phases = heavy_phases(tmp_path)
    for step in (0, 1):
        rollout = [p for p in phases if p[1] == step and p[0] == "rollout"]
        scoring = [p for p in phases if p[1] == step and p[0] == "genrm"]
        assert len(rollout) == 1, "the whole wave is one engine call"
        # groups reach GenRM one by one as they finish, the first long before the last sample
        assert len(scoring) > 1 and scoring[0][2] < rollout[0][3], (rollout, scoring)


def test_kept_host_memory_trains_bitwise_like_memory_in_turns_and_gives_nothing_back(mpirun, reference_run, tmp_path):
    """`placement.host_memory=kept` changes where memory lives, never what is computed: 3 steps of the demo end
    with the reference run's weights and prompts bitwise. The reference (in turns) hands memory over every step:
    the engine's dropped weights go back to the kernel before each sync; with `kept` no rank gives any back."""
    from tests.conftest import final_state
    from tests.mpi.test_exact_resume import assert_same

    steps = 3
    sets = [a for kv in (f"train.steps={steps}", *reference_run.SETS, "placement.host_memory=kept")
            for a in ("--set", kv)]
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"),
                           "--run-dir", str(tmp_path), *sets], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert_same(final_state(tmp_path, steps), reference_run.state(steps), prompts=steps * PROMPTS)
    in_turns, kept = step_rows(reference_run.dir)[:steps], step_rows(tmp_path)
    assert all(r["memory/given_back_mb/rollout"] > 0 for r in in_turns), in_turns
    groups = ("trainer", "rollout", "genrm")
    assert all(r[f"memory/given_back_mb/{g}"] == 0 for r in kept for g in groups), kept
