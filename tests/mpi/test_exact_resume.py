"""Exact resume under real mpirun: interrupted runs end with bitwise the same weights and data.

Run K steps straight through; run again and stop it with SIGTERM mid-run (it saves and exits),
then resume; run a third time and SIGKILL every rank mid-run (no save: only periodic checkpoints
survive, possibly with an async write torn), then resume. All three must end with identical
parameters and the identical sequence of consumed prompt positions.

The same holds at a real layer shape (test_a_real_size_layer_shape_resumes_bitwise_identical): two layers of
Qwen2.5-0.5B with its padded 151,936 vocabulary, the trainer on two threads, every default on (shared
prompts, chunked log-probs, async checkpoints); there the kernels run at the sizes where PyTorch's CPU
kernels go parallel, which the demo's never reach.

The stop comes at a random time after a random step, so it may land in a step or in an async write;
it can never come after the run ended: the last step's rollout is held until the rank is stopped
(tests/programs/held_engine.py), since at ~0.09 s a step the remaining steps could end before the
stop (as few as 4 steps against a delay of up to 0.35 s). A SIGTERM that finds the hold gives the
last step up after checkpoint.stop_grace_s (2 s here) and the run resumes from the step before; a
SIGKILL ends the hold with the process.
"""
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO, checkpoint_weights, final_state, full_matrix_only, kill_tree, mpi_env
from tests.programs.held_engine import held_env
from yatt_hpc.metrics.writer import step_rows

CONFIG = str(REPO / "configs/demo_cpu.yaml")
K = 8
ARGS = ["--set", f"train.steps={K}", "--set", "train.prompts_per_step=8", "--set", "rollout.samples_per_prompt=4",
        "--set", "checkpoint.interval=2", "--set", "checkpoint.stop_grace_s=2", "--set", "logging.progress=false"]


def cmd(run_dir, args=ARGS):
    return [sys.executable, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir), *args]


def finished_steps(run_dir) -> int:
    return len(step_rows(run_dir))


