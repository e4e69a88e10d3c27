"""What full colocation costs on a GPU: device memory each group gives back, and the time to give
it back and take it again (a benchmark, not a test; needs CUDA).

    python3 bench/colocate_swap.py                       # a random Qwen2-0.5B-shaped model, fp32
    python3 bench/colocate_swap.py --layers 4            # smaller and faster

Builds, in one process on one GPU (NCCL world of one rank): the Megatron trainer policy (parameters,
frozen KL reference, AdamW state after one GRPO update) and the transformers rollout engine with the
same weights. Each releases its device memory to the host (`release_memory`) and takes it back
(`resume_memory`), as the trainer and the engines do around every phase in `placement.mode:
colocate`. Prints a table and writes bench/results/colocate_swap.json. On a machine without CUDA it
says so and exits 0 (the CPU runtime releases nothing: there is no device memory to give back).
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results" / "colocate_swap.json"
GIB = 2**30


def save_random_qwen2(path: Path, layers: int) -> int:
    from common import qwen05b_config
    from transformers import Qwen2ForCausalLM

    config = qwen05b_config(layers, eos_token_id=151643, bos_token_id=151643)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes on the host
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def swap(name: str, release, resume, repeats: int) -> dict:
    rows = []
    for _ in range(repeats):
        held = torch.cuda.memory_allocated()
        release_s = timed(release)
        freed = held - torch.cuda.memory_allocated()
        resume_s = timed(resume)
        rows.append((freed, release_s, resume_s))
    freed = rows[-1][0]
    return {"group": name, "freed_bytes": freed, "release_s": statistics.median(r[1] for r in rows),
            "resume_s": statistics.median(r[2] for r in rows), "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24, help="Qwen2-0.5B has 24")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    console = Console()
    if not torch.cuda.is_available():
        console.print("colocate_swap needs CUDA (torch.cuda.is_available() is False); nothing measured")
        return

    from yatt_hpc.batch import SampleBatch
    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.rollout import GenerationRequest, build_engine
    from yatt_hpc.train import megatron_model
    from yatt_hpc.train.policy import MegatronPolicy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    megatron_model.initialize_model_parallel(0, 1, "127.0.0.1", port, tp_size=1, seed=0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        params = save_random_qwen2(Path(tmp), args.layers)
        torch.cuda.empty_cache()
        policy = MegatronPolicy.from_hf(tmp, 0, 1, TrainConfig(kl_coef=0.001, micro_batch_size=8))
        rng = np.random.default_rng(0)
        n, plen, rlen = 16, 64, 192
        batch = SampleBatch(sample_id=np.arange(n), prompt_id=np.arange(n) // 8,
                            prompt_len=np.full(n, plen, np.int32), prompt_tokens=rng.integers(0, 150000, n * plen),
                            response_len=np.full(n, rlen, np.int32), response_tokens=rng.integers(0, 150000, n * rlen),
                            logprobs=np.full(n * rlen, -5.0, np.float32))
        update_s = timed(lambda: policy.update(batch, np.tile([1.0, -1.0], n // 2).astype(np.float32)))
        policy.optimizer.zero_grad(set_to_none=True)
        results.append(swap("trainer (params + reference + AdamW)", policy.release_memory, policy.resume_memory,
                            args.repeats))
        policy.release_memory()
        engine = build_engine("hf", tmp, device="cuda", tp_size=1, seed=0)
        request = GenerationRequest(sample_id=0, prompt_ids=np.arange(1, 33, dtype=np.int32), max_new_tokens=16,
                                    temperature=1.0, top_p=1.0)
        engine.generate([request])
        results.append(swap("rollout engine (transformers)", engine.release_memory, engine.resume_memory,
                            args.repeats))
        engine.shutdown()
    report = {"params": params, "layers": args.layers, "dtype": "float32", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "grpo_update_s": update_s, "results": results}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    table = Table(title=f"full colocation swap, {params / 1e6:.0f}M params fp32 on {report['gpu']}")
    for col in ("group", "device memory freed (GiB)", "release (s)", "resume (s)", "release GiB/s"):
        table.add_column(col)
    for r in results:
        table.add_row(r["group"], f"{r['freed_bytes'] / GIB:.2f}", f"{r['release_s']:.3f}", f"{r['resume_s']:.3f}",
                      f"{r['freed_bytes'] / GIB / max(r['release_s'], 1e-9):.1f}")
    console.print(table)
    console.print(f"one GRPO update ({n} samples x {plen + rlen} tokens): {update_s:.2f}s; JSON: {RESULTS}")


if __name__ == "__main__":
    main()
