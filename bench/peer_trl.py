"""B9: yatt-hpc vs TRL's GRPOTrainer on the same machine: step wall time and start-up, same task and weights.

    .venv/bin/python bench/peer_trl.py                      # 2 turns per side and shape, ~8 min on 2 cores
    .venv/bin/python bench/peer_trl.py --repeats 1 --shapes demo

The peer runs in its own venv, bench/peers/.venv (`bash bench/peers/setup.sh`: trl, accelerate and
datasets pinned in bench/peers/requirements.txt, torch and transformers those of .venv), through
bench/peers/trl_grpo.py. Both sides start from the same weights, read the same prompts in the same order
(yatt-hpc's own prompt stream, written out for TRL), score with the same rule (`reward.mode: rule_only`,
`yatt_hpc.reward.verifier.rule_score`) and take the GRPO step of configs/demo_cpu.yaml: 16 prompts x 8
samples, lr 3e-4 constant, clip [0.2, 0.28], KL 0.001, temperature 1.0, seeded. yatt-hpc is
`yatt-hpc run configs/demo_cpu.yaml --set reward.mode=rule_only` (4 MPI ranks: 2 trainers, rollout,
GenRM scoring by rule), no checkpoints between steps, no TensorBoard; TRL is one process, fp32, no
gradient checkpointing, nothing saved, with the glibc malloc settings our ranks make for themselves
(`runtime/allocator.py`), given through glibc's own variables. Two shapes: `demo` (models/demo/policy, 0.16 M parameters,
12-token responses, 30 steps) and `wide` (a seeded random GPT-2 of ~3.2 M parameters built here, 256
wide, 4 layers, 48-token responses, 6 steps). The sides take turns (yatt, trl, yatt, trl...).

Per run: each step's wall time from its beginning to the next step's (yatt: the leader's log lines
"step k begins", millisecond stamps; TRL: its on_step_begin times), so what runs between steps counts on
both sides (our step report and stop agreement, TRL's logging); each side's own clock of the step body
(yatt: metrics.jsonl `time/step`; TRL: on_step_begin -> on_step_end); the mean reward per step; and
process start -> step 1 begins (yatt: launch -> the leader's "step 1 begins"; TRL: launch -> the first
on_step_begin). Step times are pooled over steps 2..N-1 of all runs (step 1 pays first-call warm-ups on
both sides; the last has no next beginning); ratios are paired per turn. Where a step goes:
generation (yatt: the rollout phase; TRL: its generation call, wrapped) and training (yatt: the trainer
phase; TRL: the rest of the step but the reward call), and each yatt-hpc phase (RUN_DIR/timeline); the
start-up marks of both sides. Prints rich tables, writes bench/results/peer_trl.json.
Targets: yatt-hpc/TRL step time <= 0.8 at both shapes; start -> step 1 <= 1.2x TRL's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import numpy as np
from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report
from rich.markup import escape

from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.runtime.allocator import peer_environment

PEERS = REPO / "bench" / "peers"
PEER_PYTHON = PEERS / ".venv" / "bin" / "python"
CONFIG = "configs/demo_cpu.yaml"
PROMPTS_PER_STEP = 16
SHAPES = {"demo": {"steps": 30, "max_new_tokens": 12, "model": None},
          "wide": {"steps": 6, "max_new_tokens": 48, "model": {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 128}}}
STEP_TARGET, START_TARGET = 0.8, 1.2
NOTES = ('Same machine, the sides taking turns. yatt-hpc runs its 4-rank demo layout on the 2 cores (2 trainer ranks, '
         'each passing its 64 samples in one micro-batch as TRL passes its 128 in one, 1 rollout engine, 1 GenRM rank '
         "scoring by rule, taking the cores in turn); TRL is one process with torch's default threads. A step is "
         "generation + reward + reference and policy passes + optimizer step on both sides; yatt-hpc's also moves the "
         'batch between ranks and syncs the weights to the rollout engine. Same rule on the same prompts: the demo '
         'curves differ only by sampling; the random wide policy never reverses a word, so its reward is 0 on both sides'
         ' (its step still does all the work: advantages are 0, not skipped).')


def build_model(root: Path, shape: dict) -> tuple[str, str]:
    """The wide shape's seeded random policy; returns its directory and the sha256 of its weights."""
    from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model

    directory = save_char_model(char_gpt2(seed=0, **shape), root / "wide")
    return directory, hashlib.sha256((Path(directory) / "model.safetensors").read_bytes()).hexdigest()


def prompt_rows(steps: int) -> list[dict]:
    """The prompts yatt-hpc's trainers read in `steps` steps, in their order (positions 0..16*steps-1)."""
    from yatt_hpc.config import load_config
    from yatt_hpc.data.prompts import build_prompt_source

    stream = build_prompt_source(load_config(REPO / CONFIG).data)
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in stream.rows_at(0, steps * PROMPTS_PER_STEP)]


