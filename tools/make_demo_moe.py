"""Build the demo's mixture-of-experts policy: a tiny Qwen3-MoE taught the demo task as the dense demo policy is.

    .venv/bin/python tools/make_demo_moe.py                 # writes models/demo_moe/policy; the judge stays models/demo/judge
    .venv/bin/python tools/make_demo_moe.py --out /tmp/moe --policy-steps 200

The model is `yatt_hpc.demo.tiny_models.char_qwen3_moe` (4 experts of width 64, 2 per token, 3 layers, renormalised
top-k, router_aux_loss_coef 0.01) over the character tokenizer, supervised on the same noisy teacher as the dense
policy (`tools/make_demo_models.py`: right only `--clean-fraction` of the time, otherwise a near miss), so it starts
partly correct and GRPO improves it. Everything is seeded; `metrics.json` holds its accuracy at temperature 1 and
greedy, and the build's arguments and time. `configs/demo_moe_cpu.yaml` trains it.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_models import POLICY_MISTAKES, RowStream, measure_policy, train_lm  # noqa: E402

from yatt_hpc.demo.char_tokenizer import CharTokenizer  # noqa: E402
from yatt_hpc.demo.task import near_miss  # noqa: E402
from yatt_hpc.demo.tiny_models import char_qwen3_moe, save_char_model  # noqa: E402

SHAPE = {"hidden": 64, "layers": 3, "experts": 4, "topk": 2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("models/demo_moe"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--policy-steps", type=int, default=600)
    p.add_argument("--policy-lr", type=float, default=3e-3)
    p.add_argument("--clean-fraction", type=float, default=0.45)
    p.add_argument("--eval-prompts", type=int, default=512)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    tok = CharTokenizer()
    start = time.perf_counter()
    model = char_qwen3_moe(n_positions=64, seed=args.seed, **SHAPE)
    rows, rng = RowStream(args.seed + 1), random.Random(args.seed + 2)

    def make_pairs(step: int) -> list[tuple[str, str]]:
        return [(r["prompt"], r["answer"] if rng.random() < args.clean_fraction
                 else near_miss(r["answer"], rng, POLICY_MISTAKES)) for r in rows.take(args.batch)]

    train_lm(model, tok, make_pairs, args.policy_steps, args.policy_lr, "moe policy")
    metrics = measure_policy(model, tok, args.seed + 100, args.eval_prompts)
    print("moe policy:", metrics, flush=True)
    # pure sampling by default: HF's implicit top_k=50 would make rollout log-probs differ from the trainer's
    model.generation_config.do_sample, model.generation_config.top_k = True, 0
    out = args.out / "policy"
    save_char_model(model, out)
    (out / "metrics.json").write_text(json.dumps({
        "task": "reverse a six-letter word over 'abcd' (yatt_hpc.demo.task)", "seed": args.seed, "shape": SHAPE,
        "parameters": sum(p.numel() for p in model.parameters()), "policy": metrics,
        "build_seconds": round(time.perf_counter() - start, 1), "args": {k: str(v) for k, v in vars(args).items()},
    }, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
