"""Real `yatt-hpc run` under mpirun: GRPO steps with trainer DP=2, rollout and GenRM ranks.

These are the spine's end-to-end checks: the metrics every review needs exist and make sense,
the leader holds only its share of samples, the same seed gives the same run, and bad input
takes every rank down quickly with one clear message.
"""
import re
import shutil
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import REPO, ReferenceRun, mpi_env
from yatt_hpc.metrics.writer import step_rows

CONFIG = str(REPO / "configs/demo_cpu.yaml")
FAST = ["--set", "train.steps=2", "--set", "train.prompts_per_step=8", "--set", "rollout.samples_per_prompt=4",
        "--set", "logging.progress=false"]
TAGS = ["reward/mean", "reward/accuracy", "reward/genrm_agreement", "reward/genrm_parse_fail", "train/loss",
        "train/kl", "train/entropy", "train/grad_norm", "rollout/response_len_mean", "time/step", "time/rollout",
        "time/reward", "time/train", "time/weight_sync", "throughput/tokens_per_s",
        *(f"memory/peak_rss_mb/{g}" for g in ("trainer", "rollout", "genrm")),
        *(f"control/peak_held_samples/{g}" for g in ("trainer", "rollout", "genrm"))]


def yatt_run(run_dir, *extra, timeout=400):
    return subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir), *FAST, *extra],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=timeout)


def metrics(run_dir):
    return step_rows(run_dir)


@pytest.fixture(scope="module")
def demo_run(reference_run):
    """The session's reference run (tests/conftest.py): this module's shape (8 prompts x 4 samples,
    DP=2) for ReferenceRun.STEPS steps, TensorBoard on."""
    return reference_run.dir


def test_every_tag_is_written_to_tensorboard(demo_run, reference_run):
    acc = EventAccumulator(str(demo_run / "tb"))
    acc.Reload()
    have = set(acc.Tags()["scalars"])
    assert not set(TAGS) - have, sorted(set(TAGS) - have)
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(1, reference_run.STEPS + 1))


def test_metrics_are_consistent(demo_run, reference_run):
    rows = metrics(demo_run)
    assert [r["step"] for r in rows] == list(range(1, reference_run.STEPS + 1))
    for r in rows:
        assert 0.0 <= r["reward/mean"] <= 1.0 and 0.0 <= r["reward/accuracy"] <= 1.0
        assert r["reward/genrm_agreement"] >= 0.5, "the demo judge must mostly agree with the rule verifier"
        assert r["data/prompts_consumed"] == 8
        assert r["rollout/response_len_mean"] > 0 and r["train/grad_norm"] > 0
        assert r["time/step"] >= max(r["time/train"], r["time/rollout"])
        # peaks over the run so far: 8 prompts x 4 samples over DP=2 give each trainer replica 16 samples, but
        # the demo validates before step 1 (64 held-out prompts x 4 over DP=2): each replica held its 128
        assert r["control/peak_held_samples/trainer"] == 128
        assert r["control/leader_peak_held_samples"] == 128, "the leader holds its share, nothing more"
        assert r["control/peak_held_samples/rollout"] >= 32 and r["control/peak_held_samples/genrm"] >= 16
        assert all(r[f"memory/peak_rss_mb/{g}"] > 50 for g in ("trainer", "rollout", "genrm"))


def test_run_dir_layout(demo_run):
    logs = sorted(p.name for p in (demo_run / "logs").glob("*.log"))
    assert logs == ["rank-0000-trainer.log", "rank-0001-trainer.log", "rank-0002-rollout.log", "rank-0003-genrm.log"]
    assert (demo_run / "config.yaml").is_file() and (demo_run / "summary.json").is_file()


def test_a_redirected_run_prints_plain_text_and_no_third_party_start_up_notices(reference_run):
    """Output to a pipe or a file has no terminal codes (mpirun gives ranks a pseudo-terminal: the launcher
    tells them), and Megatron's Transformer Engine / Apex fallback notices are in no rank's log."""
    assert "step 20/20" in reference_run.output or "run summary" in reference_run.output
    assert "\x1b[" not in reference_run.output
    for log in sorted((reference_run.dir / "logs").glob("rank-*.log")):
        text = log.read_text()
        assert "not installed" not in text and "Megatron-FSDP" not in text, log.name