def commit() -> str:
    """The yatt-hpc commit measured, with `+dirty` when yatt_hpc/ differs from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "yatt_hpc"], cwd=REPO).returncode
    return head + ("+dirty" if dirty else "")


def log_time(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def yatt_phases(run_dir: Path) -> dict[str, list[float]]:
    """Per `group/phase`: the longest rank's total time in that phase, per step."""
    per = defaultdict(lambda: defaultdict(float))
    for path in (run_dir / "timeline").glob("rank-*.jsonl"):
        group = path.stem.split("-", 2)[2]
        totals = defaultdict(float)
        for line in path.read_text().splitlines():
            e = json.loads(line)
            totals[(e["step"], e["phase"])] += e["end"] - e["start"]
        for (step, phase), s in totals.items():
            per[f"{group}/{phase}"][step] = max(per[f"{group}/{phase}"][step], s)
    return {k: [v[s] for s in sorted(v)] for k, v in sorted(per.items())}


def launch(argv: list[str], log: Path, **kw) -> float:
    """Run argv with its output in `log` (shown if it fails); returns the wall-clock time it was started."""
    start = time.time()
    with log.open("w") as out:
        done = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=900, **kw)
    if done.returncode:
        sys.exit(f"{' '.join(argv[:3])} ... failed (exit {done.returncode}); its output ends:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))
    return start


def first_time(lines: list[str], pattern: str) -> float | None:
    return next((log_time(x) for x in lines if re.search(pattern, x)), None)


def run_yatt(model: str, shape: dict, root: Path, tag: str) -> dict:
    run_dir = root / f"yatt-{tag}"
    # each trainer rank passes its share of the step (64 of 128 samples) in one micro-batch, as TRL
    # passes its 128 in one (per_device_train_batch_size=128): the demo config's 32 is a memory setting
    sets = {"reward.mode": "rule_only", "model.path": model, "train.steps": shape["steps"], "train.micro_batch_size": 64,
            "rollout.max_new_tokens": shape["max_new_tokens"], "checkpoint.interval": 0,
            "logging.trackers": [], "logging.progress": False}
    argv = [str(Path(PYTHON).parent / "yatt-hpc"), "run", CONFIG, "--run-dir", str(run_dir)]
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    start = launch(argv, root / f"yatt-{tag}.log", env=mpi_env())
    wall = time.time() - start
    logs = {p.stem: p.read_text().splitlines() for p in (run_dir / "logs").glob("rank-*.log")}
    leader = logs["rank-0000-trainer"]
    # start-up marks of the leader (and of the rollout engine, which the first step waits for)
    marks = {"rank 0 logs (python up)": first_time(leader, r"started: pid"),
             "GenRM rank ready (imports, MPI world)": max(first_time(v, r"genrm rank scores") or 0
                                                         for v in logs.values()),
             "rank 0 Megatron model built": first_time(leader, r"trainer dp=0 .* ready"),
             "rollout engine ready": max(first_time(v, r"rollout rank ready") or 0 for v in logs.values()),
             "step 1 begins": first_time(leader, r"step 1 begins$")}
    metrics = step_rows(run_dir)
    begins = [log_time(x) for x in leader if re.search(r"step \d+ begins$", x)]
    phases = yatt_phases(run_dir)
    gen, train = phases["rollout/rollout"], phases["trainer/train"]
    split = {"generation": gen, "train": train, "other": [s - g - t for s, g, t in zip(
        [m["time/step"] for m in metrics], gen, train)]}
    return {"step_s": [m["time/step"] for m in metrics], "cycle_s": list(np.diff(begins)), "split_s": split,
            "reward_mean": [m["reward/mean"] for m in metrics],
            "response_len_mean": [m["rollout/response_len_mean"] for m in metrics], "wall_s": wall,
            "start_to_step1_s": marks["step 1 begins"] - start,
            "startup_s": {k: v - start for k, v in marks.items() if v}, "phases": phases}


def run_trl(model: str, shape: dict, rows: Path, root: Path, tag: str) -> dict:
    out = root / f"trl-{tag}.json"
    argv = [str(PEER_PYTHON), str(PEERS / "trl_grpo.py"), "--model", model, "--rows", str(rows),
            "--steps", str(shape["steps"]), "--max-completion-length", str(shape["max_new_tokens"]), "--out", str(out)]
    # the glibc settings every yatt-hpc rank makes for itself (runtime/allocator.py), through glibc's own
    # variables: a TRL user can have them too, so the comparison is not of allocator settings
    start = launch(argv, root / f"trl-{tag}.log", env=peer_environment())
    wall = time.time() - start
    data = json.loads(out.read_text())
    marks = {"imports done": data["marks"]["imports_done"], "GRPOTrainer built": data["marks"]["trainer_built"],
             "step 1 begins": data["first_step_begin"]}
    gen, reward = data["phases"]["generate"], data["phases"]["reward"]
    train = [s - g - r for s, g, r in zip(data["step_s"], gen, reward)]
    return {**data, "cycle_s": list(np.diff(data["begins"])), "split_s": {"generation": gen, "train": train, "other": reward},
            "wall_s": wall, "start_to_step1_s": data["first_step_begin"] - start,
            "startup_s": {k: v - start for k, v in marks.items()}}


def curve(runs: list[dict]) -> list[float]:
    """Mean reward per step, averaged over the runs."""
    return [float(x) for x in np.mean([r["reward_mean"] for r in runs], axis=0)]


def blocks(values: list[float], width: int) -> list[str]:
    return [f"{np.mean(values[i:i + width]):.3f}" for i in range(0, len(values), width)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="turns per side and shape")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = ap.parse_args()
    if not PEER_PYTHON.exists():
        sys.exit(f"B9 needs TRL in its own venv, and {PEER_PYTHON.parent.parent} is missing: create it with "
                 "`bash bench/peers/setup.sh` (pinned trl/accelerate/datasets, the CPU torch and transformers of .venv)")
    began = time.perf_counter()
    runs: dict[str, dict[str, list[dict]]] = {s: {"yatt": [], "trl": []} for s in args.shapes}
    meta = {}
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        root = Path(tmp)
        for name in args.shapes:
            shape = SHAPES[name]
            model, digest = (str(REPO / "models/demo/policy"), None) if shape["model"] is None else \
                build_model(root, shape["model"])
            rows = root / f"rows-{name}.json"
            rows.write_text(json.dumps(prompt_rows(shape["steps"])))
            meta[name] = {**shape, "model_path": model if shape["model"] is None else "built (temp dir)",
                          "weights_sha256": digest}
            for i in range(args.repeats):  # the sides take turns so a change in load hits both
                runs[name]["yatt"].append(run_yatt(model, shape, root, f"{name}-{i}"))
                runs[name]["trl"].append(run_trl(model, shape, rows, root, f"{name}-{i}"))
    took = time.perf_counter() - began

    report(args, runs, meta, took)


def steps(runs: list[dict], pick) -> list[float]:
    """`pick(run)` (a per-step list) over steps 2..N of every run."""
    return [x for r in runs for x in pick(r)[1:]]


def cell(s: dict, digits: int = 3, unit: str = "", range_digits: int = 2) -> str:
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{range_digits}f}-{s['max']:.{range_digits}f}]"


