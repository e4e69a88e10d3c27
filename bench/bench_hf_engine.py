"""Throughput of the HF rollout engine on CPU, and what per-request seeding costs.

Run: .venv/bin/python bench/bench_hf_engine.py [--requests 32] [--new-tokens 32] [--repeats 5]

Prints, for tiny random models built in a temp dir (nothing downloaded):
  1. HFEngine.generate (per-request seeds) vs transformers' model.generate(do_sample=True), which draws
     from the process-global RNG and so cannot make a sample independent of its batch;
  2. one sampling step alone, three ways: our pre-drawn per-request uniforms + inverse CDF, a per-row
     torch.multinomial with a per-row torch.Generator, and one batched torch.multinomial (global RNG).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from yatt_hpc.rollout import GenerationRequest, build_engine
from yatt_hpc.rollout.sampling import sample_next_tokens

MODELS = {
    "gpt2 h32 L2 V64": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2)),
    "llama h128 L4 V512": lambda: LlamaForCausalLM(
        LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    ),
}


def _median_seconds(*fns, repeats: int) -> list[float]:
    """Median wall time of each fn; the fns take turns so a change in machine load hits them alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return [statistics.median(bucket) for bucket in times]


def bench_generate(name: str, build, requests: int, new_tokens: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        build().save_pretrained(model_dir, safe_serialization=True)
        batch = [
            GenerationRequest(sample_id=i, prompt_ids=[3 + (i + j) % 50 for j in range(4 + i % 5)],
                              max_new_tokens=new_tokens, seed=i)
            for i in range(requests)
        ]
        engine = build_engine("hf", model_dir, device="cpu", tp_size=1, seed=0, stop_token_ids=[])
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + r.prompt_ids.tolist() for r in batch])
        mask = (torch.arange(width)[None, :] >= (width - torch.tensor([len(r.prompt_ids) for r in batch]))[:, None])

        def hf_generate():
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0, output_scores=True,
                               return_dict_in_generate=True)

        ours, baseline = _median_seconds(lambda: engine.generate(batch), hf_generate, repeats=repeats)
        engine.shutdown()
    tokens = requests * new_tokens
    print(f"{name}: {requests} requests x {new_tokens} new tokens")
    print(f"  HFEngine.generate (per-request seeds)  {ours * 1e3:7.1f} ms  {tokens / ours:8.0f} tok/s")
    print(f"  model.generate (global RNG, scores)    {baseline * 1e3:7.1f} ms  {tokens / baseline:8.0f} tok/s")


def bench_sampling_step(rows: int, vocab: int, repeats: int) -> None:
    logits = torch.randn(rows, vocab)
    temperature, top_p = torch.ones(rows), torch.ones(rows)
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]

    def ours():
        sample_next_tokens(logits, temperature, top_p, torch.rand(rows))

    def per_row_generator():
        probs = torch.softmax(logits, dim=-1)
        torch.stack([torch.multinomial(probs[i], 1, generator=generators[i]) for i in range(rows)])

    def batched_global_rng():
        torch.multinomial(torch.softmax(logits, dim=-1), 1)

    def draw_uniforms():
        [torch.rand(32, generator=torch.Generator().manual_seed(i)) for i in range(rows)]

    labels = ["pre-drawn uniforms + inverse CDF (ours)", "per-row multinomial, per-row Generator",
              "batched multinomial, global RNG"]
    *steps, seeds_cost = _median_seconds(ours, per_row_generator, batched_global_rng, draw_uniforms,
                                         repeats=repeats * 4)
    print(f"one sampling step, {rows} rows x vocab {vocab}:")
    for label, seconds in zip(labels, steps):
        print(f"  {label:42s} {seconds * 1e6:8.0f} us")
    print(f"  drawing {rows} requests' uniforms once per generate call: {seeds_cost * 1e6:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, build in MODELS.items():
        bench_generate(name, build, args.requests, args.new_tokens, args.repeats)
    for vocab in (64, 151_936):
        bench_sampling_step(args.requests, vocab, args.repeats)


if __name__ == "__main__":
    main()
