"""BENCHMARKS.md from bench/results/*.json: `bench/run_all.py --render-only` (and `make bench`) write it.

    .venv/bin/python bench/run_all.py --render-only      # rewrite BENCHMARKS.md from the JSON files
    .venv/bin/python bench/render.py --check             # exit 1 if BENCHMARKS.md is stale

The page is a pure function of the JSON files and of `BENCHES` below (no clock, no machine state), so a test
renders it and compares (tests/unit/test_docs.py). Every bench/results/*.json needs one entry in BENCHES;
a file without one stops the render naming it.

Adding a benchmark: have its script write the common report (bench/common.write_report: question, target,
met, verdict, rows [{label, value}], notes, machine, and optional tables [{title, columns, rows}] shown under
the result) as bench/results/<name>.json, and add

    Bench("B10", "ckpt_memory", limits="What bounds the number today, for a reader.")

to BENCHES (`script` defaults to the result name; `run=False` keeps it out of `make bench`, e.g. a GPU-only
one; `adapt` turns a JSON of another shape into the common report).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DOC = REPO / "BENCHMARKS.md"


@dataclass(frozen=True)
class Bench:
    key: str                                 # "B1": the name the summary table and the sections use
    result: str                              # bench/results/<result>.json
    limits: str                              # what limits the figure today (the reader's explanation)
    script: str = ""                         # bench/<script>.py writes the result; default: result
    run: bool = True                         # run by `make bench` (bench/run_all.py); False: run by hand
    adapt: Callable[[dict], dict] | None = None  # a JSON of another shape -> the common report
    figure: str = ""                         # a plot under bench/results/, shown under the section

    @property
    def script_name(self) -> str:
        return self.script or self.result


def _ckpt_stall(data: dict) -> dict:
    """ckpt_stall.py's own format (CPU and --device cuda) -> the common report."""
    rows = []
    for r in data["results"]:
        s = sorted(r["stall_s"])
        value = f"{s[len(s) // 2]:.3f} [{s[0]:.3f}-{s[-1]:.3f}] s (n={len(s)})"
        rows.append({"label": f"{r['mode']} stall per save", "value": value})
    ratio = data["speedup_median"]
    device = "GPU" if data.get("device") == "cuda" else "CPU"
    return {"question": f"training-loop stall per checkpoint on the {device}, {data['bytes'] / 2**30:.2f} GiB state",
            "target": f"async >= {data['target']:.0f}x shorter than sync", "met": ratio >= data["target"], "rows": rows,
            "verdict": f"sync / async median stall {ratio:.1f}x", "notes": "",
            "machine_text": f"{data['cpus']} CPUs, {data['torch_threads']} torch threads, device {data['device']}",
            "took_s": data.get("took_s")}


def _colocate_swap(data: dict) -> dict:
    """colocate_swap.py's format (GPU only) -> the common report."""
    rows = [{"label": f"{r['group']}: {key} {r['freed_bytes'] / 2**30:.2f} GiB", "value": f"{r[key + '_s']:.3f} s "
             f"({r['freed_bytes'] / 2**30 / r[key + '_s']:.0f} GiB/s, median of {r['repeats']})"}
            for r in data["results"] for key in ("release", "resume")]
    rows.append({"label": "one GRPO update (16 x 256 tokens), for scale", "value": f"{data['grpo_update_s']:.2f} s"})
    trainer = data["results"][0]
    swap = sum(r["release_s"] + r["resume_s"] for r in data["results"])
    return {"question": f"full colocation's device-memory swap, {data['params'] / 1e9:.2f} B-parameter {data['dtype']} "
                        f"trainer and its engine", "target": "report", "met": None, "rows": rows, "notes": "",
            "verdict": f"trainer releases {trainer['freed_bytes'] / 2**30:.2f} GiB in {trainer['release_s']:.2f} s; "
                       f"all swaps of a step {swap:.2f} s against a {data['grpo_update_s']:.2f} s update",
            "machine_text": f"{data['gpu']}, torch {data['torch']}", "took_s": None}