def report(args, runs: dict, meta: dict, took: float) -> None:
    sides = (("yatt", "yatt-hpc"), ("trl", "TRL"))
    table, split, startup, rows_out, curves, verdicts, met = [], [], [], [], {}, [], True
    for name in args.shapes:
        y, t = runs[name]["yatt"], runs[name]["trl"]
        # a step: one begin to the next (everything between steps included: our step report and stop
        # agreement, TRL's logging), steps 2..N-1; `inside` is each side's own clock of the step body
        step = {side: spread(steps(runs[name][side], lambda r: r["cycle_s"])) for side, _ in sides}
        inside = {side: spread(steps(runs[name][side], lambda r: r["step_s"])) for side, _ in sides}
        step_ratio = spread([np.median(a["cycle_s"][1:]) / np.median(b["cycle_s"][1:]) for a, b in zip(y, t)])
        start = {side: spread([r["start_to_step1_s"] for r in runs[name][side]]) for side, _ in sides}
        start_ratio = spread([a["start_to_step1_s"] / b["start_to_step1_s"] for a, b in zip(y, t)])
        length = {side: float(np.mean([r["response_len_mean"] for r in runs[name][side]])) for side, _ in sides}
        curves[name] = {"yatt": curve(y), "trl": curve(t)}
        first5 = {side: float(np.mean(c[:5])) for side, c in curves[name].items()}
        last5 = {side: float(np.mean(c[-5:])) for side, c in curves[name].items()}
        met = met and step_ratio["median"] <= STEP_TARGET and start_ratio["median"] <= START_TARGET
        for side, who in sides:
            rs = runs[name][side]
            gen, train, other = (spread(steps(rs, lambda r, k=k: r["split_s"][k])) for k in ("generation", "train", "other"))
            table.append([name, who, cell(step[side]), cell(start[side], 1, range_digits=1), f"{length[side]:.1f}",
                          f"{first5[side]:.2f} -> {last5[side]:.2f}"])
            split.append([name, who, f"{step[side]['median']:.3f}", f"{inside[side]['median']:.3f}", f"{gen['median']:.3f}",
                          f"{train['median']:.3f}", f"{other['median']:.3f}"])
            marks = rs[0]["startup_s"]
            startup.append([name, who, "  ".join(f"{k} {np.median([r['startup_s'].get(k, np.nan) for r in rs]):.1f}"
                                                 for k in marks)])
            rows_out += [row(f"{name}: {who} step wall time, begin to next begin (steps 2..N-1 of every run)",
                             step[side], " s"),
                         row(f"{name}: {who} step body by its own clock (steps 2..N)", inside[side], " s"),
                         row(f"{name}: {who} generation per step", gen, " s"),
                         row(f"{name}: {who} training per step (reference + policy passes, optimizer)", train, " s"),
                         row(f"{name}: {who} process start -> step 1 begins", start[side], " s", 1)]
        table.append([name, "ours / TRL", cell(step_ratio, 2, "x"), cell(start_ratio, 2, "x"), "", ""])
        rows_out += [row(f"{name}: yatt-hpc / TRL step time (paired per turn; target <= {STEP_TARGET})", step_ratio, "x", 2),
                     row(f"{name}: yatt-hpc / TRL start -> step 1 (paired per turn; target <= {START_TARGET})",
                         start_ratio, "x", 2)]
        rows_out += [{"label": f"{name}: {who} mean reward, first 5 -> last 5 steps",
                      "value": f"{first5[side]:.3f} -> {last5[side]:.3f}", "median": last5[side], "min": first5[side],
                      "max": last5[side], "n": len(runs[name][side])} for side, who in sides]
        verdicts.append(f"{name}: step {step_ratio['median']:.2f}x TRL's, start -> step 1 {start_ratio['median']:.2f}x")
        meta[name]["yatt_phase_median_s"] = {k: float(np.median(steps(y, lambda r, k=k: r["phases"].get(k, [0.0]))))
                                             for k in y[0]["phases"]}
    shapes = ", ".join(f"{n}: {SHAPES[n]['steps']} steps, {SHAPES[n]['max_new_tokens']}-token cap" for n in args.shapes)
    print_table(f"B9 yatt-hpc vs TRL {runs[args.shapes[0]]['trl'][0]['versions']['trl']} GRPOTrainer ({shapes}; "
                f"{args.repeats} turns a side). Seconds, median {escape('[min-max]')}: step wall, begin to next "
                "begin (steps 2..N-1), "
                "start -> step 1",
                ["shape", "side", "step", "start", "tokens", "reward 1-5 -> last 5"], table)
    print_table("B9 where a step goes (median seconds; body: each side's own clock of the step, steps 2..N; other = "
                "body - generation - training, per step: yatt-hpc's hand-offs and weight sync, TRL's reward call; "
                "step - body: between steps)",
                ["shape", "side", "step", "body", "generation", "training", "other"], split)
    print_table("B9 start-up marks, seconds after launch (median over turns)", ["shape", "side", "marks"], startup)
    for name in args.shapes:
        width = 5 if SHAPES[name]["steps"] > 10 else 2
        c = curves[name]
        print_table(f"B9 {name}: mean reward per step, {width}-step blocks, mean over turns",
                    ["side"] + [f"{i + 1}-{min(i + width, len(c['yatt']))}".removesuffix(f"-{i + 1}")
                                for i in range(0, len(c["yatt"]), width)],
                    [["yatt-hpc", *blocks(c["yatt"], width)], ["TRL", *blocks(c["trl"], width)]])
    phases = sorted({k for n in args.shapes for k, v in meta[n]["yatt_phase_median_s"].items() if v >= 0.001})
    print_table("B9 yatt-hpc seconds per step in each phase (longest rank, median of steps 2..N)",
                ["group/phase", *args.shapes], [[k, *(f"{meta[n]['yatt_phase_median_s'].get(k, 0.0):.3f}"
                                                       for n in args.shapes)] for k in phases])
    verdict = "; ".join(verdicts) + (f" (targets <= {STEP_TARGET} and <= {START_TARGET}: "
                                     f"{'met' if met else 'NOT met'}); B9 took {took:.0f} s")
    write_report("peer_trl", question="B9 yatt-hpc vs TRL GRPOTrainer on the same machine (step time, start-up)",
                 target=f"step time <= {STEP_TARGET}x TRL's and start -> step 1 <= {START_TARGET}x at both shapes",
                 met=met, verdict=verdict, rows=rows_out,
                 raw={"args": vars(args), "yatt_commit": commit(), "shapes": meta, "curves": curves, "runs": runs,
                      "took_s": took},
                 notes=NOTES)


if __name__ == "__main__":
    main()
