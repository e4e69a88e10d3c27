"""Build the visual demo's models: a tiny Qwen2-VL policy that counts red shapes, partly, and a VLM judge.

    .venv/bin/python tools/make_demo_vlm.py                  # writes models/demo_vlm/{policy,judge} (~30 min, 2 cores)
    .venv/bin/python tools/make_demo_vlm.py --judge-only     # loads models/demo_vlm/policy, writes only the judge
    .venv/bin/python tools/make_demo_vlm.py --out /tmp/vlm --policy-steps 200 --judge-steps 200

The task is `yatt_hpc.demo.shapes` ("How many red shapes?" over a 56x56 image of 1-4 red shapes and
0-2 others; answer one digit). Both models are `yatt_hpc.demo.tiny_vlm.tiny_qwen2_vl` (Qwen2 language
model with M-RoPE, Qwen2-VL vision tower, character tokenizer), built from a config, no download.

Policy: supervised on the task's answers (`--clean-fraction` of them right, the rest a uniformly drawn
digit 1-4: a noisy teacher as in the text demo's tools/make_demo_models.py) for `--policy-steps`
batches; the loss sits at chance (it has not found the image yet) for the first ~800 and then falls, so
the finished policy reads the image but samples wrong counts often enough for GRPO to sharpen it.

Judge: a copy of the policy supervised on exactly the ids the GenRM feeds it at run time
(reward/judge.py: the question with its image marked, `build_judge_prompt`, the image pads expanded) to
continue with `verdict_text(rule says correct)` and EOS. The responses are the policy's own samples at
the demo's temperature (`--judge-policy-fraction`, junk included) and otherwise the right count or a
wrong digit 1-4, half each; the loss is on the verdict and EOS, plus the true count where the response
begins (`--judge-count-weight`: the copy keeps counting while it learns to compare). Warmup + cosine lr;
every `--judge-eval-every` batches the yes-vs-no choice is checked on balanced held-out pairs (another
seed's held-out scenes) and the best checkpoint is kept (a constant lr 1e-3 once collapsed to "no" for
everything after 3000 batches). metrics.json holds the curve and the agreement the GenRM itself gets on
held-out balanced pairs and on policy samples. Seeded, one thread: byte-reproducible.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from yatt_hpc.data.tokenizer import load_tokenizer
from yatt_hpc.demo.shapes import shapes_row
from yatt_hpc.demo.tiny_vlm import IMAGE_PAD_ID, save_tiny_vlm, tiny_qwen2_vl
from yatt_hpc.reward.judge import GenRMJudge
from yatt_hpc.reward.template import JudgePrompt, verdict_text
from yatt_hpc.reward.verifier import rule_score
from yatt_hpc.rollout.engine import GenerationRequest
from yatt_hpc.vision.processor import ImageProcessor, decode_rgb, mark_images


def examples(seed: int, start: int, count: int) -> list[dict]:
    return [shapes_row(seed, i) for i in range(start, start + count)]


class Encoder:
    """Rows -> (ids, pixels, grids), the way the trainer and the engines build them."""

    def __init__(self, model_dir: Path) -> None:
        self.tok, self.proc = load_tokenizer(model_dir), ImageProcessor.from_model_dir(model_dir)

    def prompt(self, text: str, images: list[bytes]) -> list[int]:
        ids = self.tok.encode(mark_images(text, len(images)))
        return self.proc.expand(ids, [decode_rgb(b).size for b in images])

    def batch(self, rows: list[dict], targets: list[str], prefix=lambda r: r["prompt"]):
        seqs, spans = [], []
        for row, target in zip(rows, targets):
            prompt = self.prompt(prefix(row), row["images"])
            answer = self.tok.encode(target) + [self.tok.eos_ids[0]]
            seqs.append(prompt + answer)
            spans.append((len(prompt), len(prompt) + len(answer)))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [self.tok.pad_id] * (width - len(s)) for s in seqs])
        labels = torch.full_like(ids, -100)
        for k, (lo, hi) in enumerate(spans):
            labels[k, lo:hi] = ids[k, lo:hi]
        pixels, grids = self.proc.pixel_inputs([decode_rgb(b) for r in rows for b in r["images"]])
        return ids, labels, torch.from_numpy(pixels), torch.from_numpy(grids)


def train(model, enc: Encoder, make_batch, steps: int, lr: float, name: str) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        ids, labels, pixels, grids = make_batch(step)
        out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                    mm_token_type_ids=(ids == IMAGE_PAD_ID).int())
        logits = out.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"{name} step {step:4d} loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()


def build_policy(enc: Encoder, args) -> torch.nn.Module:
    model = tiny_qwen2_vl(seed=args.seed, **POLICY_SHAPE)
    rng = random.Random(args.seed)

    def batch(step: int):
        rows = examples(args.seed, step * args.batch, args.batch)
        noisy = [r["answer"] if rng.random() < args.clean_fraction else str(rng.randint(1, 4)) for r in rows]
        return enc.batch(rows, noisy)

    train(model, enc, batch, args.policy_steps, args.lr, "policy")
    return model


@torch.no_grad()
def answer_probs(model, enc: Encoder, rows: list[dict]) -> np.ndarray:
    """P(digit d | image, question) for d = 1..4, per row (from one forward pass)."""
    digits = [enc.tok.encode(str(d))[0] for d in range(1, 5)]
    ids, _, pixels, grids = enc.batch(rows, ["1"] * len(rows))
    lengths = [len(enc.prompt(r["prompt"], r["images"])) for r in rows]
    logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                   mm_token_type_ids=(ids == IMAGE_PAD_ID).int()).logits
    rows_logits = torch.stack([logits[k, n - 1] for k, n in enumerate(lengths)]).float()
    return torch.softmax(rows_logits, -1)[:, digits].numpy()


def measure_policy(model, enc: Encoder, seed: int) -> dict:
    rows = examples(seed + 1, 0, 256)  # another seed's scenes: not seen in training
    probs = answer_probs(model, enc, rows)
    truth = np.array([int(r["answer"]) - 1 for r in rows])
    return {"p_correct_mean": float(probs[np.arange(len(rows)), truth].mean()),
            "greedy_accuracy": float((probs.argmax(1) == truth).mean()),
            "digit_mass": float(probs.sum(1).mean())}


DEMO_TEMPERATURE, DEMO_MAX_NEW_TOKENS = 2.0, 3  # configs/demo_vlm_cpu.yaml's rollout: what the judge grades
POLICY_SHAPE = {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "vision_depth": 2, "vision_width": 64}


JUDGE_TRAIN_SEED_OFFSET = 2  # the judge's training scenes: not the policy's (seed) nor the held-out ones (seed + 1)


class JudgeData:
    """Judge training and test rows as the GenRM builds them at run time (reward/judge.py): the row's
    question with its image marked, the default template (`build_judge_prompt`) through the GenRM's `JudgePrompt`, the
    image pads expanded; the target is `verdict_text(rule says correct)` then EOS."""

    def __init__(self, enc: Encoder, policy, seed: int) -> None:
        from yatt_hpc.rollout.hf_engine import HFEngine

        self.enc, self.seed = enc, seed
        self.engine = HFEngine(policy, stop_token_ids=list(enc.tok.eos_ids), max_batch_size=256)
        self.digit_ids = [enc.tok.encode(str(d))[0] for d in range(1, 5)]
        self.judge_prompt = JudgePrompt(enc.tok)

    def prompt(self, row: dict, response: str) -> list[int]:
        question = mark_images(row["prompt"], len(row["images"]))
        ids = self.judge_prompt.ids(question, response)  # the GenRM's own encoder of its default template
        return self.enc.proc.expand(ids, [decode_rgb(b).size for b in row["images"]])

    def policy_samples(self, rows: list[dict], seed: int) -> list[str]:
        """One response per row as the demo's rollout samples it (rollout.temperature, max_new_tokens)."""
        requests = [GenerationRequest(sample_id=k, prompt_ids=np.asarray(self.enc.prompt(r["prompt"], r["images"])),
                                      max_new_tokens=DEMO_MAX_NEW_TOKENS, temperature=DEMO_TEMPERATURE,
                                      seed=seed * 100_003 + k, images=tuple(r["images"]))
                    for k, r in enumerate(rows)]
        return [self.enc.tok.decode(got.response_ids.tolist()) for got in self.engine.generate(requests)]

    def responses(self, rows: list[dict], rng: random.Random, policy_fraction: float, seed: int) -> list[str]:
        """Per row: a policy sample (`policy_fraction`), else the right count or a wrong digit 1-4, half each."""
        kinds = [rng.random() for _ in rows]
        sampled = [r for r, u in zip(rows, kinds) if u < policy_fraction]
        drawn = iter(self.policy_samples(sampled, seed) if sampled else [])
        out = []
        for row, u in zip(rows, kinds):
            if u < policy_fraction:
                out.append(next(drawn))
            elif rng.random() < 0.5:
                out.append(row["answer"])
            else:
                out.append(rng.choice([d for d in "1234" if d != row["answer"]]))
        return out

    def batch(self, rows: list[dict], responses: list[str]):
        """(ids, verdict labels, count labels, pixels, grids, verdict positions). Verdict labels: the verdict
        and EOS. Count labels: the true count where the response begins (the policy's own task, kept so the
        judge does not forget how to count while it learns to compare)."""
        seqs, spans, counts = [], [], []
        for row, response in zip(rows, responses):
            prompt = self.prompt(row, response)
            target = self.enc.tok.encode(verdict_text(rule_score(response, row["answer"]) == 1.0))
            seqs.append(prompt + target + [self.enc.tok.eos_ids[0]])
            spans.append((len(prompt), len(seqs[-1])))
            counts.append(len(self.enc.prompt(row["prompt"], row["images"])))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [self.enc.tok.pad_id] * (width - len(s)) for s in seqs])
        verdict, count = torch.full_like(ids, -100), torch.full_like(ids, -100)
        for k, ((lo, hi), at, row) in enumerate(zip(spans, counts, rows)):
            verdict[k, lo:hi] = ids[k, lo:hi]
            count[k, at] = self.digit_ids[int(row["answer"]) - 1]
        pixels, grids = self.enc.proc.pixel_inputs([decode_rgb(b) for r in rows for b in r["images"]])
        return ids, verdict, count, torch.from_numpy(pixels), torch.from_numpy(grids), [lo for lo, _ in spans]


