"""B10: what an async checkpoint costs a trainer rank in host memory, at the Qwen2.5-0.5B shape.

    python3 bench/ckpt_memory.py                   # 24 layers (the real model), 2 steps a variant
    python3 bench/ckpt_memory.py --layers 4        # smaller and faster

Each variant runs in a fresh process: a Megatron policy of Qwen2.5-0.5B's shape (hidden 896, 14 heads over
2 key/value groups, MLP 4864, the padded 151,936 vocabulary, tied embeddings; random weights, float32), AdamW,
and `--steps` GRPO updates of 4 prompts x 4 samples with up to 64 response tokens (the trainer defaults:
shared prompts, chunked log-probs, 8-sample micro-batches). After each update the variant saves as the
trainer does (`CheckpointManager.save`, async) or not at all:

* none: no checkpoint, the baseline;
* capped: `checkpoint.staging_mb` at its default (2048 MiB): the staging copy holds what fits, the rest is
  written before the step goes on;
* uncapped: a staging copy of the whole state, as large as the model and optimizer shards.

It prints, per variant, the peak resident memory of the process (ru_maxrss), its resident memory at the end
(after the last save was committed: what the run keeps), the stall of each save (the first one also
faults in the staging buffers) and the checkpoint's size, and writes bench/results/ckpt_memory.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2**30
VARIANTS = {"none": None, "capped": 2048, "uncapped": -1}  # staging MiB; -1: no cap


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def one_variant(layers: int, steps: int, variant: str, run_dir: Path) -> dict:
    """Runs in its own process (`--variant`): the policy, its updates and saves; returns the measurements."""
    import numpy as np
    import torch

    from tests.programs.update_digest import batch_of
    from yatt_hpc.ckpt import CheckpointManager, RankState
    from yatt_hpc.ckpt.optim import optimizer_tensors
    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.policy import MegatronPolicy

    torch.set_num_threads(2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mm.initialize_model_parallel(0, 1, "127.0.0.1", port, tp_size=1, seed=0)
    from common import qwen05b_config

    config = qwen05b_config(layers)
    policy = MegatronPolicy(mm.build_gpt_model(config, 1), config, TrainConfig(lr=1e-6), share_prompts=True)
    params = sum(p.numel() for p in policy.model.parameters())
    cap = VARIANTS[variant]
    mgr = None if cap is None else CheckpointManager(run_dir, async_save=True,
                                                     staging_bytes=None if cap < 0 else cap * 2**20)
    rng = np.random.default_rng(7)
    stalls = []
    for step in range(1, steps + 1):
        policy.update(*batch_of(rng, prompts=4, samples=4, tokens=64))
        if mgr is not None:
            optim, meta = optimizer_tensors(policy.optimizer, policy.master.items())  # as the trainer saves
            state = RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0},
                              model=policy.checkpoint_tensors(), optim=optim, optim_meta=meta)
            start = time.perf_counter()
            mgr.save(step, state)
            stalls.append(time.perf_counter() - start)
    if mgr is not None:
        mgr.close()
    size = sum(f.stat().st_size for f in run_dir.rglob("*.safetensors")) / max(steps, 1) if mgr else 0
    return {"variant": variant, "params": params, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "end_rss": resident_bytes(), "staging_bytes": mgr._staging.nbytes if mgr else 0,
            "stalls_s": stalls, "ckpt_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.variant:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one_variant(args.layers, args.steps, args.variant, Path(tmp))))
        return

    from common import print_table, write_report

    results = []
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--steps", str(args.steps),
                               "--variant", variant], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"variant {variant} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = results[0]
    rows, table = [], []
    for r in results:
        extra = (r["peak_rss"] - base["peak_rss"]) / GIB
        stalls = " / ".join(f"{x:.2f}" for x in r["stalls_s"]) or "-"
        value = (f"peak {r['peak_rss'] / GIB:.2f} GiB ({extra:+.2f}), at the end {r['end_rss'] / GIB:.2f} GiB, staging "
                 f"{r['staging_bytes'] / GIB:.2f} GiB, stall per save {stalls} s")
        rows.append({"label": {"none": "no checkpoint", "capped": "async, staging_mb 2048 (default)",
                               "uncapped": "async, staging uncapped"}[r["variant"]], "value": value})
        table.append([rows[-1]["label"], f"{r['peak_rss'] / GIB:.2f}", f"{extra:+.2f}", f"{r['end_rss'] / GIB:.2f}",
                      f"{r['staging_bytes'] / GIB:.2f}", stalls])
    print_table(f"B10 checkpoint memory, {base['params'] / 1e6:.0f} M parameters ({args.layers} layers), fp32",
                ["variant", "peak GiB", "vs none", "end GiB", "staging GiB", "stall per save, s"], table)
    capped = next(r for r in results if r["variant"] == "capped")
    added = (capped["peak_rss"] - base["peak_rss"]) / GIB
    ckpt = capped["ckpt_bytes"] / GIB
    write_report(
        "ckpt_memory",
        question=f"B10 host memory an async checkpoint adds to a trainer rank, Qwen2.5-0.5B shape ({args.layers} layers, "
                 f"{base['params'] / 1e6:.0f} M parameters, fp32 + AdamW: {ckpt:.2f} GiB a save)",
        target="the save adds at most checkpoint.staging_mb (2 GiB) to the peak, and nothing stays beyond it",
        met=added <= 2048 / 1024 + 0.25,  # the cap plus allocator slack
        verdict=f"default cap: peak +{added:.2f} GiB over no checkpoint (uncapped: "
                f"+{(results[2]['peak_rss'] - base['peak_rss']) / GIB:.2f} GiB)",
        rows=rows, raw={"layers": args.layers, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
