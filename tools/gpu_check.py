"""The GPU checks a CPU machine cannot run, one line each (`bash tools/gpu-check.sh OUT_DIR` calls this).

    python tools/gpu_check.py OUT_DIR            # ~6-9 minutes on one GPU; exit 0 only if nothing FAILed
    python tools/gpu_check.py OUT_DIR --config configs/demo_cpu.yaml --only hf-fp32,bf16-train   # harness on CPU

Each check prints `CHECK <name>: PASS|FAIL|SKIP <detail>` and leaves its logs under OUT_DIR/<name>/.
The runs are real `yatt-hpc run`s of configs/demo_1gpu.yaml (trainer, rollout and GenRM as three MPI
ranks on one device, full colocation), so every engine runs inside the MPI world:

  gpu-tests      tests/gpu: Megatron on CUDA + NCCL, release/resume, the bounded stop, the SGLang engine
  hf-fp32        the demo loop, fp32, hf engine: rollout/trainer logprobs agree (< 1e-4)
  bf16-train     model.dtype=bfloat16: bf16 Megatron with fp32 masters, bf16 hf engines, weight sync in bf16
  sglang-world   rollout and GenRM on SGLang inside the MPI world, bf16: generate, release/resume every
                 step (colocate), weight sync by MPI bytes (logprob gap), GenRM verdicts parse
  sglang-ipc     the same with rollout.weight_transport=auto: trainer and engine share the GPU, so weights
                 go as CUDA IPC handles into update_weights_from_tensor (logprob gap; MPI carried no tensor)
  sglang-collective  2 GPUs (SKIP with fewer): partial, trainer tp2 on GPUs 0-1, two SGLang rollout engines
                 on GPUs 0 and 1: auto sends GPU 1's by NCCL broadcast (init_weights_update_group,
                 update_weights_from_distributed) and GPU 0's by CUDA IPC (logprob gap; MPI carried no tensor)
  moe-demo       the demo loop with the mixture-of-experts policy (models/demo_moe): Megatron's MoE layers on CUDA
                 with the all-to-all token dispatcher, experts synced to the hf engine (logprob gap < 1e-4)
  recompute-budget  the demo loop with train.recompute=full and train.max_tokens_per_micro_batch on CUDA
  moe-ep2        2 GPUs (SKIP with fewer): partial, the MoE demo with trainer dp2 and expert parallelism 2 (each GPU
                 two of the four experts, tokens exchanged by the all-to-all dispatcher over NCCL; each rank's
                 experts synced to the engines; logprob gap < 1e-4)
  sharded-optim  2 GPUs (SKIP with fewer): partial, trainer dp2 with train.shard_optimizer over NCCL
  pp-nccl        2 GPUs (SKIP with fewer): tests/programs/pp_update.py at pp1 and pp2 (NCCL point to point
                 between the stages): the stages' log-probs and gradients equal the one-stage model's
  sglang-abort   the same with over-dispatch: the engine's abort cuts stragglers (rollout/aborted > 0)
  sglang-sigterm SIGTERM mid-run on the SGLang run: the ranks still agree, save and exit 0 with a checkpoint
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
BASE = ["--set", "logging.progress=false", "--set", "checkpoint.interval=2"]
CONFIG = "configs/demo_1gpu.yaml"
SGLANG = ["--set", "rollout.engine=sglang", "--set", "model.dtype=bfloat16"]
MPI_WEIGHTS = ["--set", "rollout.weight_transport=mpi"]  # auto would take CUDA IPC on one shared GPU
# two engines on GPUs 0 and 1 whose owner (trainer tp2, rank 0) is on GPU 0: one ipc pair, one collective pair
TWO_GPUS = ["--set", "placement.mode=partial", "--set", "placement.trainer.tasks_per_node=2",
            "--set", "placement.trainer.tp=2", "--set", "placement.trainer.dp=null",
            "--set", "placement.rollout.tasks_per_node=2", "--set", "placement.genrm.devices_per_task=0",
            "--set", "reward.mode=rule_only"]


def line(name: str, verdict: str, detail: str) -> bool:
    print(f"CHECK {name}: {verdict} {detail}", flush=True)
    return verdict != "FAIL"


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def start(out: Path, name: str, steps: int, extra: list[str]) -> tuple[subprocess.Popen, Path]:
    run_dir = out / name / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / "output.log", "w")
    argv = [PY, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir),
            "--set", f"train.steps={steps}", *BASE, *extra]
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), run_dir


def run(out: Path, name: str, steps: int, extra: list[str], timeout: float) -> tuple[int | None, list[dict]]:
    proc, run_dir = start(out, name, steps, extra)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    return code, metrics(run_dir)


def tail(out: Path, name: str) -> str:
    text = (out / name / "output.log").read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-3:])


def check_gpu_tests(out: Path) -> bool:
    (out / "gpu-tests").mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([PY, "-m", "pytest", "tests/gpu", "-q", "-ra", "-p", "no:cacheprovider"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    (out / "gpu-tests" / "pytest.log").write_text(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return line("gpu-tests", "PASS" if proc.returncode == 0 else "FAIL", summary)


def check_demo(out: Path, name: str, extra: list[str], gap: float, steps: int = 4) -> bool:
    code, rows = run(out, name, steps, extra, timeout=240)
    if code != 0 or len(rows) != steps:
        return line(name, "FAIL", f"exit {code}, {len(rows)}/{steps} steps: {tail(out, name)}")
    worst = max(r["train/rollout_logp_diff_max"] for r in rows)
    parse = max(r["reward/genrm_parse_fail"] for r in rows)
    ok = worst < gap and parse < 0.5 and all(r["train/grad_norm"] > 0 for r in rows)
    return line(name, "PASS" if ok else "FAIL", f"{steps} steps, logp gap max {worst:.2e} (bound {gap:g}), "
                f"genrm parse-fail max {parse:.2f}, reward {rows[-1]['reward/mean']:.3f}, "
                f"step time {rows[-1]['time/step']:.2f}s")


def check_transport(out: Path, name: str, extra: list[str], gpus: int = 1, steps: int = 4) -> bool:
    """A demo run whose weights must not cross MPI as bytes: logprob gap as sglang-world, and MPI carried
    at most a tenth of the weight bytes (handles, manifests, rendezvous)."""
    import torch

    if torch.cuda.device_count() < gpus:
        return line(name, "SKIP", f"needs {gpus} GPUs, this machine has {torch.cuda.device_count()}")
    code, rows = run(out, name, steps, extra, timeout=300)
    if code != 0 or len(rows) != steps:
        return line(name, "FAIL", f"exit {code}, {len(rows)}/{steps} steps: {tail(out, name)}")
    worst = max(r["train/rollout_logp_diff_max"] for r in rows)
    moved, over_mpi = rows[-1]["weight_sync/bytes"], max(r["weight_sync/mpi_bytes"] for r in rows)
    ok = worst < 0.5 and 0 < over_mpi < moved / 10 and all(r["train/grad_norm"] > 0 for r in rows)
    return line(name, "PASS" if ok else "FAIL", f"{steps} steps, logp gap max {worst:.2e} (bound 0.5), weight bytes "
                f"{moved:.0f} per sync, over MPI at most {over_mpi:.0f}, sync {rows[-1]['time/weight_sync']:.3f}s")


def check_pipeline(out: Path) -> bool:
    """One update of a tiny Qwen2.5-shaped policy on one GPU (pp1) and over two (pp2, NCCL p2p): the merged
    stages' log-probs and gradients against the one-stage model's."""
    import numpy as np
    import torch

    name = "pp-nccl"
    if torch.cuda.device_count() < 2:
        return line(name, "SKIP", f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    where = out / name
    where.mkdir(parents=True, exist_ok=True)
    mpirun = shutil.which("mpirun") or "mpirun"
    for pp in (1, 2):
        proc = subprocess.run([mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(pp), PY, "-m",
                               "tests.programs.pp_update", "--out", str(where), "--case", "qwen2-gqa-qkv-bias-tied",
                               "--pp", str(pp)], cwd=REPO, capture_output=True, text=True, timeout=300)
        (where / f"pp{pp}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            return line(name, "FAIL", f"pp{pp} exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    whole = dict(np.load(where / "tp1pp1-stage0.npz"))
    staged = {**np.load(where / "tp1pp2-stage0.npz"), **np.load(where / "tp1pp2-stage1.npz")}
    logp = float(np.abs(np.load(where / "tp1pp1-logprobs.npy") - np.load(where / "tp1pp2-logprobs.npy")).max())
    worst = max(float(np.abs(whole[k] - staged[k]).max()) / max(float(np.abs(whole[k]).max()), 1e-30) for k in whole)
    ok = set(whole) == set(staged) and logp < 1e-5 and worst < 1e-4
    return line(name, "PASS" if ok else "FAIL", f"log-prob max diff {logp:.2e} (bound 1e-5), gradient/weight max "
                f"relative diff {worst:.2e} (bound 1e-4)")


def check_abort(out: Path) -> bool:
    name = "sglang-abort"
    code, rows = run(out, name, 4, SGLANG + ["--set", "rollout.over_dispatch_ratio=1.5"], timeout=240)
    aborted = sum(r.get("rollout/aborted", 0) for r in rows)
    ok = code == 0 and len(rows) == 4 and aborted > 0
    return line(name, "PASS" if ok else "FAIL", f"exit {code}, {len(rows)}/4 steps, {aborted:g} samples aborted")


def check_sigterm(out: Path) -> bool:
    name = "sglang-sigterm"
    proc, run_dir = start(out, name, 40, SGLANG)
    deadline = time.monotonic() + 240
    while len(metrics(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if proc.poll() is not None or time.monotonic() >= deadline:
        proc.kill()
        return line(name, "FAIL", f"the run did not reach step 3 ({len(metrics(run_dir))} steps): {tail(out, name)}")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return line(name, "FAIL", "no exit within 120 s of SIGTERM")
    took = time.monotonic() - sent
    committed = sorted(p.parent.name for p in (run_dir / "checkpoints").glob("step-*/COMMITTED"))
    done = len(metrics(run_dir))
    ok = code == 0 and f"step-{done}" in committed and "run the same command again to resume" in tail(out, name)
    return line(name, "PASS" if ok else "FAIL", f"exit {code} {took:.1f}s after SIGTERM, {done} steps, "
                f"committed {committed}")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main() -> int:
    global CONFIG
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path("gpu-check-out"))
    parser.add_argument("--config", default=CONFIG, help="the run config of the demo checks")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args()
    CONFIG, out = args.config, args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    checks = {"gpu-tests": lambda: check_gpu_tests(out),
              "hf-fp32": lambda: check_demo(out, "hf-fp32", [], gap=1e-4),
              "bf16-train": lambda: check_demo(out, "bf16-train", ["--set", "model.dtype=bfloat16"], gap=0.5),
              "sglang-world": lambda: check_demo(out, "sglang-world", SGLANG + MPI_WEIGHTS, gap=0.5),
              "moe-demo": lambda: check_demo(out, "moe-demo", ["--set", "model.path=models/demo_moe/policy"], gap=1e-4),
              "recompute-budget": lambda: check_demo(out, "recompute-budget", [
                  "--set", "train.recompute=full", "--set", "train.max_tokens_per_micro_batch=256"], gap=1e-4),
              "moe-ep2": lambda: check_demo(out, "moe-ep2", TWO_GPUS + [
                  "--set", "placement.trainer.tp=1", "--set", "placement.trainer.ep=2",
                  "--set", "model.path=models/demo_moe/policy"], gap=1e-4)
              if _gpus() >= 2 else line("moe-ep2", "SKIP", f"needs 2 GPUs, this machine has {_gpus()}"),
              "sharded-optim": lambda: check_demo(out, "sharded-optim", TWO_GPUS + [  # trainer dp2 instead of tp2
                  "--set", "placement.trainer.tp=1", "--set", "train.shard_optimizer=true"], gap=1e-4)
              if _gpus() >= 2 else line("sharded-optim", "SKIP", f"needs 2 GPUs, this machine has {_gpus()}"),
              "pp-nccl": lambda: check_pipeline(out),
              "sglang-ipc": lambda: check_transport(out, "sglang-ipc", SGLANG),
              "sglang-collective": lambda: check_transport(out, "sglang-collective", SGLANG + TWO_GPUS, gpus=2),
              "sglang-abort": lambda: check_abort(out),
              "sglang-sigterm": lambda: check_sigterm(out)}
    chosen = [c for c in args.only.split(",") if c] or list(checks)
    unknown = sorted(set(chosen) - set(checks))
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(checks)}")
    try:
        import sglang  # noqa: F401
        missing = None
    except ImportError as err:
        missing = err
    results = []
    for name in chosen:
        if name.startswith("sglang") and missing is not None:
            results.append(line(name, "SKIP", f"sglang is not importable here ({missing}); pip install 'yatt-hpc[gpu]'"))
        else:
            results.append(checks[name]())
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
