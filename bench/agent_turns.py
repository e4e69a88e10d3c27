"""B16: with one tool call in four slow, what does `agent.turn_schedule: as_ready` save over `lockstep`?

    .venv/bin/python bench/agent_turns.py                  # 2 runs per mode and placement, 5 steps each
    .venv/bin/python bench/agent_turns.py --lag 0.5 --repeats 3

Real `yatt-hpc run`s of configs/demo_tools_cpu.yaml (the lookup demo: trainer dp 2, one rollout rank, one GenRM
rank) whose tool is `tests.programs.agent_tools:look_lagging`: the demo's `look`, sleeping --lag seconds for one
key in four and none for the rest, so most turns that call the tool wait on one slow call. Two placements: the
calls in the rollout rank's pool, and on a tools group of one rank (`placement.tools.tasks_per_node=1`). Modes
take turns, the same config otherwise. Per run, medians over the steps after the first: the rollout phase
(`time/rollout`), the step (`time/step`), the engine calls per step, the rollout rank's engine idle time waiting
on tools (`agent/engine_idle_s`) and a tool turn's mean wait (`agent/tool_wait_mean_s`). Report only.
Prints a table, writes bench/results/agent_turns.json.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report

from yatt_hpc.metrics.writer import step_rows

CONFIG = str(REPO / "configs/demo_tools_cpu.yaml")
MODES = ("lockstep", "as_ready")
PLACEMENTS = {"pool": [], "tools-group": ["placement.tools.tasks_per_node=1"]}
KEYS = [("time/rollout", "rollout phase (s)", 3), ("time/step", "step (s)", 3),
        ("agent/engine_calls", "engine calls per step", 1), ("agent/engine_idle_s", "engine idle on tools (s)", 3),
        ("agent/tool_wait_mean_s", "tool turn wait, mean (s)", 3), ("agent/tool_calls", "tool calls per step", 1)]


def run(run_dir: Path, sets: list[str], lag: float) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    env = {**mpi_env(), "YATT_TOOL_LAG_S": str(lag)}
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "run", CONFIG, "--run-dir", str(run_dir), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return step_rows(run_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lag", type=float, default=0.3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    base = [f"train.steps={args.steps}", f"train.prompts_per_step={args.prompts}",
            f"rollout.samples_per_prompt={args.samples}", "checkpoint.interval=0", "logging.progress=false",
            "eval.sources=[]", "eval.samples_per_prompt=1", "eval.max_prompts=null",
            "agent.tools=[{function: 'tests.programs.agent_tools:look_lagging', name: look}]"]
    root = Path(tempfile.mkdtemp(prefix="agent-turns-"))
    got = {p: {m: {k: [] for k, _, _ in KEYS} for m in MODES} for p in PLACEMENTS}
    try:
        for turn in range(args.repeats):
            for place, extra in PLACEMENTS.items():
                for mode in MODES:
                    steps = run(root / f"{place}-{mode}-{turn}", [*base, *extra, f"agent.turn_schedule={mode}"],
                                args.lag)[1:]
                    for key, _, _ in KEYS:
                        got[place][mode][key].append(statistics.median(r[key] for r in steps))
        rows, verdicts = [], []
        for place in PLACEMENTS:
            rows += [row(f"{place}, {mode}: {label}", spread(got[place][mode][key]), digits=digits)
                     for key, label, digits in KEYS for mode in MODES]
            ratio = [r / lk for r, lk in zip(got[place]["as_ready"]["time/rollout"],
                                             got[place]["lockstep"]["time/rollout"])]
            rows.append(row(f"{place}: as_ready / lockstep rollout phase (paired)", spread(ratio), digits=3))
            med = {m: statistics.median(got[place][m]["time/rollout"]) for m in MODES}
            verdicts.append(f"{place}: rollout phase lockstep {med['lockstep']:.2f} s, as_ready {med['as_ready']:.2f} s "
                            f"({statistics.median(ratio):.2f}x)")
        print_table(f"B16: turn schedules, one key in four lagging {args.lag:g} s", ["", "median [min-max] (n)"],
                    [[r["label"], r["value"]] for r in rows])
        write_report("agent_turns", question=f"With one tool call in four taking {args.lag:g} s, what does "
                     "agent.turn_schedule=as_ready save over lockstep?", target="report", met=None,
                     verdict="; ".join(verdicts), rows=rows, raw={"runs": got, "args": vars(args)},
                     notes=f"configs/demo_tools_cpu.yaml (colocate, trainer dp 2), {args.prompts} prompts x "
                           f"{args.samples} samples, {args.steps} steps per run (the first dropped); modes take "
                           f"turns; YATT_TOOL_LAG_S={args.lag:g}; os.cpu_count()={os.cpu_count()}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