def start_and_interrupt(run_dir, after_steps: int, how: str, command=None, steps: int = K, within_s: float = 0.3):
    """Run `command` (the demo's by default) and stop it `how` at a random moment in the `within_s` after
    step `after_steps` ended; its step `steps` cannot end before the stop."""
    env = mpi_env() | held_env(run_dir.parent / "held", at_version=steps - 1)
    proc = subprocess.Popen(command or cmd(run_dir), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while finished_steps(run_dir) < after_steps and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    seed = random.randrange(2**32)
    delay = random.Random(seed).uniform(0.0, within_s)
    print(f"interrupting {how} {delay:.3f}s after step {after_steps} (seed {seed})")
    time.sleep(delay)  # land inside a step, or inside an async write (a random place, not a state to reach)
    if how == "term":
        proc.send_signal(signal.SIGTERM)
    else:
        # every rank, mpirun (its own session) and the launcher: nobody gets a chance to save
        kill_tree(proc.pid)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


@pytest.fixture(scope="module")
def straight(reference_run):
    """Where K uninterrupted steps end (the session's reference run, tests/conftest.py)."""
    return reference_run.state(K)


def assert_same(a, b, prompts: int = K * 8):
    wa, ca = a
    wb, cb = b
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs after resume"
    assert ca == cb, "consumed prompt sequence differs"
    positions = [p for replica in ca for _, ps in replica for p in ps]
    assert len(positions) == len(set(positions)) == prompts, "a prompt was lost or repeated"


# `make test` runs the SIGTERM case; SIGKILL of every rank runs with YATT_FULL_FAULT_MATRIX=1: a rerun after
# an abort of every rank ends bitwise where the reference does in tests/mpi/test_faults.py (the stopped rank),
# and a write torn by SIGKILL is skipped and cleaned in tests/unit/test_ckpt_crash.py.
@pytest.mark.parametrize("how", ["term", pytest.param("kill", marks=full_matrix_only)])
def test_interrupted_run_resumes_bitwise_identical(straight, tmp_path, how):
    run_dir = tmp_path / "run"
    seed = random.randrange(2**32)
    after = random.Random(seed).randint(2, K - 4)
    print(f"interrupting after step {after} (seed {seed})")
    code, out = start_and_interrupt(run_dir, after_steps=after, how=how)
    if how == "term":
        assert code == 0, out[-3000:]
        assert "run the same command again to resume" in out
    assert finished_steps(run_dir) < K, "the interruption came too late to test anything"
    proc = subprocess.run(cmd(run_dir), cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if how == "term":
        assert "resumed from checkpoint step" in proc.stdout
    assert_same(final_state(run_dir, K), straight)
    if how == "term":  # running a finished run again does nothing (once: it does not depend on how it stopped)
        again = subprocess.run(cmd(run_dir), cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and "is already complete: 8 of 8 steps" in again.stdout


# ---------------------------------------------------------------------------------------- a real layer shape

REAL_STEPS = 4
REAL_ARGS = ["--set", f"train.steps={REAL_STEPS}", "--set", "train.prompts_per_step=2", "--set",
             "rollout.samples_per_prompt=4", "--set", "rollout.max_new_tokens=12", "--set",
             "rollout.weight_sync_bucket_mb=64", "--set", "checkpoint.interval=1", "--set", "checkpoint.stop_grace_s=2",
             "--set", "logging.progress=false", "--set",
             "placement.trainer={nodes: 1, tasks_per_node: 1, tp: 1, dp: 1, cpus_per_task: 2}"]


@pytest.fixture(scope="module")
def real_shape_policy(tmp_path_factory):
    """Two layers of Qwen2.5-0.5B (hidden 896, 14 heads over 2 key/value groups, MLP 4864, tied embeddings,
    the padded 151,936 vocabulary), seeded random weights, with the demo's tokenizer: the ids the policy
    samples past the tokenizer's are dropped from the text the reward reads, as a padded vocabulary's are."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("real-shape") / "policy"
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    shutil.copy(REPO / "models/demo/policy/yatt_tokenizer.json", path)
    return path


def real_state(run_dir, step: int):
    """(weights at `step`, the replica's consumed (step, positions) up to it) of a real-shape run."""
    import json

    rows = [json.loads(line) for line in (run_dir / "data" / "consumed-dp0.jsonl").read_text().splitlines()]
    return checkpoint_weights(run_dir, step), [(r["step"], r["positions"]) for r in rows if r["step"] <= step]


@full_matrix_only  # ~4 min on 2 cores; in CI the real-size update is checked bitwise across two processes
# (tests/unit/test_determinism.py) and the resume path at the demo's size (above)
def test_a_real_size_layer_shape_resumes_bitwise_identical(real_shape_policy, tmp_path):
    args = [*REAL_ARGS, "--set", f"model.path={real_shape_policy}"]
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    proc = subprocess.run(cmd(straight_dir, args), cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seed = random.randrange(2**32)
    after = random.Random(seed).randint(1, REAL_STEPS - 2)
    print(f"interrupting after step {after} (seed {seed})")
    code, out = start_and_interrupt(run_dir, after, "term", cmd(run_dir, args), steps=REAL_STEPS, within_s=8.0)
    assert code == 0, out[-3000:]
    assert finished_steps(run_dir) < REAL_STEPS, "the interruption came too late to test anything"
    proc = subprocess.run(cmd(run_dir, args), cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed from checkpoint step" in proc.stdout
    want, got = real_state(straight_dir, REAL_STEPS), real_state(run_dir, REAL_STEPS)
    differ = [name for name in want[0] if not torch.equal(want[0][name], got[0][name])]
    assert not differ, f"{len(differ)} of {len(want[0])} tensors differ after resume: {differ[:4]}"
    assert want[1] == got[1], "consumed prompt sequence differs"
