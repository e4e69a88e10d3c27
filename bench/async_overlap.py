"""B14: does asynchronous RL (`rollout.max_staleness`) hide generation behind training, and does it still learn?

    .venv/bin/python bench/async_overlap.py                      # 3 runs per mode, 8 steps each (first 2 dropped)
    .venv/bin/python bench/async_overlap.py --curves             # + the demo's reward curves, 3 seeds x s = 0/1/2

Real `yatt-hpc run` of configs/demo_cpu.yaml in `disjoint` placement with one rank per group, each on one
thread (trainer dp 1, one rollout engine, one GenRM rank with the rule reward only), so training and
generation each take one of this machine's two cores when they overlap. The workload is sized so that a
synchronous step's training and rollout+reward phases take similar time (--prompts, --samples,
--max-new-tokens). Modes take turns: synchronous (s = 0) and s = 1, the same config otherwise. Per run the
median step time over the steps after the first two; ideal saved = the shorter of the synchronous run's
median train phase and median rollout+reward span (time/train vs the step minus train and weight sync);
saved = the synchronous median step minus the s = 1 median step, paired by turn. Target (the issue): saved /
ideal >= 0.8. With --curves: 30 demo steps (its own shape, dp 2) per seed and staleness, final reward = the
mean of the last 5 steps; s = 1 and s = 2 should reach the synchronous final reward within the spread of
the three seeds. Prints rich tables, writes bench/results/async_overlap.json.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report

from yatt_hpc.metrics.writer import step_rows

CONFIG = str(REPO / "configs/demo_cpu.yaml")


def run(run_dir: Path, sets: list[str]) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir), *args],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return step_rows(run_dir)


def overlap_sets(args, staleness: int) -> list[str]:
    one = "{nodes: 1, tasks_per_node: 1, cpus_per_task: 1}"
    return [f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}", f"rollout.max_new_tokens={args.max_new_tokens}",
            "reward.mode=rule_only", "eval.sources=[]", "eval.samples_per_prompt=1",
            "eval.max_prompts=null", "checkpoint.interval=0", "logging.progress=false", "placement.mode=disjoint",
            "placement.trainer={nodes: 1, tasks_per_node: 1, cpus_per_task: 1, tp: 1, dp: 1}",
            f"placement.rollout={one}", f"placement.genrm={one}", f"rollout.max_staleness={staleness}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--curves", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="async-overlap-"))
    steps: dict[int, list[float]] = {0: [], 1: []}
    train, generate, saved = [], [], []
    try:
        for turn in range(args.repeats):
            medians = {}
            for s in (0, 1):
                rows = run(root / f"s{s}-{turn}", overlap_sets(args, s))[2:]
                medians[s] = statistics.median(r["time/step"] for r in rows)
                steps[s].append(medians[s])
                if s == 0:
                    train.append(statistics.median(r["time/train"] for r in rows))
                    generate.append(statistics.median(r["time/step"] - r["time/train"] - r["time/weight_sync"]
                                                      for r in rows))
            saved.append(medians[0] - medians[1])
        ideal = [min(t, g) for t, g in zip(train, generate)]
        ratio = [s / i for s, i in zip(saved, ideal)]
        rows = [row("synchronous step (s)", spread(steps[0])), row("s = 1 step (s)", spread(steps[1])),
                row("synchronous train phase (s)", spread(train)),
                row("synchronous rollout + reward (s)", spread(generate)),
                row("saved per step (s)", spread(saved)), row("saved / ideal", spread(ratio), digits=2)]
        print_table("B14: step time, synchronous vs one-step-off (disjoint, one thread per group)",
                    ["", "median [min-max] (n)"], [[r["label"], r["value"]] for r in rows])
        raw = {"steps": steps, "train": train, "generate": generate, "saved": saved, "args": vars(args)}
        met = statistics.median(ratio) >= 0.8
        if args.curves:
            finals: dict[int, list[float]] = {0: [], 1: [], 2: []}
            for seed in range(3):
                for s in (0, 1, 2):
                    rows_s = run(root / f"curve-s{s}-{seed}", [
                        "train.steps=30", f"train.seed={seed}", "eval.every=0", "checkpoint.interval=0",
                        "logging.progress=false", "placement.mode=disjoint", f"rollout.max_staleness={s}"])
                    finals[s].append(statistics.mean(r["reward/mean"] for r in rows_s[-5:]))
            curve_rows = [row(f"final reward, s = {s}", spread(v)) for s, v in finals.items()]
            print_table("B14: the demo's final reward (mean of the last 5 of 30 steps), 3 seeds",
                        ["", "median [min-max] (n)"], [[r["label"], r["value"]] for r in curve_rows])
            rows += curve_rows
            raw["finals"] = finals
            low = min(finals[0])
            met = met and all(statistics.median(finals[s]) >= low for s in (1, 2))
        write_report("async_overlap", question="Does rollout.max_staleness=1 hide generation behind training, and "
                     "do s = 1 and s = 2 still learn the demo?",
                     target="saved / ideal >= 0.8; final reward at s = 1, 2 within the synchronous seeds' spread",
                     met=met, verdict=f"saved/ideal median {statistics.median(ratio):.2f}", rows=rows, raw=raw,
                     notes="disjoint placement, one rank and one thread per group on a 2-core machine; "
                           "paired turns; the first two steps of each run dropped (the bootstrap wave)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
