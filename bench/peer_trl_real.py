"""B9r: yatt-hpc vs TRL's GRPOTrainer at a real size: Qwen2.5-0.5B's shape (24 layers, 494 M parameters, the
151,936-token vocabulary), random weights, GSM8K-like word problems. Step wall time and peak memory, same data.

    .venv/bin/python bench/peer_trl_real.py                     # fp32 and bf16, host memory both ways: ~25 min
    .venv/bin/python bench/peer_trl_real.py --precision bf16 --host-memory in_turns --repeats 2 --steps 5

The workload (bench/real_size.py): the policy is built here with seeded random weights in fp32, with a real HF
fast tokenizer of 151,936 entries; 512 word problems as JSONL. Both sides read the same prompts in the same
order (yatt-hpc's prompt stream, written out for TRL), 2 prompts x 8 samples a step, responses of 64 tokens (a
random policy never ends one early, so every response has the cap's length on both sides), temperature 1,
constant lr 3e-4, clip [0.2, 0.28], the same rule reward (0 for a random policy: the step still does all its
work), and the same KL setting: none (`train.kl_coef: 0`, TRL `beta=0`), so neither side builds a reference
model. TRL is one process, its whole batch in one micro-batch, with the glibc malloc settings our ranks make for
themselves. yatt-hpc runs 3 MPI ranks: one trainer (dp=1), one HF rollout engine, one GenRM rank scoring by
rule, in full colocation with `placement.node_cpus` the machine's cores (each phase runs that many torch
threads), once a turn with each `placement.host_memory` (`in_turns`: the phases hand the memory they freed to
the next one; `kept`: every rank keeps its working set, as TRL's one process does); its trainer passes the
batch in micro-batches of --micro-batch samples (4 by default: half of `train.micro_batch_size`'s default, which
held 1.3 GiB more in fp32 and ran no faster at this shape) through the chunked log-prob path. Two precisions,
each side in its own way, the two recomputing activations or neither:

* fp32: yatt-hpc `model.dtype: float32`, no recomputation; TRL fp32 without gradient checkpointing.
* bf16: yatt-hpc `model.dtype: bfloat16` (bf16 weights for the passes and the engine, fp32 masters and AdamW)
  with full recomputation (`train.recompute: full`); TRL's own defaults, `bf16=True` (fp32 weights, bf16
  autocast, generation included) and gradient checkpointing.

Per run: each step's wall time from its beginning to the next one's (steps 2..N-1: step 1 pays first-call
warm-ups), each side's own clock of the step body and its generation / training split, and peak memory two
ways: the largest sum of the resident sizes of every process of the side, sampled every 0.25 s (what the
machine must hold at once), and each process's own peak (ru_maxrss; summed over yatt-hpc's ranks, an upper
bound). Ratios are paired per turn. Prints rich tables, writes bench/results/peer_trl_real.json.
Targets: yatt-hpc/TRL step time <= 0.8; yatt-hpc's peak memory (sampled sum) <= TRL's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml
from common import PYTHON, REPO, mpi_env, print_table, row, spread, write_report
from peer_trl import PEER_PYTHON, PEERS, commit, log_time, yatt_phases
from real_size import build_policy, write_problems

from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.runtime.allocator import peer_environment

STEP_TARGET, MEMORY_TARGET = 0.8, 1.0
GENERATIONS = 8
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # yatt-hpc's model.dtype for each precision
RECOMPUTE = {"fp32": "none", "bf16": "full"}  # as TRL's side: fp32 without gradient checkpointing, bf16 with it
HOST_MEMORY = {"in_turns": "in turns", "kept": "kept"}  # yatt-hpc's placement.host_memory, as the tables say it


class TreeMemory:
    """The largest sum of resident sizes over a process and its descendants, sampled every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.25):
        self.root, self.every, self.peak, self._done = psutil.Process(pid), every, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self.every):
            total = 0
            try:
                for p in [self.root, *self.root.children(recursive=True)]:
                    total += p.memory_info().rss
            except psutil.Error:  # a process ended between listing and reading: the next sample counts
                continue
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak / 2**20