BENCHES = [
    Bench("B1", "ckpt_stall", adapt=_ckpt_stall, limits=(
        "The async stall is the host snapshot of the state (a copy into reused staging buffers); the write, fsync "
        "and sha256 run in the background. The snapshot is the part that slows when other processes hold the "
        "cores, while the sync save barely moves, so the ratio is highest on a quiet machine.")),
    Bench("B2", "driver_memory", limits=(
        "Each rank holds its own shard plus the chunks in flight, plus ~43 MiB of interpreter and imports every "
        "rank pays; the driver holds the whole step. Sending a batch whole (colocate) holds the produced shard and "
        "the received one at once, about 2/N of the driver: under 1/6 only from 12 ranks up.")),
    Bench("B2i", "image_pipeline", limits=(
        "A rank's peak is mostly its imports (transformers, pyarrow, numpy) and its own rows' encoded images; "
        "images travel encoded and are decoded where consumed. Decode time falls with ranks until the ranks "
        "outnumber the 2 cores.")),
    Bench("B3", "dp_balance", limits=(
        "GRPO groups are never split: with few groups per rank one long group can exceed total/dp, and no "
        "partition beats the lower-bound row max(largest group, mean)/mean.")),
    Bench("B4", "placement_overlap", limits=(
        "What partial placement can hide is at most the shorter of colocate's rollout and reward phases. What it "
        "still loses, ~0.03 s a step: its rollout decodes on one core where colocate's decodes on two (the sends "
        "from the decode loop are ~12 ms of it), and the judge's last call after the rollout ends (~9 ms). "
        "Chunked streaming (`rollout.streaming: chunks`) pays a long tail once per chunk with the HF engine, whose "
        "chunk is its own call; a continuous-batching engine (SGLang) does not.")),
    Bench("B5", "wire_throughput", limits=(
        "Both ranks share one host (Open MPI shared memory), where per-message costs weigh most: at 0.7 MiB "
        "batches the ~0.1 ms of Python per batch (header, column views) is a large part of the raw transfer, and "
        "fresh receive buffers fault in new pages at 39 MiB (the raw-alloc rows). Over a network the ratio is "
        "expected to be higher; it has not been measured there.")),
    Bench("B6", "demo_run", limits=(
        "Most of the wall time is process start: mpirun, imports (torch, Megatron-Core) and model builds on 4 "
        "ranks sharing 2 cores; the step loop is about half. The reward curve repeats run to run (same seed); "
        "the wall time moves with machine load.")),
    Bench("B7", "preempt_resume", limits=(
        "The restart is process start (mpirun or srun, imports, the Megatron build), not checkpoint loading, and "
        "it scales with how busy the cores are. Slurm's own requeue delay is reported apart: it is the "
        "scheduler's, not ours.")),
    Bench("B8", "rank_scaling", figure="rank_scaling.png", limits=(
        "8 ranks share 2 cores (4x oversubscription), so step wall time includes waiting for a core; CPU time "
        "per rank is the figure to read. What grows with ranks is the balance: every rank runs Karmarkar-Karp "
        "over all ranks' groups and waits in the allgather for the slowest.")),
    Bench("B9", "peer_trl", limits=(
        "Both sides share the 2 cores; yatt-hpc's 4 ranks take them in turn, TRL is one process. The step gain "
        "comes mostly from running each prompt through the trainer once per group (`train.share_prompts`) and "
        "from a decode step of few ops. Start-up is imports and model builds on every rank, and moves most with "
        "machine load. B9 needs TRL's venv (`bash bench/peers/setup.sh`).")),
    Bench("B9r", "peer_trl_real", run=False, limits=(
        "Both sides recompute activations or neither: fp32 without (TRL keeps them too), bf16 with (TRL's "
        "gradient checkpointing). Generation is where we gain: in fp32 the engine's projections run on oneDNN's "
        "matmul, whose output projection (the 151,936 x 896 table) takes 40 ms a decode step here against MKL's "
        "95 (device/cpu_matmul.py), where TRL's generate goes through MKL; in bf16 the engine holds bf16 weights "
        "(1 GB) where TRL's autocast generates from its fp32 weights. Training is within 10% of TRL's with the "
        "host memory in turns: the forward products on oneDNN and the backward's on MKL, the weight gradients "
        "added into `.grad` by the product and the embedding's rows in place, logits only at the positions that "
        "predict a response token; against that, the trainer hands its freed gradients and activations (~3 GB) to "
        "the kernel each step and the engine its weights before each sync, and faulting them in again costs "
        "seconds on this VM even in 2 MiB pages (the kernel compacts memory to find them). "
        "`placement.host_memory: kept` skips the hand-overs, and the trainer then trains faster than TRL's one "
        "micro-batch, but the node holds every rank's working set at once: in fp32 that is still under TRL's "
        "peak, in bf16 it is over (TRL's autocast keeps no bf16 copy of its weights). So each precision meets "
        "both targets with one setting, fp32 kept and bf16 in turns, and the table shows both. The weight sync "
        "(~1 s a step in fp32, 0.5 s in bf16: the whole model between processes; TRL generates with the model it "
        "trains) takes back part of the gain. Both sides run with the same glibc allocator settings, huge pages "
        "included. The GenRM rank decodes with the tokenizers library alone (0.13 GB). One turn a side, steps "
        "2..5 of 6, on a machine whose load moves both sides by 10-35% between runs (the fp32 in-turns ratio "
        "was 0.81-0.83x in earlier runs). Run by hand (~20 min; needs TRL's venv).")),
    Bench("B10", "ckpt_memory", limits=(
        "A save's staging copy is the rank's whole tensor state (fp32 parameters and AdamW moments, ~12 bytes a "
        "parameter) up to checkpoint.staging_mb; past the cap the rest is written before the step goes on, so "
        "the peak grows by the cap and the stall by the write time of what did not fit (here 3.5 GiB in ~9 s "
        "against 0.7 s uncapped, on this machine's disk); the first save also faults its buffers in. The figures are the "
        "process's resident memory: the allocator keeps what a step frees (runtime/allocator.py), so the "
        "resident size at the end is the peak working set, not what is live.")),
    Bench("B11", "long_responses", limits=(
        "Tiny width (64) on CPU, so attention over the 4,000-token responses is most of what a micro-batch holds: "
        "the budget bounds it by the budget's tokens, recomputation drops it from what the backward keeps. The "
        "figures include the trainer process's ~370 MB of torch and Megatron, and they are resident sizes of a heap "
        "on 2 MiB pages (runtime/allocator.py), which at this width holds more than what is live: in a run of the "
        "two alone with 4 KiB pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=0`) full recomputation peaked at 1,921 MB "
        "(2,516 here) and budget+full at 883 MB (771). Train times share 2 busy cores with other work and move by "
        "1.5x between runs; recomputation's second forward and the budget's smaller matmuls cost time, not "
        "measured closely here.")),
    Bench("B12", "memory_at_scale", limits=(
        "The on-paper table counts fp32. The bf16 row is the model an H200 run uses (bf16 weights, fp32 masters and "
        "AdamW): at dp 1 it holds 16.2 bytes a parameter as fp32 does, because its fp32 master gradients are made one "
        "at a time in the step (with dp > 1 they are all held: 8 + 12/dp bytes with the sharded optimizer, "
        "docs/scale.md), and its activations take 0.54x fp32's bytes a token; its update is 1.8x faster than fp32's "
        "here (26 against 48 s; this CPU has AVX-512 BF16 and AMX). What the rows say: sharding divides only the 8 "
        "bytes of AdamW moments; selective recomputation saves little (4.35 against 4.56 MB/token) because the "
        "shared-prompt attention runs SDPA's fused kernel, which keeps no score matrix; full recomputation keeps one "
        "fp32 hidden-wide tensor a layer, after which the logits (two fp32 copies a vocabulary entry) are most of a "
        "token; a token budget holds the peak at the micro-batch's size whatever the step's; of pp 2's stages the "
        "first is the busier (under 1F1B it holds both micro-batches of the update in flight), and the arithmetic "
        "the paper's pipeline rows use gives its peak within 1% (the row under the table). A layer keeps 7 fp32 "
        "hidden-wide tensors a token on every tensor-parallel rank (no sequence parallelism), which is why tp8 "
        "without full recomputation fits 4k-token micro-batches at 32B and none at 72B. The optimizer step adds "
        "0.54 GB (0.27 at tp 2): the clip norm's squares of the fp32 embedding gradient, the widened copy of the "
        "bf16 gradient in bf16; the paper takes its step transient (1.0x the vocabulary table's shard) from the "
        "plain rows. A two-point slope moves by up to ~30% with where the log-prob chunks fall (6 layers at four "
        "lengths: 1.5 to 2.6 MB/token between neighbours), so the calibration takes layer counts' differences at "
        "equal tokens (within 2% between lengths); sharded-dp2 runs short responses to fit two 0.5B ranks in 24 GB. "
        "On paper, assumed and not measured: that a layer's split scales with hidden and intermediate widths, pp 4's "
        "in-flight micro-batches (pp 2's are measured at 0.5B), and a 10% spare for the CUDA context, NCCL and the "
        "allocator; not counted: a reference model (train.kl_coef > 0, 4 bytes a parameter over tp) and the "
        "shared-prompt attention masks (a byte per query-key pair, 1 GB for one 32k-token response).")),
    Bench("B13", "lora_memory", limits=(
        "One update (`--steps 1`, ~10 min for both variants on 2 busy cores): full training's peak is then its "
        "gradients during the backward plus AdamW's moments allocated at the step, not the moments living through "
        "a later backward (B10's two-update run of the same shape peaks at 10.68 GiB). What LoRA keeps is the "
        "frozen float32 base (1.9 GiB), the activations of the update (the same as full training's: the adapters "
        "need every layer's input) and the 152k-vocabulary logits, plus ~370 MB of torch and Megatron; its "
        "optimizer state and checkpoint are 2 x 4.4 M float32 numbers and the adapters.")),
    Bench("B14", "async_overlap", limits=(
        "One rank and one thread per group on a 2-core machine: training and generation overlap only as far as "
        "the two cores are free, and the polled waits of the idle ranks and other work on the machine take from "
        "them; the phases are short (~0.2-0.3 s at 32 prompts x 8 samples of up to 24 tokens), so a step's fixed "
        "costs (the weight sync, the step report) are a large share. The learning rows are the demo's own shape "
        "(dp 2) over 30 steps, 3 seeds each.")),
    Bench("B15", "partial_rollouts", limits=(
        "One rank and one thread per group on a 2-core machine, the HF engine on CPU. The long tail is a random tiny "
        "policy with a tuned end-of-sequence rate (it learns nothing; its lengths are the point); the demo has no "
        "tail, so there partial rollouts only keep the groups completed beyond the step's need. A continued "
        "sample's prefix is prefilled again (the HF engine keeps no cache across waves), and a wave runs on to "
        "the first segment boundary after its k-th group completes.")),
    Bench("B16", "agent_turns", limits=(
        "The loop part's engine is scripted with a fixed cost per call and per sequence (the schedule is measured, "
        "not a model); as_ready makes more, smaller engine calls, so where the fixed cost of a call dominates the "
        "saving shrinks. The runs part is the lookup demo on a 2-core machine shared with other work: its "
        "trajectories make one call and its engine turns take milliseconds, so the step ends with the slowest "
        "trajectory under either schedule and the difference is within the runs' spread.")),
    Bench("G1", "ckpt_stall_cuda", script="ckpt_stall", run=False, adapt=_ckpt_stall, limits=(
        "One H200, lent briefly; run by hand (`bench/ckpt_stall.py --device cuda`). The async stall is the "
        "device-to-pinned-host copy; the write and commit follow in the background.")),
    Bench("G2", "colocate_swap", run=False, adapt=_colocate_swap, limits=(
        "One H200, random Qwen2-0.5B shape in fp32, the transformers engine (SGLang's own release is not measured: "
        "it could not be installed there). The copies run into pinned host buffers allocated at the first release "
        "and reused after, so steady-state swaps allocate no host memory; run by hand (`bench/colocate_swap.py`).")),
]

