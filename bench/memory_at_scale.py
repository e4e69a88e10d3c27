"""B12: a trainer rank's peak memory at a real size, split into bytes per parameter and bytes per token, and
what that puts on an H200 for 7B, 32B and 72B models.

    .venv/bin/python bench/memory_at_scale.py                       # every layout, ~45 min on 2 busy cores
    .venv/bin/python bench/memory_at_scale.py --only plain full     # some layouts; the rest keep their last JSON
    .venv/bin/python bench/memory_at_scale.py --paper-only          # the tables again from the last JSON

Each layout (`LAYOUTS`, one entry per row) runs at two response lengths, each time in fresh processes
(`mpirun -np tp x dp`, up to 13 GB a rank): every rank builds a Megatron policy of Qwen2.5-0.5B's layout
(`QWEN05`: 24 layers, hidden 896, 14 heads over 2 key/value groups, MLP 4864, vocabulary 151,936, tied
embeddings; random weights from the config, float32, no model hub), runs one short `MegatronPolicy.update`
(AdamW's moments exist after it) and then the measured one: the trainer's update (shared-prompt forward,
chunked log-probs, AdamW, the DP all-reduce, `train/step_plan.py`'s plan over the data-parallel ranks) on one
prompt of 64 tokens and `samples` responses of the given length, in micro-batches of 2 responses (or of the
layout's token budget). What a rank reports, from Linux's peak resident size (VmHWM, restarted at each phase
through /proc/self/clear_refs), all minus its resident size before the model existed:

* activations: the peak of a micro-batch's forward and backward over what the rank held when it started,
  from the second micro-batch on (the gradients exist by then: this is activations alone);
* held: what the rank holds when the optimizer step starts (weights, gradients, AdamW moments);
* optimizer: the peak of the optimizer step (held plus its temporaries).

glibc is told to map every block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_) so that resident memory
follows what is live; a trainer rank keeps freed memory for the next step (`runtime/allocator.py`), so its
resident size stays at its largest phase.

Per layout: bytes per token of activations (the slope between the two lengths over the micro-batch's forward
tokens; it moves by up to ~30% with where the log-prob chunks and the gradients' transients fall) and bytes
per parameter the rank holds. The calibration layouts feed `paper_memory` (`calibrate`): `plain` and
`sharded-dp2` split the state into what sharding divides (AdamW moments) and what it does not (weights,
gradients); each of `plain`, `tp2` and `full` against the same layout with 6 layers, at equal tokens, gives one
layer's activations per token without the logits' part (`per_layer`); `tp2` against `plain` splits a layer
into what tensor parallelism divides and what every rank keeps (there is no sequence parallelism); `plain`'s
slope less its layers is the logits' part. `paper_memory` turns them into GB on the busiest H200 for
Qwen2.5-7B, 32B and 72B (`PAPER_MODELS`) at 4k, 16k and 32k tokens a micro-batch: arithmetic, not measured,
the pipeline rows (pp2, pp4) most of all. The measured `pp2` layout (two stages of 12 layers, each with a
vocabulary table: the embedding on the first, the tied output layer's copy on the last) runs Megatron's 1F1B
schedule, so its first stage holds both micro-batches of the update in flight; its row reports the busier
stage, and the same arithmetic for it at its own tokens is printed beside it (`paper_check`).

Prints both tables and writes bench/results/memory_at_scale.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_on_paper import (
    GB,
    MB,
    PAPER_COLUMNS,
    QWEN05,
    Calibration,
    PaperLayout,
    headline,
    paper_cells,
    paper_memory,
    paper_table,
)

PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Layout:
    """One measured row: a trainer layout and the batch each of its ranks updates on."""

    name: str
    what: str                                        # the table's description
    train: dict = field(default_factory=dict)        # TrainConfig fields
    tp: int = 1
    dp: int = 1
    pp: int = 1                                      # pipeline stages: the row reports the busier stage's rank
    layers: int = QWEN05.layers
    samples: int = 4                                 # responses of the rank's one prompt
    lengths: tuple[int, int] = (240, 480)            # response tokens at the two points
    budget_responses: int = 0                        # > 0: max_tokens_per_micro_batch = prompt + this many responses
    dtype: str = "float32"                           # model.dtype: bfloat16 keeps fp32 masters and AdamW

    @property
    def ranks(self) -> int:
        return self.tp * self.dp * self.pp

    def train_fields(self, length: int) -> dict:
        budget = {"max_tokens_per_micro_batch": PROMPT_TOKENS + self.budget_responses * length} \
            if self.budget_responses else {}
        return {"lr": 1e-6, "micro_batch_size": 2, **self.train, **budget}


LAYOUTS = [
    Layout("plain", "fp32 weights and AdamW, dp 1"),
    Layout("sharded-dp2", "train.shard_optimizer over dp 2 (rank 0)", {"shard_optimizer": True}, dp=2,
           lengths=(32, 64)),  # two 0.5B ranks at once on this machine: short responses
    Layout("selective", "train.recompute: selective", {"recompute": "selective"}),
    Layout("full", "train.recompute: full (1 layer a chunk)", {"recompute": "full"}),
    Layout("bf16", "model.dtype: bfloat16 (bf16 weights and gradients, fp32 masters and AdamW; not in the paper "
           "table)", dtype="bfloat16"),
    Layout("pp2", "pipeline parallel 2, 1F1B (the busier stage: 12 layers and a vocabulary table each)", pp=2),
    Layout("budget", "responses 2x as long, train.max_tokens_per_micro_batch: one of them", lengths=(480, 960),
           budget_responses=1),
    # calibration: the same layouts with fewer layers. tp 2 at 12 layers keeps two ranks small; its log-prob chunks
    # hold twice the positions, so both of its points are above one chunk
    Layout("6-layers", "plain with 6 of the 24 layers (calibration)", layers=6),
    Layout("full-6-layers", "full with 6 layers (calibration)", {"recompute": "full"}, layers=6),
    Layout("tp2", "tensor parallel 2, 12 layers (rank 0; calibration)", tp=2, layers=12, lengths=(440, 960)),
    Layout("tp2-6-layers", "tensor parallel 2, 6 layers (rank 0; calibration)", tp=2, layers=6, lengths=(440, 960)),
]


# ---------------------------------------------------------------------------------------------- one rank

def vm_hwm() -> int:
    """This process's peak resident bytes since the last `reset_hwm`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident size starts again from now