def launch(argv: list[str], log: Path, env: dict, rank_logs: Path | None = None) -> tuple[float, float]:
    """Run argv (output in `log`, shown if it fails, with the end of each log in `rank_logs`: the run's
    directory goes with the bench's); returns (start time, peak summed resident MiB)."""
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        memory = TreeMemory(proc.pid)
        code = proc.wait(timeout=3600)
        peak = memory.stop()
    if code:
        ends = [f"--- {f.name}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-20:])
                for f in sorted(rank_logs.glob("*.log"))] if rank_logs is not None and rank_logs.is_dir() else []
        sys.exit("\n".join([f"{' '.join(argv[:3])} ... failed (exit {code}); its output ends:",
                             *log.read_text().splitlines()[-30:], *ends]))
    return start, peak


def yatt_config(model: str, problems: Path, args, precision: str, host_memory: str) -> dict:
    return {"model": {"path": model, "dtype": DTYPES[precision]},
            "data": {"source": str(problems), "seed": 1234, "max_prompt_tokens": 128},
            "train": {"steps": args.steps, "seed": 0, "prompts_per_step": args.prompts, "micro_batch_size": args.micro_batch,
                      "lr": 3.0e-4, "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0,
                      "recompute": RECOMPUTE[precision]},
            "rollout": {"engine": "hf", "samples_per_prompt": GENERATIONS, "max_new_tokens": args.max_new_tokens,
                        "temperature": 1.0},
            "reward": {"mode": "rule_only"},
            # colocated phases take the machine's cores in turn (without node_cpus each would run one thread)
            "placement": {"mode": "colocate", "node_cpus": os.cpu_count(), "host_memory": host_memory,
                          "trainer": {"nodes": 1, "tasks_per_node": 1, "tp": 1, "dp": 1},
                          "rollout": {"nodes": 1, "tasks_per_node": 1}, "genrm": {"nodes": 1, "tasks_per_node": 1}},
            # the run's one save, at its end, writes from the live state (no staging copy): TRL saves nothing
            "checkpoint": {"interval": 0, "staging_mb": 0}, "logging": {"trackers": [], "progress": False}}


def run_yatt(config: Path, root: Path, tag: str) -> dict:
    run_dir = root / f"yatt-{tag}"
    argv = [str(Path(PYTHON).parent / "yatt-hpc"), "run", str(config), "--run-dir", str(run_dir)]
    start, peak = launch(argv, root / f"yatt-{tag}.log", mpi_env(), rank_logs=run_dir / "logs")
    leader = (run_dir / "logs" / "rank-0000-trainer.log").read_text().splitlines()
    begins = [log_time(x) for x in leader if re.search(r"step \d+ begins$", x)]
    metrics = step_rows(run_dir)
    phases = yatt_phases(run_dir)
    last = metrics[-1]
    rank_peaks = {k.rsplit("/", 1)[1]: v for k, v in last.items() if k.startswith("memory/peak_rss_mb/")}
    return {"cycle_s": list(np.diff(begins)), "step_s": [m["time/step"] for m in metrics],
            "split_s": {"generation": phases["rollout/rollout"], "train": phases["trainer/train"],
                        "weight_sync": [m.get("time/weight_sync", 0.0) for m in metrics]},
            "response_len_mean": [m["rollout/response_len_mean"] for m in metrics], "peak_sum_mb": peak,
            "rank_peak_mb": rank_peaks, "wall_s": time.time() - start}