HEAD = """# Benchmarks

<!-- Generated by `bench/run_all.py --render-only` from bench/results/*.json and bench/render.py; edit those, not this page. -->

Each benchmark answers one question with one script under `bench/`, which writes
`bench/results/<name>.json`; this page is rendered from those files. How to run them, how each is set
up and how to add one: [docs/benchmarks.md](docs/benchmarks.md).

## Method

* **Spread.** Every row is `median [min-max] (n)` over n repeated runs (or steps, where a row says so).
  Ratios are paired: each repeat of the candidate is divided by the baseline of the same repeat, and the
  two take turns, so a change in machine load hits both.
* **Machine.** The CPU benchmarks run on one 2-core VM with 24 GiB of RAM and no GPU, Open MPI over
  shared memory; other work may share it, and each section gives the load average at the end of its run.
  Read the ratios, which carry over, rather than absolute seconds, which move by up to 2x with load.
* **Payloads.** B2 and B8 move synthetic payloads (uint8 images; token ids and logprobs with log-normal
  lengths) without models, so the data plane is what is measured. B4 uses a tiny random policy whose
  end-of-sequence rate gives long-tailed response lengths. B9 runs TRL's GRPOTrainer and yatt-hpc on the
  same task, weights, prompts, reward and GRPO settings. B10 and B12 build Qwen2.5-0.5B's layout with
  random weights from its config.
* **GPU rows** (G1, G2) come from a briefly lent H200 and are run by hand, not by `make bench`.

## Results

| # | question | target | latest | met |
|---|---|---|---|---|"""


