"""Build the two tiny demo models of `make demo`: a partly competent policy and a reliable GenRM judge.

    .venv/bin/python tools/make_demo_models.py              # ~4 min on 2 busy cores; writes models/demo/
    .venv/bin/python tools/make_demo_models.py --out /tmp/demo --policy-steps 300 --judge-steps 300

Both are GPT2LMHeadModel (tied embeddings, gelu_new, no dropout, vocab padded to a multiple of 8)
over the character tokenizer, so the trainer's HF -> Megatron GPT-2 converter loads the policy.
The task is `yatt_hpc.demo.task` (reverse a six-letter word over "abcd").

Policy: supervised on a *noisy teacher* that answers correctly only `--clean-fraction` of the time
and otherwise gives a near miss (swapped, substituted, dropped letters, unreversed word...). The
model learns the right answer as its mode but samples near misses at temperature 1.0, so it starts
partly correct and GRPO improves it quickly by sharpening, which is what a 5-minute CPU demo can show.

Judge: starts from a copy of the finished policy (its template shows the transcript exactly as the
policy wrote it, so the policy's reversal circuits are reused; from scratch it learned several times
slower) and is supervised to answer "yes"/"no" on correct answers, synthetic near misses and samples
of the policy, labelled by the rule verifier. A learning rate above ~1e-3 kept it from learning at all.

Everything is seeded; on the same machine and thread count the output is bit-identical. The script
prints and writes `metrics.json` next to each model: policy accuracy at temperature 1.0 and greedy,
judge agreement with the rule verifier on held-out pairs (synthetic and policy samples), the parse-fail
rate, the fraction of GRPO groups with non-zero reward variance, and single-thread timings.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import time
from pathlib import Path

import torch
import transformers
from transformers import GPT2LMHeadModel

from yatt_hpc.data.tokenizer import CharTokenizerAdapter
from yatt_hpc.demo.char_tokenizer import CharTokenizer
from yatt_hpc.demo.task import demo_row, near_miss
from yatt_hpc.demo.tiny_models import char_gpt2, save_char_model
from yatt_hpc.reward.judge import GenRMJudge
from yatt_hpc.reward.mixing import combine_reward, judge_agrees
from yatt_hpc.reward.template import build_judge_prompt, verdict_text
from yatt_hpc.reward.verifier import rule_score
from yatt_hpc.rollout.hf_engine import HFEngine

POLICY_SHAPE = {"n_embd": 64, "n_layer": 3, "n_head": 4}
N_POSITIONS = 64
MAX_NEW_TOKENS = 16  # rollout.max_new_tokens default
# Mistakes of the noisy teacher: the ones a reversing model plausibly makes, none of them absurd.
POLICY_MISTAKES = ("swap_adjacent", "swap_any", "substitute", "drop", "insert", "unreversed")
# The judge's synthetic negatives lean on near misses that differ in a letter or two: the hard cases.
JUDGE_MISTAKES = POLICY_MISTAKES * 4 + ("rotate", "random_word", "extra_tail", "truncate")


def build_gpt2(tok: CharTokenizer, shape: dict) -> GPT2LMHeadModel:
    return char_gpt2(n_positions=N_POSITIONS, **shape)


class RowStream:
    """Fresh train-split rows, one index after the other, so every batch sees new words."""

    def __init__(self, seed: int) -> None:
        self.seed, self.next_index = seed, 0

    def take(self, count: int) -> list[dict]:
        rows = [demo_row(self.seed, self.next_index + i, "train") for i in range(count)]
        self.next_index += count
        return rows


def collate(tok: CharTokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels) for "prompt + target + eos", loss on the target and eos only."""
    seqs = [(tok.encode(p), tok.encode(t) + [tok.eos_id]) for p, t in pairs]
    width = max(len(p) + len(t) for p, t in seqs)
    ids = torch.full((len(seqs), width), tok.pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (p, t) in enumerate(seqs):
        ids[i, :len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p):len(p) + len(t)] = torch.tensor(t)
    return ids, labels