def one_batch(dp_rank: int, samples: int, length: int):
    import numpy as np

    from yatt_hpc.batch import SampleBatch

    rng = np.random.default_rng(dp_rank)
    prompt = rng.integers(3, 32000, PROMPT_TOKENS)
    batch = SampleBatch(
        sample_id=np.arange(samples, dtype=np.int64) + dp_rank * samples,
        prompt_id=np.full(samples, dp_rank, np.int64),
        prompt_len=np.full(samples, PROMPT_TOKENS, np.int32),
        prompt_tokens=np.tile(prompt, samples).astype(np.int32),
        response_len=np.full(samples, length, np.int32),
        response_tokens=rng.integers(3, 32000, samples * length).astype(np.int32),
        logprobs=rng.uniform(-12, -10, samples * length).astype(np.float32))
    return batch, rng.standard_normal(samples).astype(np.float32)


def measure_rank(layout: Layout, length: int) -> dict:
    """Runs on every rank of the layout's MPI world; returns this rank's measurements (bytes over its baseline)."""
    import socket
    import time

    import numpy as np
    import torch
    from mpi4py import MPI
    from transformers import Qwen2Config

    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.policy import MegatronPolicy
    from yatt_hpc.train.step_plan import plan_update

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(max(1, 2 // comm.Get_size()))
    port = None
    if rank == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    mm.initialize_model_parallel(rank, comm.Get_size(), "127.0.0.1", comm.bcast(port), tp_size=layout.tp,
                                 pp_size=layout.pp, seed=0)
    # Megatron's order is tp-cp-dp-pp: a tensor-parallel group's ranks next to each other, the stages outermost
    dp_rank, pp_rank = (rank // layout.tp) % layout.dp, rank // (layout.tp * layout.dp)
    dp_comm = comm.Split(rank % layout.tp + layout.tp * pp_rank, dp_rank)
    cfg = TrainConfig(**layout.train_fields(length))
    s = QWEN05
    config = Qwen2Config(hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=layout.layers,
                         num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=s.vocab,
                         max_position_embeddings=4096, tie_word_embeddings=s.tied)

    def reduce(values):
        out = np.empty_like(values, dtype=np.float64)
        dp_comm.Allreduce(np.ascontiguousarray(values, np.float64), out, op=MPI.SUM)
        return out

    def gather(items):
        return [x for part in dp_comm.allgather(items) for x in part]

    warm, warm_adv = one_batch(dp_rank, layout.samples, 8)
    batch, adv = one_batch(dp_rank, layout.samples, length)
    warm_plan = plan_update(warm, cfg, 8, gather=gather, reduce=reduce)
    plan = plan_update(batch, cfg, length, gather=gather, reduce=reduce)
    comm.Barrier()
    base = resident()  # the process, torch, Megatron and the process groups: everything but the model
    model = mm.build_gpt_model(config, layout.tp, params_dtype=getattr(torch, layout.dtype),
                               recompute=mm.Recompute.of(cfg))
    policy = MegatronPolicy(model, config, cfg, share_prompts=cfg.share_prompts)
    built = resident()
    phases = {"micro": [], "activations": [], "held": [], "optimizer": []}
    micro_step, optimizer_step = policy._micro_step, policy._optimizer_step

    def measured_micro_step(*args):  # marks the phases; the steps themselves are the policy's own
        entry = resident()
        reset_hwm()
        stats = micro_step(*args)
        peak = vm_hwm()
        phases["micro"].append(peak)
        phases["activations"].append(peak - entry)
        return stats

    def measured_optimizer_step() -> float:
        phases["held"].append(resident())
        reset_hwm()
        norm = optimizer_step()
        phases["optimizer"].append(vm_hwm())
        return norm

    policy._micro_step, policy._optimizer_step = measured_micro_step, measured_optimizer_step
    if layout.pp > 1:  # the 1F1B schedule runs every micro-batch of the update in one call: that call is measured,
        run = policy.pipeline.run  # and the gradients stay allocated between updates (zeroed in place, the values
        # the same), so that from the second update on its peak over its entry is the activations in flight alone

        def measured_run(*args, **kwargs):
            entry = resident()
            reset_hwm()
            out = run(*args, **kwargs)
            peak = vm_hwm()
            phases["micro"].append(peak)
            phases["activations"].append(peak - entry)
            return out

        def zero_in_place() -> None:
            for p in policy.named_params.values():
                if p.grad is not None:
                    p.grad.zero_()

        policy.pipeline.run, policy._zero_grads = measured_run, zero_in_place
    policy.update(warm, warm_adv, warm_plan)  # a short update first: AdamW's moments exist from here on
    marks = {k: len(v) for k, v in phases.items()}
    start = time.perf_counter()
    stats = policy.update(batch, adv, plan)
    seconds = time.perf_counter() - start
    measured = {k: v[marks[k]:] for k, v in phases.items()}
    # the first micro-batch creates the gradients; from the second on they are there before it starts (pipeline
    # stages: they are there before the measured update's schedule starts)
    activations = measured["activations"] if layout.pp > 1 else measured["activations"][1:]
    out = {"rank": rank, "pp_rank": pp_rank, "base": base, "built": built - base,
           "activations": max(activations), "micro_peak": max(measured["micro"]) - base,
           "held": max(measured["held"]) - base, "optimizer": max(measured["optimizer"]) - base,
           "micro_batches": len(measured["micro"]), "params": sum(p.numel() for p in model.parameters()),
           "largest_tensor": max(p.numel() * p.element_size() for p in model.parameters()),
           "micro_batch_tokens": int(stats.micro_batch_tokens_max),
           "step_tokens": int(PROMPT_TOKENS + layout.samples * (length - 1)), "update_s": seconds}
    mm.destroy_model_parallel()
    return out


# ---------------------------------------------------------------------------------------------- the figures

def slope(points: dict, key: str = "activations") -> float:
    """Bytes per micro-batch token between a layout's two lengths (rank 0)."""
    (a, b) = sorted(points.values(), key=lambda r: r["micro_batch_tokens"])
    return (b[key] - a[key]) / (b["micro_batch_tokens"] - a["micro_batch_tokens"])


def held_per_param(points: dict) -> float:
    """Bytes per parameter the rank holds between updates (weights, gradients, moments), over its lengths."""
    return sum(r["held"] / r["params"] for r in points.values()) / len(points)


def per_layer(results: dict, deep: str, shallow: str) -> float:
    """Activation bytes per token of one layer: layouts `deep` and `shallow` differ only in their layer count and
    run at the same lengths, so at equal tokens their difference is layers alone (the logits' part, its chunk
    boundaries and the gradients' transients cancel); the mean over the lengths."""
    layers = LAYOUT[deep].layers - LAYOUT[shallow].layers
    pairs = [(results[deep][n], results[shallow][n]) for n in results[deep]]
    return sum((a["activations"] - b["activations"]) / (layers * a["micro_batch_tokens"]) for a, b in pairs) / len(pairs)


def calibrate(results: dict) -> Calibration:
    """The measured `results` ({layout: {length: rank 0's measurements}}) of the calibration layouts (`plain`,
    `6-layers`, `sharded-dp2`, `tp2`, `tp2-6-layers`, `full`, `full-6-layers`), solved for the `Calibration`."""
    s = QWEN05
    plain, sharded = held_per_param(results["plain"]), held_per_param(results["sharded-dp2"])
    optimizer = 2 * (plain - sharded)  # dp 2 holds half the moments: plain - sharded = optimizer / 2
    transient = sum((r["optimizer"] - r["held"]) / r["largest_tensor"] for r in results["plain"].values()) / 2
    layer = per_layer(results, "plain", "6-layers")
    vocab = slope(results["plain"]) - s.layers * layer  # the rest of what grows with the tokens
    # tp 2 halves a layer's split part, not its replicated part: layer_tp2 = replicated + split / 2
    split = 2 * (layer - per_layer(results, "tp2", "tp2-6-layers"))
    return Calibration(unsharded_per_param=plain - optimizer, optimizer_per_param=optimizer,
                       step_transient=transient, replicated_per_hidden=(layer - split) / s.hidden,
                       split_per_width=split / s.split_width,
                       full_kept_per_hidden=per_layer(results, "full", "full-6-layers") / s.hidden,
                       vocab_per_entry=vocab / s.vocab)


def paper_check(points: dict, cal: Calibration) -> str:
    """The measured pipeline layout's busier stage beside what `paper_memory` gives for it (Qwen2.5-0.5B, pp 2)."""
    out = []
    for r in sorted(points.values(), key=lambda r: r["micro_batch_tokens"]):
        paper = paper_memory(QWEN05, PaperLayout("pp2", 1, 1, pp=2), cal, r["micro_batch_tokens"])
        out.append(f"{r['micro_batch_tokens']:,} tokens: measured {peak_of(r) / GB:.2f} GB, on paper "
                   f"{paper['total'] / GB:.2f} GB (state {r['held'] / GB:.2f} against {paper['state'] / GB:.2f})")
    return "; ".join(out)


LAYOUT = {x.name: x for x in LAYOUTS}


# ---------------------------------------------------------------------------------------------- the run

def run_layout(layout: Layout, length: int) -> list[dict]:
    """Every rank's measurements of one layout at one length, each rank a fresh process."""
    import tempfile

    from common import mpi_env, mpirun_argv

    env = mpi_env() | {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}  # resident memory follows what is live
    with tempfile.TemporaryDirectory(prefix="memory_at_scale_") as out:
        proc = subprocess.run(mpirun_argv(layout.ranks, Path(__file__), "--child", layout.name, "--length",
                                          str(length), "--out", out), env=env, capture_output=True, text=True,
                              timeout=1800)
        found = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank-*.json"))]
    if proc.returncode or len(found) != layout.ranks:
        raise SystemExit(f"{layout.name} at {length} tokens failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return sorted(found, key=lambda r: r["rank"])


def measured_rows(results: dict) -> tuple[list[dict], list[list[str]]]:
    """The report's rows and the printed table's, one per measured layout (rank 0)."""
    rows, table = [], []
    for layout in LAYOUTS:
        if layout.name not in results:
            continue
        points = results[layout.name]
        big = max(points.values(), key=lambda r: r["micro_batch_tokens"])
        peak = peak_of(big)
        tokens = " / ".join(f"{r['micro_batch_tokens']:,}" for r in sorted(points.values(),
                                                                           key=lambda r: r["micro_batch_tokens"]))
        per_param, per_token = held_per_param(points), f"{slope(points) / MB:.2f}"
        if min(r["micro_batch_tokens"] for r in points.values()) < chunk_rows(layout.tp):
            per_token = "- (under one log-prob chunk)"  # the chunk's scratch still grows with the tokens there
        extra = (big["optimizer"] - big["held"]) / GB
        steps = f" of {big['step_tokens']:,} in the step" if big["step_tokens"] != big["micro_batch_tokens"] else ""
        value = (f"peak {peak / GB:.2f} GB at {big['micro_batch_tokens']:,} tokens a micro-batch{steps}; "
                 f"state {per_param:.2f} B/param (+{extra:.2f} GB in the optimizer step); "
                 f"activations {per_token} MB/token; update {big['update_s']:.0f} s")
        rows.append({"label": f"{layout.name}: {layout.what}", "value": value})
        table.append([layout.name, f"{big['params'] / 1e6:.0f}", tokens + steps, f"{peak / GB:.2f}",
                      f"{per_param:.2f}", f"{extra:.2f}", per_token, f"{big['update_s']:.0f}"])
    return rows, table


def peak_of(r: dict) -> int:
    """A rank's peak over its model-less baseline: the update's forward and backward, or its optimizer step."""
    return max(r["micro_peak"], r["optimizer"])


def chunk_rows(tp: int) -> int:
    """Positions in one chunk of the log-probabilities' fp32 scratch (`train/logprobs.py`) at tensor parallel `tp`."""
    from yatt_hpc.train.logprobs import CHUNK_BYTES

    return CHUNK_BYTES // (4 * QWEN05.vocab // tp)


MEASURED_COLUMNS = ["layout", "params on the rank (M)", "micro-batch tokens", "peak GB", "state B/param",
                    "optimizer step + GB", "activations MB/token", "update s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=[x.name for x in LAYOUTS], help="layouts to run; the others keep "
                    "their last measurements (bench/results/memory_at_scale.json)")
    ap.add_argument("--paper-only", action="store_true", help="the tables from the last measurements, nothing run")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one rank of a layout's MPI world
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)  # the child's folder for rank-<r>.json
    args = ap.parse_args()
    if args.child:
        found = measure_rank(LAYOUT[args.child], args.length)
        (Path(args.out) / f"rank-{found['rank']}.json").write_text(json.dumps(found))
        return

    from common import RESULTS, print_table, write_report

    path = RESULTS / "memory_at_scale.json"
    old = json.loads(path.read_text())["raw"] if path.exists() else {"results": {}, "ranks": {}}
    results, ranks = old["results"], old["ranks"]
    for layout in [] if args.paper_only else [LAYOUT[n] for n in args.only or LAYOUT]:
        results[layout.name], ranks[layout.name] = {}, {}  # a layout's two points come from one run
        for length in layout.lengths:
            found = run_layout(layout, length)
            # rank 0 (tensor and data parallel ranks hold the same); of pipeline stages, the busier one
            results.setdefault(layout.name, {})[str(length)] = max(found[::layout.tp * layout.dp], key=peak_of)
            ranks.setdefault(layout.name, {})[str(length)] = found
            print(f"{layout.name} at {length}: {json.dumps(found[0])}", flush=True)
    rows, table = measured_rows(results)
    print_table("B12 measured: one trainer rank, Qwen2.5-0.5B layout, fp32 but bf16, CPU (GB = 1e9 bytes)", MEASURED_COLUMNS,
                table)
    needed = {"plain", "sharded-dp2", "tp2", "tp2-6-layers", "6-layers", "full", "full-6-layers"}
    raw = {"results": results, "ranks": ranks, "layouts": [asdict(x) for x in LAYOUTS]}
    question = ("B12 trainer memory at scale: one trainer rank of a Qwen2.5-0.5B-shaped model on CPU, per parameter "
                "and per token, and what that puts on an H200 for 7B, 32B and 72B")
    tables = []  # the measured rows are the report's own
    if not needed <= set(results):
        write_report("memory_at_scale", question=question, target="report", met=None, rows=rows, tables=tables,
                     raw=raw, verdict=f"incomplete: the on-paper table needs {', '.join(sorted(needed - set(results)))}")
        return
    cal = calibrate(results)
    paper = paper_table(cal)
    if "pp2" in results:
        rows.append({"label": "pp2 against the arithmetic", "value": paper_check(results["pp2"], cal)})
    print_table("B12 on paper: the busiest GPU, fp32 as measured (GB; '(tight)': over 127, '(no)': over 141)",
                PAPER_COLUMNS,
                paper_cells(paper))
    plain = results["plain"][str(LAYOUT["plain"].lengths[-1])]
    tables.append({"title": "On paper: the busiest H200 of each layout, fp32 as measured, GB (arithmetic, not "
                            "measured; '(tight)': over 127 GB, 90% of 141; '(no)': over 141 GB)",
                   "columns": PAPER_COLUMNS, "rows": paper_cells(paper)})
    write_report(
        "memory_at_scale", question=question, target="report", met=None,
        verdict=f"measured: {cal.unsharded_per_param + cal.optimizer_per_param:.1f} B/param held by a plain fp32 "
                f"rank ({cal.unsharded_per_param:.1f} weights + gradients, {cal.optimizer_per_param:.1f} AdamW "
                f"moments), activations {slope(results['plain']) / MB:.2f} MB/token at 24 layers "
                f"({slope(results['full']) / MB:.2f} with full recompute); {headline(paper)}",
        notes=(f"{plain['params'] / 1e6:.0f} M parameters at 24 layers, fp32 (bf16: model.dtype bfloat16), random "
               "weights; a layout's two points "
               "differ only in response length; GB = 1e9 bytes, over what the rank held before the model existed; "
               "update times move with the machine's load (other work shared it), the bytes do not. "
               f"What the on-paper table uses (bytes): weights + gradients {cal.unsharded_per_param:.2f} and AdamW "
               f"moments {cal.optimizer_per_param:.2f} a parameter, the optimizer step's temporaries "
               f"{cal.step_transient:.1f}x the largest tensor; per token and layer {cal.replicated_per_hidden:.1f} a "
               f"hidden unit on every tensor-parallel rank and {cal.split_per_width:.1f} a unit of 3 x hidden + "
               f"intermediate divided by tp, {cal.full_kept_per_hidden:.2f} a hidden unit kept by full recompute; "
               f"{cal.vocab_per_entry:.2f} a token and vocabulary entry for the logits."),
        rows=rows, tables=tables, raw=raw | {"calibration": asdict(cal), "paper": paper})


if __name__ == "__main__":
    main()