def run_trl(model: str, rows: Path, root: Path, tag: str, args, precision: str) -> dict:
    out = root / f"trl-{tag}.json"
    argv = [str(PEER_PYTHON), str(PEERS / "trl_grpo.py"), "--model", model, "--tokenizer", model, "--rows", str(rows),
            "--steps", str(args.steps), "--max-completion-length", str(args.max_new_tokens),
            "--batch-size", str(args.prompts * GENERATIONS), "--beta", "0", "--out", str(out)]
    argv += ["--bf16"] if precision == "bf16" else []
    start, peak = launch(argv, root / f"trl-{tag}.log", peer_environment())
    data = json.loads(out.read_text())
    gen = data["phases"]["generate"]
    return {"cycle_s": list(np.diff(data["begins"])), "step_s": data["step_s"],
            "split_s": {"generation": gen, "train": [s - g - r for s, g, r in
                                                     zip(data["step_s"], gen, data["phases"]["reward"])]},
            "response_len_mean": data["response_len_mean"], "peak_sum_mb": peak,
            "rank_peak_mb": {"trl": data["peak_rss_mb"]}, "versions": data["versions"],
            "torch_threads": data["torch_threads"], "wall_s": time.time() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="turns per side")
    ap.add_argument("--steps", type=int, default=6, help="steps a run (steps 2..N-1 are measured)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts a step (x 8 samples)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4, help="yatt-hpc's samples a micro-batch (train.micro_batch_size)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--precision", choices=[*DTYPES, "both"], default="both")
    ap.add_argument("--host-memory", choices=[*HOST_MEMORY, "both"], default="both",
                    help="yatt-hpc's placement.host_memory (both: a yatt-hpc run of each against one TRL run)")
    args = ap.parse_args()
    if not PEER_PYTHON.exists():
        sys.exit(f"B9r needs TRL in its own venv, and {PEER_PYTHON.parent.parent} is missing: create it with "
                 "`bash bench/peers/setup.sh`")
    began = time.perf_counter()
    precisions = list(DTYPES) if args.precision == "both" else [args.precision]
    memories = list(HOST_MEMORY) if args.host_memory == "both" else [args.host_memory]
    runs = {p: {"trl": [], **{m: [] for m in memories}} for p in precisions}
    with tempfile.TemporaryDirectory(prefix="peer_trl_real_") as tmp:
        root = Path(tmp)
        model = build_policy(root / "policy", layers=args.layers)
        problems = root / "problems.jsonl"
        write_problems(problems, 512)
        configs = {(p, m): root / f"real-{p}-{m}.yaml" for p in precisions for m in memories}
        for (p, m), config in configs.items():
            config.write_text(yaml.safe_dump(yatt_config(model, problems, args, p, m)))
        rows = root / "rows.json"
        rows.write_text(json.dumps(prompt_rows(next(iter(configs.values())), args.steps * args.prompts)))
        for i in range(args.repeats):  # the sides take turns so a change in load hits both
            for p in precisions:
                for m in memories:
                    runs[p][m].append(run_yatt(configs[p, m], root, f"{p}-{m}-{i}"))
                runs[p]["trl"].append(run_trl(model, rows, root, f"{p}-{i}", args, p))
    report(args, runs, time.perf_counter() - began)


def prompt_rows(config: Path, count: int) -> list[dict]:
    """The prompts yatt-hpc's trainer reads, in its order."""
    from yatt_hpc.config import load_config
    from yatt_hpc.data.prompts import build_prompt_source

    stream = build_prompt_source(load_config(config).data)
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in stream.rows_at(0, count)]


def pooled(runs: list[dict], pick) -> list[float]:
    """`pick(run)` (a per-step list) over steps 2..N of every run."""
    return [x for r in runs for x in pick(r)[1:]]


