"""Build the agentic demo's tiny policy and rows: `configs/demo_tools_cpu.yaml` trains it to use a tool.

    .venv/bin/python tools/make_demo_tools_model.py                 # ~1-2 min on 2 busy cores; writes models/demo_tools/
    .venv/bin/python tools/make_demo_tools_model.py --out /tmp/dt --steps 200

The task is `yatt_hpc.demo.lookup`: a key's secret code is known only to the `look` tool. The policy
(GPT2LMHeadModel over the character vocabulary, with a Hugging Face tokenizer whose chat template has the
tool role) is supervised on a noisy teacher: `--right` of its trajectories call the tool with the prompt's key
and copy the result, the rest answer without the tool, mistype the key, or write a malformed call. It starts
answering right about that often; RL on the reward of the final answer raises both the reward and the rate of
successful tool use. Loss on the model's pieces only, as in the RL run. Seeded; writes `metrics.json`.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from yatt_hpc.demo.char_tokenizer import CharTokenizer, save_hf_twin
from yatt_hpc.demo.lookup import CHAT_TEMPLATE, lookup_row, trajectory
from yatt_hpc.demo.tiny_models import char_gpt2

KINDS = ("right", "guess", "wrong_key", "broken")


def encode(tok: CharTokenizer, row: dict, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids, labels = tok.encode(row["prompt"]), [-100] * len(tok.encode(row["prompt"]))
    for text, by_model in pieces:
        piece = tok.encode(text) + ([tok.eos_id] if by_model else [])
        ids += piece
        labels += piece if by_model else [-100] * len(piece)
    return ids, labels


def batch(tok: CharTokenizer, rows: list[dict], rng: random.Random, weights: list[float]):
    seqs = [encode(tok, r, trajectory(r, rng.choices(KINDS, weights)[0], rng)) for r in rows]
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), tok.pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(seqs):
        ids[i, :len(s)], labels[i, :len(s)] = torch.tensor(s), torch.tensor(lab)
    return ids, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/demo_tools")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--right", type=float, default=0.3, help="share of teacher trajectories that use the tool right")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out, tok = Path(args.out), CharTokenizer()
    rest = (1.0 - args.right) / 3
    weights = [args.right, rest, rest, rest]
    torch.manual_seed(args.seed)
    model = char_gpt2(n_embd=64, n_layer=3, n_head=4, n_positions=160, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 25) * max(0.05, 1 - s / args.steps))
    rng, start = random.Random(args.seed + 1), time.perf_counter()
    model.train()
    for step in range(args.steps):
        rows = [lookup_row(args.seed + 1000, step * args.batch + i) for i in range(args.batch)]
        ids, labels = batch(tok, rows, rng, weights)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.4f} {time.perf_counter() - start:6.1f}s", flush=True)
    model.eval()
    policy = out / "policy"
    model.save_pretrained(policy, safe_serialization=True)
    save_hf_twin(tok, policy, chat_template=CHAT_TEMPLATE)  # tokenizer.json + the chat template with the tool role
    for split, offset in (("train", 0), ("heldout", 10**6)):
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for i in range(args.rows if split == "train" else 256):
                row = lookup_row(args.seed, offset + i)
                f.write(json.dumps({"prompt": row["prompt"], "answer": row["answer"]}) + "\n")
    (policy / "metrics.json").write_text(json.dumps({"steps": args.steps, "final_loss": loss.item(),
                                                     "teacher_right": args.right,
                                                     "seconds": time.perf_counter() - start}, indent=1) + "\n")
    print(f"wrote {policy} and {out}/train.jsonl, {out}/heldout.jsonl")


if __name__ == "__main__":
    main()
