"""B13: what LoRA saves a trainer rank: peak memory, optimizer state and checkpoint size, full training vs adapters.

    python3 bench/lora_memory.py                   # Qwen2.5-0.5B's 24 layers, rank 8 on every linear layer
    python3 bench/lora_memory.py --layers 4 --rank 16

Each variant runs in a fresh process: a Megatron policy of Qwen2.5-0.5B's shape (hidden 896, 14 heads over
2 key/value groups, MLP 4864, the padded 151,936 vocabulary, tied embeddings; random weights from the config,
float32) and `--steps` GRPO updates (default 1) of 4 prompts x 4 samples with up to 64 response tokens (the trainer defaults:
shared prompts, chunked log-probs, 8-sample micro-batches, no KL term), then one checkpoint written as the trainer
writes it (`CheckpointManager.save`, synchronous):

* full: every parameter trained (AdamW's moments for all of them);
* lora: `train.lora` at `--rank` on all-linear (alpha 2 x rank): the base frozen, the adapters trained.

It prints, per variant, the peak resident memory of the process (ru_maxrss: torch, Megatron and the model
included), the trained parameters, the optimizer state's bytes (`policy.optimizer_state()`, what the checkpoint
holds of it) and the checkpoint's size on disk, and writes bench/results/lora_memory.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2**20
VARIANTS = ("full", "lora")


def one_variant(layers: int, steps: int, rank: int, variant: str, run_dir: Path) -> dict:
    """Runs in its own process (`--variant`): the policy, its updates and one save; returns the measurements."""
    import numpy as np
    import torch

    from tests.programs.update_digest import batch_of
    from yatt_hpc.ckpt import CheckpointManager, RankState
    from yatt_hpc.config.lora import LoraConfig
    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.lora.layers import Lora
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.hf_arch import describe_hf_config
    from yatt_hpc.train.policy import MegatronPolicy

    torch.set_num_threads(2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mm.initialize_model_parallel(0, 1, "127.0.0.1", port, tp_size=1, seed=0)
    from common import qwen05b_config

    config = qwen05b_config(layers)
    lora_cfg = LoraConfig(rank=rank, alpha=2.0 * rank) if variant == "lora" else LoraConfig()
    model = mm.build_gpt_model(config, 1)
    lora = Lora.attach(model, describe_hf_config(config, 1), lora_cfg, 0, 0, 1) if lora_cfg.enabled else None
    policy = MegatronPolicy(model, config, TrainConfig(lr=1e-5, lora=lora_cfg), share_prompts=True, lora=lora)
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in policy.named_params.values())
    rng = np.random.default_rng(7)
    for _ in range(steps):
        policy.update(*batch_of(rng, prompts=4, samples=4, tokens=64))
    optim, meta = policy.optimizer_state()
    optim_bytes = sum(t.numel() * t.element_size() for t in optim.values())
    mgr = CheckpointManager(run_dir, async_save=False)
    mgr.save(steps, RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0}, model=policy.checkpoint_tensors(),
                              optim=optim, optim_meta=meta))
    mgr.close()
    ckpt = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
    return {"variant": variant, "params": params, "trained": trained, "optim_bytes": optim_bytes,
            "ckpt_bytes": ckpt, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rank", type=int, default=8, help="train.lora.rank of the lora variant")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.variant:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one_variant(args.layers, args.steps, args.rank, args.variant, Path(tmp))))
        return

    from common import print_table, write_report

    results = {}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--steps", str(args.steps),
                               "--rank", str(args.rank), "--variant", variant], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"variant {variant} failed:\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    labels = {"full": "full training", "lora": f"LoRA rank {args.rank}, all-linear"}
    rows, table = [], []
    for variant, r in results.items():
        value = (f"peak {r['peak_rss'] / MIB:,.0f} MiB, trained {r['trained'] / 1e6:.2f} M of {r['params'] / 1e6:.0f} M "
                 f"parameters, optimizer state {r['optim_bytes'] / MIB:,.1f} MiB, checkpoint {r['ckpt_bytes'] / MIB:,.1f} MiB")
        rows.append({"label": labels[variant], "value": value})
        table.append([labels[variant], f"{r['peak_rss'] / MIB:,.0f}", f"{r['trained'] / 1e6:.2f}",
                      f"{r['optim_bytes'] / MIB:,.1f}", f"{r['ckpt_bytes'] / MIB:,.1f}"])
    print_table(f"B13 LoRA vs full training, {full['params'] / 1e6:.0f} M parameters ({args.layers} layers), fp32",
                ["variant", "peak MiB", "trained M", "optimizer MiB", "checkpoint MiB"], table)
    ratio = lora["optim_bytes"] / full["optim_bytes"]
    write_report(
        "lora_memory",
        question=f"B13 LoRA vs full training memory: a trainer rank at Qwen2.5-0.5B's shape ({args.layers} layers, "
                 f"{full['params'] / 1e6:.0f} M parameters, fp32), rank {args.rank} on every linear layer",
        target="optimizer state with LoRA <= 2% of full training's",
        met=ratio <= 0.02,
        verdict=f"optimizer state {ratio:.2%} of full ({lora['optim_bytes'] / MIB:.1f} vs "
                f"{full['optim_bytes'] / MIB:,.0f} MiB), checkpoint {lora['ckpt_bytes'] / full['ckpt_bytes']:.2%} "
                f"({lora['ckpt_bytes'] / MIB:.1f} vs {full['ckpt_bytes'] / MIB:,.0f} MiB), peak memory "
                f"{lora['peak_rss'] / MIB:,.0f} vs {full['peak_rss'] / MIB:,.0f} MiB "
                f"({lora['peak_rss'] / full['peak_rss']:.2f}x)",
        rows=rows, raw={"layers": args.layers, "steps": args.steps, "rank": args.rank, "results": results})


if __name__ == "__main__":
    main()