def report(args, runs: dict, took: float) -> None:
    table, rows_out, results = [], [], {}
    for precision, by_side in runs.items():
        trl = by_side["trl"]
        sides = [(m, f"{precision} yatt-hpc, host memory {HOST_MEMORY[m]}") for m in HOST_MEMORY if m in by_side]
        for side, label in [*sides, ("trl", f"{precision} TRL")]:
            rs = by_side[side]
            cycle, body = spread(pooled(rs, lambda r: r["cycle_s"])), spread(pooled(rs, lambda r: r["step_s"]))
            gen = spread(pooled(rs, lambda r: r["split_s"]["generation"]))
            train = spread(pooled(rs, lambda r: r["split_s"]["train"]))
            peak = spread([r["peak_sum_mb"] / 1024 for r in rs])
            procs = "  ".join(f"{k} {np.median([r['rank_peak_mb'][k] for r in rs]) / 1024:.1f}"
                              for k in rs[0]["rank_peak_mb"])
            table.append([label, f"{cycle['median']:.1f}", f"{body['median']:.1f}", f"{gen['median']:.1f}",
                          f"{train['median']:.1f}", f"{peak['median']:.2f}", procs])
            rows_out += [row(f"{label} step wall time, begin to next begin (steps 2..N-1)", cycle, " s", 1),
                         row(f"{label} step body by its own clock (steps 2..N)", body, " s", 1),
                         row(f"{label} generation per step", gen, " s", 1),
                         row(f"{label} training per step (policy passes, optimizer)", train, " s", 1),
                         row(f"{label} peak memory, all its processes at once (sampled)", peak, " GiB", 2),
                         {"label": f"{label} each process's own peak (ru_maxrss), GiB", "value": procs}]
        for side, label in sides:  # each yatt-hpc run against the TRL run of its turn
            y = by_side[side]
            step_ratio = spread([np.median(a["cycle_s"][1:]) / np.median(b["cycle_s"][1:]) for a, b in zip(y, trl)])
            memory_ratio = spread([a["peak_sum_mb"] / b["peak_sum_mb"] for a, b in zip(y, trl)])
            table.append([f"{precision} ours ({HOST_MEMORY[side]}) / TRL", f"{step_ratio['median']:.2f}x", "", "", "",
                          f"{memory_ratio['median']:.2f}x", ""])
            rows_out += [row(f"{label} / TRL step time (paired per turn; target <= {STEP_TARGET})", step_ratio, "x", 2),
                         row(f"{label} / TRL peak memory (paired per turn; target <= {MEMORY_TARGET})",
                             memory_ratio, "x", 2)]
            results[precision, side] = (step_ratio["median"], memory_ratio["median"])
    t0 = next(iter(runs.values()))["trl"][0]
    title = (f"B9r yatt-hpc vs TRL {t0['versions']['trl']} at Qwen2.5-0.5B's shape ({args.layers} layers), "
             f"{args.prompts}x{GENERATIONS} samples, {args.max_new_tokens}-token responses, no KL; {args.steps} steps, "
             f"{args.repeats} turn(s) a side. Seconds (median, steps 2..N-1), memory GiB")
    columns = ["precision, side", "step", "body", "generation", "training", "peak (sum)", "per-process peaks"]
    print_table(title, columns, table)
    met_by = {key: step <= STEP_TARGET and memory <= MEMORY_TARGET for key, (step, memory) in results.items()}
    met_at = {p: any(met for (q, _), met in met_by.items() if q == p) for p in runs}  # one setting meets both
    verdict = "; ".join(f"{p} with host memory {HOST_MEMORY[m]}: step {step:.2f}x TRL's, peak memory {memory:.2f}x "
                        f"({'met' if met_by[p, m] else 'NOT met'})" for (p, m), (step, memory) in results.items())
    verdict += (f" (targets <= {STEP_TARGET} and <= {MEMORY_TARGET}, both by one setting; met in "
                f"{', '.join(p for p, met in met_at.items() if met) or 'neither precision'}); B9r took {took:.0f} s")
    notes = ("Same machine, the sides taking turns; yatt-hpc's 3 ranks (trainer, rollout engine, GenRM scoring by "
             "rule) share the 2 cores, TRL is one process with torch's default threads. Random weights: every "
             f"response runs to the {args.max_new_tokens}-token cap on both sides and the reward is 0 (the step still "
             "does all its work). Neither side builds a reference model (no KL). yatt-hpc's trainer: micro-batches of "
             f"{args.micro_batch} samples, in fp32 without recomputation or with `model.dtype: bfloat16` and full "
             "recomputation; TRL: the whole batch in one micro-batch, fp32 without gradient checkpointing, or its "
             "defaults (bf16 autocast over fp32 weights, gradient checkpointing). yatt-hpc runs once a turn with each "
             "`placement.host_memory` asked for: in turns (the default) its phases hand what they freed to the "
             "kernel (the trainer's gradients and activations, the engine's weights before each sync) and fault it "
             "in again the next step; kept, every rank keeps its working set, as TRL's one process does.")
    write_report("peer_trl_real", question="B9r yatt-hpc vs TRL GRPOTrainer at Qwen2.5-0.5B's shape (step time, peak memory)",
                 target=f"step time <= {STEP_TARGET}x TRL's; peak memory <= TRL's, same KL setting", met=all(met_at.values()),
                 verdict=verdict, rows=rows_out, notes=notes,
                 tables=[{"title": "Where a step goes and what each side holds", "columns": columns, "rows": table}],
                 raw={"args": vars(args), "yatt_commit": commit(), "runs": runs, "took_s": took})


if __name__ == "__main__":
    main()