def balanced_pairs(seed: int, count: int) -> tuple[list[dict], list[str]]:
    """Held-out scenes (another seed, the held-out split), answered right on even rows, a wrong digit on odd."""
    rng = random.Random(f"judge-test:{seed}")
    rows = [shapes_row(seed, i, "heldout") for i in range(count)]
    return rows, [r["answer"] if i % 2 == 0 else rng.choice([d for d in "1234" if d != r["answer"]])
                  for i, r in enumerate(rows)]


@torch.no_grad()
def yes_no_agreement(model, data: JudgeData, rows: list[dict], responses: list[str]) -> dict:
    """Agreement of the first verdict token's yes-vs-no choice with the rule (one forward pass): the
    cheap check made while training; the shipped numbers come from the GenRM itself (`judge_agreement`)."""
    yes, no = data.enc.tok.encode(verdict_text(True))[0], data.enc.tok.encode(verdict_text(False))[0]
    ids, _, _, pixels, grids, at = data.batch(rows, responses)
    logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                   mm_token_type_ids=(ids == IMAGE_PAD_ID).int()).logits
    says = np.array([bool(logits[k, n - 1, yes] > logits[k, n - 1, no]) for k, n in enumerate(at)])
    right = np.array([rule_score(r, row["answer"]) == 1.0 for r, row in zip(responses, rows)])
    return split_agreement(says, right)


