"""B16: with one tool call in four slow, what does `agent.turn_schedule: as_ready` save over `lockstep`?

    .venv/bin/python bench/agent_turns.py                  # both parts: 2 runs per mode and placement, 5 steps each
    .venv/bin/python bench/agent_turns.py --part loop      # the loop part alone (~1 min)

Part `loop`: the real `AgentLoop` and `ToolBox` (8 workers) on 32 trajectories of three tool turns and an answer,
each call `tests.programs.agent_tools:slow` sleeping --lag s for one call in four (chosen by a seeded RNG) and 0 s
for the rest; the engine is the scripted one (tests/programs/scripted_engine.py) made to cost what a batched
engine call costs, a fixed --engine-base s plus --engine-per-seq s per sequence, so this part measures the
schedule, not a model. The wall time of one `loop.run` per mode, modes in turns.

Part `runs`: real `yatt-hpc run`s of configs/demo_tools_cpu.yaml (the lookup demo: trainer dp 2, one rollout rank, one GenRM
rank) whose tool is `tests.programs.agent_tools:look_lagging`: the demo's `look`, sleeping --lag seconds for one
key in four and none for the rest, so most turns that call the tool wait on one slow call. Two placements: the
calls in the rollout rank's pool, and on a tools group of one rank (`placement.tools.tasks_per_node=1`). Modes
take turns, the same config otherwise. Per run, medians over the steps after the first: the rollout phase
(`time/rollout`), the step (`time/step`), the engine calls per step, the rollout rank's engine idle time waiting
on tools (`agent/engine_idle_s`) and a tool turn's mean wait (`agent/tool_wait_mean_s`). The demo's trajectories
make one call and its engine turns are short, so there the step is bounded by the slowest trajectory either way.
Report only.
Prints a table, writes bench/results/agent_turns.json.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report

sys.path.insert(0, str(REPO))  # this checkout's yatt_hpc and tests.programs, whatever the venv installed

from yatt_hpc.metrics.writer import step_rows  # noqa: E402

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


def loop_part(args) -> tuple[list[dict], dict, str]:
    """The schedule alone: the real loop and tool pool, a scripted engine with a batched engine's cost."""
    from tests.programs.scripted_engine import ScriptedEngine
    from yatt_hpc.agent.loop import AgentLoop
    from yatt_hpc.agent.tools import build_toolbox
    from yatt_hpc.config.agent import AgentConfig, ToolSpec
    from yatt_hpc.data.tokenizer import load_tokenizer
    from yatt_hpc.demo.lookup import CALL_PATTERN
    from yatt_hpc.rollout.engine import GenerationRequest

    class CostlyEngine(ScriptedEngine):
        def generate(self, requests, on_result=None, on_step=None):
            time.sleep(args.engine_base + args.engine_per_seq * len(requests))
            return super().generate(requests)

    tok = load_tokenizer(REPO / "models" / "demo_tools" / "policy")
    rng = random.Random(0)
    call = '<call>{{"name":"slow","arguments":{{"seconds":{}}}}}</call>'.format
    scripts = {i: [call(args.lag if rng.random() < 0.25 else 0) for _ in range(3)] + ["abc"] for i in range(32)}
    requests = [GenerationRequest(sample_id=i, prompt_ids=tok.encode("key abcd\n> "), max_new_tokens=64)
                for i in range(32)]
    got = {m: {"wall": [], "engine_calls": [], "engine_idle_s": []} for m in MODES}
    for _ in range(args.repeats * 2):
        for mode in MODES:
            cfg = AgentConfig(tools=[ToolSpec(function="tests.programs.agent_tools:slow")], tool_call_pattern=CALL_PATTERN,
                              max_turns=4, max_response_tokens=1000, tool_workers=8, turn_schedule=mode)
            loop = AgentLoop(cfg, tok, max_new_tokens=64, engine_seed=0, toolbox=build_toolbox(cfg))
            began = time.perf_counter()
            outs = loop.run(CostlyEngine(tok, scripts), requests)
            got[mode]["wall"].append(time.perf_counter() - began)
            stats = loop.take_stats()
            loop.toolbox.close()
            assert all(o.turns == 4 and o.result.finish_reason == "stop" for o in outs)
            got[mode]["engine_calls"].append(stats["agent_engine_calls"])
            got[mode]["engine_idle_s"].append(stats["agent_engine_idle_s"])
    labels = [("wall", "rollout of 32 trajectories (s)", 3), ("engine_calls", "engine calls", 1),
              ("engine_idle_s", "engine idle on tools (s)", 3)]
    rows = [row(f"loop, {mode}: {label}", spread(got[mode][key]), digits=digits)
            for key, label, digits in labels for mode in MODES]
    ratio = [r / lk for r, lk in zip(got["as_ready"]["wall"], got["lockstep"]["wall"])]
    rows.append(row("loop: as_ready / lockstep rollout (paired)", spread(ratio)))
    med = {m: statistics.median(got[m]["wall"]) for m in MODES}
    return rows, got, (f"loop: lockstep {med['lockstep']:.2f} s, as_ready {med['as_ready']:.2f} s "
                       f"({statistics.median(ratio):.2f}x)")


def runs_part(args) -> tuple[list[dict], dict, list[str]]:
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
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows, verdicts = [], []
    for place in PLACEMENTS:
        rows += [row(f"{place}, {mode}: {label}", spread(got[place][mode][key]), digits=digits)
                 for key, label, digits in KEYS for mode in MODES]
        ratio = [r / lk for r, lk in zip(got[place]["as_ready"]["time/rollout"], got[place]["lockstep"]["time/rollout"])]
        rows.append(row(f"{place}: as_ready / lockstep rollout phase (paired)", spread(ratio), digits=3))
        med = {m: statistics.median(got[place][m]["time/rollout"]) for m in MODES}
        verdicts.append(f"demo {place}: rollout phase lockstep {med['lockstep']:.2f} s, as_ready {med['as_ready']:.2f} s "
                        f"({statistics.median(ratio):.2f}x)")
    return rows, got, verdicts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["loop", "runs", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lag", type=float, default=0.3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--engine-base", type=float, default=0.05)
    ap.add_argument("--engine-per-seq", type=float, default=0.002)
    args = ap.parse_args()
    rows, raw, verdicts = [], {"args": vars(args)}, []
    if args.part in ("loop", "both"):
        part_rows, raw["loop"], verdict = loop_part(args)
        rows, verdicts = rows + part_rows, verdicts + [verdict]
    if args.part in ("runs", "both"):
        part_rows, raw["runs"], part_verdicts = runs_part(args)
        rows, verdicts = rows + part_rows, verdicts + part_verdicts
    print_table(f"B16: turn schedules, one tool call in four lagging {args.lag:g} s", ["", "median [min-max] (n)"],
                [[r["label"], r["value"]] for r in rows])
    write_report("agent_turns", question=f"With one tool call in four taking {args.lag:g} s, what does "
                 "agent.turn_schedule=as_ready save over lockstep?", target="report", met=None,
                 verdict="; ".join(verdicts), rows=rows, raw=raw,
                 notes=f"loop: 32 trajectories x 3 tool turns, engine cost {args.engine_base:g} s + "
                       f"{args.engine_per_seq:g} s per sequence per call, {args.repeats * 2} runs per mode; runs: "
                       f"configs/demo_tools_cpu.yaml (colocate, trainer dp 2), {args.prompts} prompts x "
                       f"{args.samples} samples, {args.steps} steps per run (the first dropped), {args.repeats} runs "
                       f"per mode and placement; modes take turns; os.cpu_count()={os.cpu_count()}")


if __name__ == "__main__":
    main()