def load(bench: Bench) -> dict:
    data = json.loads((RESULTS / f"{bench.result}.json").read_text())
    report = bench.adapt(data) if bench.adapt else dict(data)
    report["question"] = report["question"].removeprefix(f"{bench.key} ")
    return report


def machine_text(report: dict) -> str:
    if "machine_text" in report:
        return report["machine_text"]
    m = report.get("machine") or {}
    load = "/".join(f"{x:g}" for x in m.get("load_avg_at_end", []))
    cpu = f" ({m['cpu']})" if m.get("cpu") else ""  # results written before bench/common.py recorded it have none
    return (f"{m.get('cpus', '?')} CPUs{cpu}, {m.get('mem_mb', 0) / 1024:.0f} GiB RAM, Python {m.get('python', '?')}, "
            f"load average {load} at the end")


def section(bench: Bench, report: dict) -> list[str]:
    took = f"; the script took {report['took_s']:.0f} s" if report.get("took_s") is not None else ""
    lines = ["", f"## {bench.key}: {report['question']}", "",
             f"`bench/{bench.script_name}.py` -> `bench/results/{bench.result}.json`. Machine: {machine_text(report)}{took}.",
             "", "| measurement | median [min-max] (n) |", "|---|---|"]
    lines += [f"| {r['label']} | {r['value']} |" for r in report["rows"]]
    lines += ["", f"**Result.** {report['verdict']}."]
    for table in report.get("tables", []):
        lines += ["", f"**{table['title']}.**", "", "| " + " | ".join(table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
    if report.get("notes"):
        lines += ["", f"**Setup.** {report['notes']}"]
    lines += ["", f"**What limits it.** {bench.limits}"]
    if bench.figure and (RESULTS / bench.figure).exists():
        lines += ["", f"![{bench.key}](bench/results/{bench.figure})"]
    return lines


def render() -> str:
    by_result = {b.result: b for b in BENCHES}
    unknown = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in by_result)
    if unknown:
        raise SystemExit(f"bench/results/{unknown[0]}.json has no entry in bench/render.py BENCHES: add "
                         f"Bench(KEY, {unknown[0]!r}, limits=...) (see its docstring)")
    lines, sections = [HEAD], []
    for bench in BENCHES:
        if not (RESULTS / f"{bench.result}.json").exists():
            lines.append(f"| {bench.key} | `bench/{bench.script_name}.py` | | not run yet | |")
            continue
        report = load(bench)
        met = {True: "yes", False: "**no**", None: "report"}[report["met"]]
        lines.append(f"| [{bench.key}](#{anchor(bench.key, report['question'])}) | {report['question']} | "
                     f"{report['target']} | {report['verdict']} | {met} |")
        sections += section(bench, report)
    return "\n".join(lines + sections) + "\n"


def anchor(key: str, question: str) -> str:
    """GitHub's anchor of the heading `## KEY: question`."""
    text = f"{key}: {question}".lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        if DOC.read_text() != render():
            sys.exit("BENCHMARKS.md is stale: .venv/bin/python bench/run_all.py --render-only")
        return
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