def test_missing_model_file_is_a_clear_error(mpirun, tmp_path):
    proc = yatt_run(tmp_path / "run", "--set", f"model.path={tmp_path}/nope")
    assert proc.returncode == 2
    assert "model.path=" in proc.stderr and "no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dataset_row_without_prompt_stops_every_rank(mpirun, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "reverse abcde=", "answer": "edcba"}\n{"question": "x", "answer": "y"}\n' * 8)
    start = time.monotonic()
    proc = yatt_run(tmp_path / "run", "--set", f"data.source={data}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # rows are read lazily by position: the first bad row a replica reaches (an even line) is named
    found = re.search(r"data\.jsonl:(\d+): row has no 'prompt'", proc.stderr)
    assert found and int(found.group(1)) % 2 == 0, proc.stderr[-2000:]
    assert time.monotonic() - start < 90, "every rank must exit promptly (MPI abort), not hang"


def test_hand_launch_with_wrong_rank_count_fails_fast(mpirun, tmp_path, demo_run):
    run_dir = tmp_path / "run"
    shutil.copytree(demo_run, run_dir, ignore=shutil.ignore_patterns("tb", "logs", "*.jsonl"))
    cmd = [mpirun, "--oversubscribe", "-np", "5", sys.executable, "-m", "yatt_hpc.runtime.worker",
           "--group", "trainer", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "the MPI world has 5 ranks but the plan needs 4" in proc.stderr


def test_load_from_starts_fresh_with_another_runs_weights(demo_run, tmp_path):
    proc = yatt_run(tmp_path / "run", "--set", "train.steps=1", "--set", f"checkpoint.load_from={demo_run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "run" / "logs" / "rank-0000-trainer.log").read_text()
    assert f"initialized weights from {demo_run} (its step {ReferenceRun.STEPS})" in log
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1]
    # the rollout engine samples with the loaded weights, not the initial model's
    assert rows[0]["train/rollout_logp_diff_max"] < 1e-4


def test_sampling_temperature_is_the_temperature_the_trainer_scores_at(tmp_path):
    """At rollout.temperature 0.7 the trainer's logprobs of the sampled tokens are the engine's (they
    were 1.65-1.93 nats apart when the trainer always scored at temperature 1). Scoring by rule only,
    the GenRM rank runs, checkpoints at the end and exits without ever importing torch; the trainers
    without torch._dynamo or transformers, the rollout engine with torch alone."""
    proc = yatt_run(tmp_path / "run", "--set", "train.steps=1", "--set", "rollout.temperature=0.7",
                    "--set", "reward.mode=rule_only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert rows[0]["train/rollout_logp_diff_max"] < 1e-4
    genrm_log = (tmp_path / "run" / "logs" / "rank-0003-genrm.log").read_text()
    assert "done: complete (loaded: no torch)" in genrm_log, genrm_log[-2000:]
    # a trainer steps its optimizer and checkpoints without ever importing torch._dynamo (optim/adamw.py)
    # or transformers (the demo's config.json read as written); the engine serves the demo's GPT-2 natively
    trainer_log = (tmp_path / "run" / "logs" / "rank-0000-trainer.log").read_text()
    assert "done: complete (loaded: torch, megatron.core)" in trainer_log, trainer_log[-2000:]
    assert "update forward: each prompt once per micro-batch" in trainer_log  # GPT-2: the shared-prompt forward
    rollout_log = (tmp_path / "run" / "logs" / "rank-0002-rollout.log").read_text()
    assert "with the native GPT-2 forward" in rollout_log and "done: complete (loaded: torch)" in rollout_log
    assert (tmp_path / "run" / "checkpoints" / "step-1" / "COMMITTED").exists()
    # every rank started without the cyclic collector and stepped with it on again (runtime/collector.py)
    for log in (tmp_path / "run" / "logs").glob("rank-*.log"):
        assert "start-up ran without the cyclic collector; its " in log.read_text(), log.name


def test_bf16_run_trains_and_checkpoints_fp32_masters(tmp_path):
    """model.dtype=bfloat16: trainer, engines and judge in bf16 (logprobs then agree to bf16 precision,
    not fp32's), fp32 master weights in the checkpoint."""
    from safetensors import safe_open

    proc = yatt_run(tmp_path / "run", "--set", "model.dtype=bfloat16", "--set", "checkpoint.interval=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/grad_norm"] > 0 and 1e-6 < r["train/rollout_logp_diff_max"] < 0.5, r
    shards = sorted((tmp_path / "run" / "checkpoints").glob("step-*/model-*.safetensors"))
    assert shards, sorted(p.name for p in (tmp_path / "run" / "checkpoints").rglob("*"))
    with safe_open(str(shards[0]), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    assert dtypes == {"F32"}, dtypes


def test_a_transformers_tokenizer_trains_exactly_like_the_character_one(demo_run, tmp_path):
    """The demo policy behind an HF tokenizer with the same ids (the path every real model takes) gives
    the very same run: it used to train at reward 0.000 because decoded responses kept their EOS. Being
    another launch with the same seed, it is also the check that a seed fixes the whole run."""
    from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer, save_hf_twin

    hf_policy = tmp_path / "hf_policy"
    hf_policy.mkdir()
    for f in (REPO / "models/demo/policy").iterdir():
        if f.name != TOKENIZER_FILE:
            shutil.copy(f, hf_policy / f.name)
    save_hf_twin(CharTokenizer.load(REPO / "models/demo/policy"), hf_policy)
    proc = yatt_run(tmp_path / "run", "--set", f"model.path={hf_policy}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same seed gives the same run: rewards, lengths and losses equal the character run's, step by step
    keys = ("reward/mean", "reward/accuracy", "rollout/response_len_mean", "train/loss")
    want, got = metrics(demo_run)[:2], metrics(tmp_path / "run")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in want]
    assert got[0]["reward/mean"] > 0.1