def split_agreement(says_yes: np.ndarray, right: np.ndarray) -> dict:
    agree = says_yes == right
    return {"agreement": float(agree.mean()), "balanced_agreement": float((agree[right].mean() + agree[~right].mean()) / 2),
            "agreement_on_right": float(agree[right].mean()), "agreement_on_wrong": float(agree[~right].mean()),
            "yes_rate": float(says_yes.mean()), "right_fraction": float(right.mean()), "pairs": int(len(right))}


def build_judge(enc: Encoder, policy, args) -> tuple[torch.nn.Module, dict]:
    """A copy of the policy supervised on the judge prompt to say yes/no as the rule would, with warmup +
    cosine lr; the held-out balanced agreement is checked every `--judge-eval-every` batches and the best
    checkpoint kept. Returns the judge and its training curve."""
    data = JudgeData(enc, policy, args.seed)
    model = copy.deepcopy(policy)
    model.train()
    test_rows, test_responses = balanced_pairs(args.seed + 1, args.judge_eval_rows)
    rng, train_seed = random.Random(f"judge:{args.seed}"), args.seed + JUDGE_TRAIN_SEED_OFFSET
    opt = torch.optim.AdamW(model.parameters(), lr=args.judge_lr)
    warmup, steps = args.judge_warmup, args.judge_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                              0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    best, best_step, best_state, curve = -1.0, 0, None, []
    start = time.perf_counter()
    for step in range(steps):
        rows = examples(train_seed, step * args.batch, args.batch)
        ids, verdict, count, pixels, grids, _ = data.batch(rows, data.responses(rows, rng, args.judge_policy_fraction,
                                                                                 step))
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                       mm_token_type_ids=(ids == IMAGE_PAD_ID).int()).logits[:, :-1].float()
        flat = logits.reshape(-1, logits.shape[-1])
        loss_verdict = torch.nn.functional.cross_entropy(flat, verdict[:, 1:].reshape(-1))
        loss_count = torch.nn.functional.cross_entropy(flat, count[:, 1:].reshape(-1))
        loss = loss_verdict + args.judge_count_weight * loss_count
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % args.judge_eval_every == 0 or step == steps - 1:
            model.eval()
            got = yes_no_agreement(model, data, test_rows, test_responses)
            model.train()
            curve.append({"step": step + 1, "loss_verdict": round(loss_verdict.item(), 4),
                          "loss_count": round(loss_count.item(), 4)} | {k: round(v, 4) for k, v in got.items()})
            if got["balanced_agreement"] > best:
                best, best_step, best_state = got["balanced_agreement"], step + 1, copy.deepcopy(model.state_dict())
            print(f"judge step {step + 1:4d} loss {loss_verdict.item():.4f} count {loss_count.item():.4f} "
                  f"agree {got['balanced_agreement']:.3f} (right {got['agreement_on_right']:.3f} wrong "
                  f"{got['agreement_on_wrong']:.3f} yes {got['yes_rate']:.3f}) ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    data.engine.shutdown()
    model.load_state_dict(best_state)
    model.eval()
    return model, {"curve": curve, "best_balanced_agreement": best, "best_step": best_step}


def judge_agreement(model, enc: Encoder, rows: list[dict], responses: list[str]) -> dict:
    """Agreement with the rule of the verdicts the GenRM (reward/judge.py, greedy, 4 tokens) gets from
    `model`, and the share of unparseable ones."""
    from yatt_hpc.rollout.hf_engine import HFEngine

    judge = GenRMJudge(HFEngine(model, stop_token_ids=list(enc.tok.eos_ids)), enc.tok,
                       max_positions=int(model.config.get_text_config().max_position_embeddings),
                       images=enc.proc, max_new_tokens=4)
    scores = judge.score([(r["prompt"], t) for r, t in zip(rows, responses)], images=[tuple(r["images"]) for r in rows])
    judge.shutdown()
    right = np.array([rule_score(t, r["answer"]) == 1.0 for r, t in zip(rows, responses)])
    out = split_agreement(np.array([s is not None and s >= 0.5 for s in scores]), right)
    return out | {"parse_fail_rate": float(np.mean([s is None for s in scores]))}


def measure_judge(model, policy, enc: Encoder, seed: int) -> dict:
    """The judge through the GenRM on unseen scenes: balanced (right / wrong digit) pairs, and the policy's
    own samples at the demo's temperature (what it grades in the run)."""
    rows, responses = balanced_pairs(seed + 1, 256)
    sampler = JudgeData(enc, policy, seed)
    prompts = [shapes_row(seed + 1, i, "heldout") for i in range(256, 384)]
    sampled_rows = [r for r in prompts for _ in range(4)]
    samples = sampler.policy_samples(sampled_rows, seed + 1)
    sampler.engine.shutdown()
    return {"balanced": judge_agreement(model, enc, rows, responses),
            "policy_samples": judge_agreement(model, enc, sampled_rows, samples)}


def load_policy(path: Path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("models/demo_vlm"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy-steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clean-fraction", type=float, default=1.0)
    p.add_argument("--judge-only", action="store_true",
                   help="load the policy from --out/policy and build only the judge (the policy is not rewritten)")
    p.add_argument("--no-judge", action="store_true", help="build only the policy")
    p.add_argument("--judge-steps", type=int, default=3000)
    p.add_argument("--judge-lr", type=float, default=1e-3)
    p.add_argument("--judge-warmup", type=int, default=100)
    p.add_argument("--judge-eval-every", type=int, default=100)
    p.add_argument("--judge-eval-rows", type=int, default=256)
    p.add_argument("--judge-policy-fraction", type=float, default=0.4,
                   help="share of judge examples that are policy samples at the demo's temperature")
    p.add_argument("--judge-count-weight", type=float, default=1.0,
                   help="weight of the auxiliary loss on the true count where the response begins")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    scratch = args.out / "policy"
    if args.judge_only:
        enc, policy = Encoder(scratch), load_policy(scratch)
    else:
        save_tiny_vlm(tiny_qwen2_vl(seed=args.seed, **POLICY_SHAPE), scratch)  # tokenizer + processor files first
        enc = Encoder(scratch)
        policy = build_policy(enc, args)
        metrics = measure_policy(policy, enc, args.seed)
        print("policy", json.dumps(metrics), flush=True)
        save_tiny_vlm(policy, scratch)
        (scratch / "metrics.json").write_text(json.dumps(metrics | {"args": policy_args(args)}, indent=2) + "\n")
    if args.no_judge:
        return
    start = time.perf_counter()
    judge, training = build_judge(enc, policy, args)
    seconds = time.perf_counter() - start
    metrics = measure_judge(judge, policy, enc, args.seed)
    print("judge", json.dumps(metrics), flush=True)
    save_tiny_vlm(judge, args.out / "judge")
    (args.out / "judge" / "metrics.json").write_text(json.dumps(
        metrics | {"training": training, "build_seconds": round(seconds, 1),
                   "args": {k: str(v) for k, v in vars(args).items()}}, indent=2) + "\n")


def policy_args(args: argparse.Namespace) -> dict:
    """The arguments the policy depends on (its metrics.json keeps the keys it always had)."""
    return {k: str(v) for k, v in vars(args).items() if k in ("out", "seed", "policy_steps", "batch", "lr",
                                                             "clean_fraction")}


if __name__ == "__main__":
    main()
