"""Real `yatt-hpc run` in partial placement with a dynamic split of the engine pool (5 ranks).

A pool of 3 engine ranks (2 rollout + 1 GenRM configured) beside 2 trainer replicas. While scoring
is much heavier than generation the split moves a rank to GenRM; the run is resumed from its
checkpoint with generation made the heavy role, goes on with the saved split, and moves the rank
back to rollout. Every sample is generated and scored exactly once per step, and every rank that
generates (switched or not) samples with the trainer's current weights.
"""
import json
import subprocess
import sys

import pytest

from tests.conftest import NO_EVAL, REPO, mpi_env
from yatt_hpc.ckpt.state import read_shared
from yatt_hpc.metrics.writer import step_rows

PROMPTS, N, FIRST, STEPS = 8, 4, 4, 7
# the demo policy solves some prompts: rewards vary, so the weights change every step and a rank
# that generated with stale weights would show in train/rollout_logp_diff_max
POLICY = str(REPO / "models/demo/policy")


@pytest.fixture(scope="module")
def heavy_judge(tmp_path_factory):
    """A judge that always writes its full verdict: the eos embedding is zero, so (tied) its logit is 0
    and greedy decoding never picks it over the random positive ones. 24 layers: a verdict costs several
    times a response, so the measured load says so even on a busy machine (each step's fixed costs are about
    the same for both roles)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from yatt_hpc.demo.char_tokenizer import CharTokenizer

    path = tmp_path_factory.mktemp("heavy_judge") / "judge"
    tok = CharTokenizer()
    torch.manual_seed(7)
    config = GPT2Config(vocab_size=tok.vocab_size, n_embd=64, n_layer=24, n_head=2, n_positions=128,
                        activation_function="gelu_new", tie_word_embeddings=True, eos_token_id=tok.eos_id,
                        bos_token_id=tok.bos_id, pad_token_id=tok.pad_id)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wte.weight[tok.eos_id] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    tok.save(path)
    return str(path)


def run_split(run_dir, policy, judge, steps, extra):
    args = ["--set", "placement.mode=partial", "--set", "placement.dynamic_split.enabled=true",
            "--set", "placement.rollout.tasks_per_node=2", "--set", "placement.genrm.tasks_per_node=1",
            "--set", f"model.path={policy}", "--set", f"reward.genrm_path={judge}", "--set", f"train.steps={steps}",
            "--set", f"train.prompts_per_step={PROMPTS}", "--set", f"rollout.samples_per_prompt={N}",
            "--set", "rollout.stream_chunk=4", "--set", "logging.progress=false",
            *(a for o in NO_EVAL for a in ("--set", o)), *extra]
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"),
                           "--run-dir", str(run_dir), *args], cwd=REPO, env=mpi_env(), capture_output=True,
                          text=True, timeout=300)


def check_every_sample_once(run_dir):
    rows = step_rows(run_dir)
    assert len(rows) == STEPS
    for r in rows:
        assert r["rollout/generated"] == r["reward/scored"] == PROMPTS * N
        assert r["data/prompts_consumed"] == PROMPTS
        assert r["placement/rollout_replicas"] + r["placement/genrm_replicas"] == 3
        # whoever generated this step (switched or not) sampled with exactly the trainer's weights
        assert r["train/rollout_logp_diff_max"] < 1e-4, r
    positions = []
    for dp in (0, 1):
        for line in (run_dir / "data" / f"consumed-dp{dp}.jsonl").read_text().splitlines():
            positions += json.loads(line)["positions"]
    assert len(positions) == len(set(positions)) == STEPS * PROMPTS, "a prompt was lost or repeated"
    return rows


def test_split_follows_the_load_and_survives_a_resume(mpirun, heavy_judge, tmp_path):
    # scoring-heavy: the judge writes 40 verdict tokens, the policy at most 8
    proc = run_split(tmp_path, POLICY, heavy_judge, FIRST, ("--set", "reward.verdict_max_tokens=40",
                                                            "--set", "rollout.max_new_tokens=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, shared = read_shared(tmp_path / "checkpoints" / f"step-{FIRST}" / "state.h5")
    # resumed generation-heavy: rule-only reward (no judge), 24 response tokens
    proc = run_split(tmp_path, POLICY, heavy_judge, STEPS, ("--set", "reward.mode=rule_only",
                                                            "--set", "rollout.max_new_tokens=24"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = check_every_sample_once(tmp_path)
    split = [int(r["placement/rollout_replicas"]) for r in rows]
    busy = [(round(r["placement/rollout_busy_s"], 2), round(r["placement/genrm_busy_s"], 2)) for r in rows]
    print(f"rollout replicas per step {split}, busy (rollout s, genrm s) {busy}, "
          f"weight sync s {[round(r['time/weight_sync'], 3) for r in rows]}")
    # step t+2's split is decided from step t's load (step t+1's weights leave at the end of step t):
    # 2 rollout + 1 GenRM configured, one rank moves to GenRM from step 3 on ...
    assert split[:FIRST] == [2, 2, 1, 1], busy
    # ... the resumed run goes on with the checkpoint's split (the configured one would be 2) ...
    assert (shared.counters["split_rollout"], shared.counters["split_rollout_next"]) == (1, 1)
    assert split[FIRST:FIRST + 2] == [1, 1]
    # ... and once generation is the heavy role, the rank comes back to rollout with fresh weights
    assert split[FIRST + 2:] == [2], busy