def train_lm(model: GPT2LMHeadModel, tok: CharTokenizer, make_pairs, steps: int, lr: float, name: str) -> None:
    """AdamW with linear warmup and cosine decay; `make_pairs(step)` yields the batch's (prompt, target)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + torch.cos(torch.tensor(torch.pi * min(s, steps) / steps)).item()))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        ids, labels = collate(tok, make_pairs(step))
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"  {name} step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - start:6.1f}s", flush=True)
    model.eval()


@torch.no_grad()
def sample(model: GPT2LMHeadModel, tok: CharTokenizer, prompts: list[str], n: int, temperature: float) -> list[str]:
    """`n` responses per prompt (prompt-major order). Demo prompts share one length, so no padding."""
    assert len({len(tok.encode(p)) for p in prompts}) == 1, "demo prompts must share one length"
    ids = torch.tensor([tok.encode(p) for p in prompts for _ in range(n)], dtype=torch.long)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                         pad_token_id=tok.pad_id, eos_token_id=tok.eos_id, **sampling)
    return [tok.decode_generated(row) for row in out[:, ids.shape[1]:].tolist()]


def build_policy(tok: CharTokenizer, args) -> GPT2LMHeadModel:
    torch.manual_seed(args.seed)
    model = build_gpt2(tok, POLICY_SHAPE)
    rows, rng = RowStream(args.seed + 1), random.Random(args.seed + 2)

    def make_pairs(step: int) -> list[tuple[str, str]]:
        return [(r["prompt"], r["answer"] if rng.random() < args.clean_fraction
                 else near_miss(r["answer"], rng, POLICY_MISTAKES)) for r in rows.take(args.batch)]

    train_lm(model, tok, make_pairs, args.policy_steps, args.policy_lr, "policy")
    return model


def policy_pool(policy, tok, seed: int, prompts: int, n: int) -> list[tuple[str, str, str]]:
    """(prompt, response, answer) sampled from the policy at temperature 1.0 on train prompts."""
    rows = [demo_row(seed, i, "train") for i in range(prompts)]
    texts = sample(policy, tok, [r["prompt"] for r in rows], n, 1.0)
    return [(r["prompt"], texts[i * n + j], r["answer"]) for i, r in enumerate(rows) for j in range(n)]


def build_judge(tok: CharTokenizer, policy: GPT2LMHeadModel, pool: list[tuple[str, str, str]],
                args) -> GPT2LMHeadModel:
    model = copy.deepcopy(policy)
    rows, rng = RowStream(args.seed + 11), random.Random(args.seed + 12)

    def make_pairs(step: int) -> list[tuple[str, str]]:
        pairs = []
        for r in rows.take(args.judge_batch):
            u = rng.random()
            if u < args.judge_policy_fraction:  # on-policy samples: the distribution the judge will grade
                question, response, answer = rng.choice(pool)
            else:
                question, answer = r["prompt"], r["answer"]
                response = answer if u < (1 + args.judge_policy_fraction) / 2 else near_miss(answer, rng, JUDGE_MISTAKES)
            pairs.append((build_judge_prompt(question, response), verdict_text(rule_score(response, answer) == 1.0)))
        return pairs

    train_lm(model, tok, make_pairs, args.judge_steps, args.judge_lr, "judge")
    return model


def judge_agreement(judge: GenRMJudge, triples: list[tuple[str, str, str]]) -> dict:
    """Agreement of the judge's verdict with the rule verifier, the parse-fail rate, and the positives' share."""
    scores = judge.score([(q, r) for q, r, _ in triples])
    truth = [rule_score(r, a) for _, r, a in triples]
    agree = sum(judge_agrees(s, t) for s, t in zip(scores, truth))
    return {"pairs": len(triples), "agreement": agree / len(triples),
            "parse_fail_rate": sum(s is None for s in scores) / len(triples),
            "rule_positive_fraction": sum(truth) / len(triples)}


def heldout_pairs(policy, tok, seed: int, count: int) -> dict[str, list[tuple[str, str, str]]]:
    """Held-out (question, response, answer) triples: synthetic half-right half-near-miss, and policy samples."""
    rng = random.Random(seed)
    rows = [demo_row(seed, i, "heldout") for i in range(count)]
    synthetic = [(r["prompt"], r["answer"] if i % 2 else near_miss(r["answer"], rng), r["answer"])
                 for i, r in enumerate(rows)]
    texts = sample(policy, tok, [r["prompt"] for r in rows], 2, 1.0)
    on_policy = [(r["prompt"], texts[2 * i + j], r["answer"]) for i, r in enumerate(rows) for j in range(2)]
    return {"synthetic": synthetic, "policy_samples": on_policy}


def measure_policy(policy, tok, seed: int, count: int) -> dict:
    rows = [demo_row(seed, i, "heldout") for i in range(count)]
    prompts = [r["prompt"] for r in rows]
    sampled = sample(policy, tok, prompts, 1, 1.0)
    greedy = sample(policy, tok, prompts, 1, 0.0)
    return {"heldout_prompts": count,
            "accuracy_temperature_1": sum(rule_score(s, r["answer"]) for s, r in zip(sampled, rows)) / count,
            "accuracy_greedy": sum(rule_score(s, r["answer"]) for s, r in zip(greedy, rows)) / count}


def measure_rl_signal(policy, judge: GenRMJudge, tok, seed: int, prompts: int = 16, n: int = 8) -> dict:
    """What one GRPO step of the demo sees (reward 0.5*genrm + 0.5*rule): the share of groups whose
    rewards differ (GRPO learns nothing from the others) and single-thread generate/judge time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = [demo_row(seed, 10_000 + i, "train") for i in range(prompts)]
    start = time.perf_counter()
    texts = sample(policy, tok, [r["prompt"] for r in rows], n, 1.0)
    gen_s = time.perf_counter() - start
    start = time.perf_counter()
    verdicts = judge.score([(rows[i // n]["prompt"], t) for i, t in enumerate(texts)])
    judge_s = time.perf_counter() - start
    torch.set_num_threads(threads)
    rules = [rule_score(t, rows[i // n]["answer"]) for i, t in enumerate(texts)]
    rewards = [combine_reward(v, r, "rm_with_rule", 0.5, 0.5, 0.0) for v, r in zip(verdicts, rules)]
    groups = [rewards[i * n:(i + 1) * n] for i in range(prompts)]
    return {"prompts": prompts, "samples_per_prompt": n,
            "groups_with_reward_variance": sum(len(set(g)) > 1 for g in groups) / prompts,
            "mean_reward": sum(rewards) / len(rewards), "mean_rule_reward": sum(rules) / len(rules),
            "generate_seconds_1_thread": round(gen_s, 3), "judge_seconds_1_thread": round(judge_s, 3)}


def save(model: GPT2LMHeadModel, tok: CharTokenizer, directory: Path, metrics: dict, sampling: bool) -> None:
    if sampling:
        # Pure sampling by default: HF's implicit top_k=50 would make rollout log-probs differ from the trainer's.
        model.generation_config.do_sample, model.generation_config.top_k = True, 0
    save_char_model(model, directory)
    (directory / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1,
                   help="1 by default: on a shared 2-core machine a second thread made steps up to 4x slower")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--policy-steps", type=int, default=600)
    p.add_argument("--policy-lr", type=float, default=3e-3)
    p.add_argument("--clean-fraction", type=float, default=0.45,
                   help="share of teacher answers that are right; sets the policy's sampled accuracy")
    p.add_argument("--judge-batch", type=int, default=64)
    p.add_argument("--judge-steps", type=int, default=1500)
    p.add_argument("--judge-lr", type=float, default=1e-3)
    p.add_argument("--judge-policy-fraction", type=float, default=0.5,
                   help="share of judge examples that are policy samples rather than synthetic answers")
    p.add_argument("--eval-prompts", type=int, default=512)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    # Training batches are right-padded with the loss masked, which HF warns about on every call.
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok = CharTokenizer()
    t0 = time.perf_counter()
    policy = build_policy(tok, args)
    policy_metrics = measure_policy(policy, tok, args.seed + 100, args.eval_prompts)
    print("policy:", policy_metrics, flush=True)
    pool = policy_pool(policy, tok, args.seed + 20, 1024, 4)
    judge_model = build_judge(tok, policy, pool, args)
    judge = GenRMJudge(HFEngine(judge_model, stop_token_ids=[tok.eos_id]), CharTokenizerAdapter(tok),
                       max_positions=judge_model.config.n_positions)
    evals = heldout_pairs(policy, tok, args.seed + 200, args.eval_prompts)
    judge_metrics = {name: judge_agreement(judge, triples) for name, triples in evals.items()}
    print("judge:", judge_metrics, flush=True)
    rl_metrics = measure_rl_signal(policy, judge, tok, args.seed + 300)
    print("rl signal:", rl_metrics, flush=True)
    common = {"task": "reverse a six-letter word over 'abcd' (yatt_hpc.demo.task)", "seed": args.seed,
              "parameters": sum(p.numel() for p in policy.parameters()),
              "build_seconds": round(time.perf_counter() - t0, 1), "args": {k: str(v) for k, v in vars(args).items()}}
    save(policy, tok, args.out / "policy", {**common, "policy": policy_metrics, "rl_signal": rl_metrics}, sampling=True)
    save(judge_model, tok, args.out / "judge", {**common, "judge": judge_metrics}, sampling=False)
    sizes = {d: sum(f.stat().st_size for f in (args.out / d).iterdir()) for d in ("policy", "judge")}
    print(f"wrote {args.out}/policy ({sizes['policy'] / 1e6:.2f} MB) and {args.out}/judge "
          f"({sizes['judge'] / 1e6:.2f} MB) in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
