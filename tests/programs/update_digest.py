"""One process's GRPO update at a real-size layer shape, digested: what two processes must agree on bitwise.

    python -m tests.programs.update_digest --layers 2 --threads 2 [--padded]

Builds a Qwen2.5-0.5B-shaped Megatron policy (hidden 896, 14 query heads, 2 key/value groups, MLP 4864, the
padded vocabulary of 151,936, tied embeddings) with `--layers` layers and seeded weights, and runs two
`MegatronPolicy.update` steps with the trainer's defaults (shared-prompt forward, chunked log-probs, 8-sample
micro-batches, AdamW) on 4 prompts x 4 samples of seeded tokens. Prints one JSON line: a digest of every
parameter and of every optimizer moment after the steps.

The row counts matter: PyTorch's CPU kernels that add into shared rows with atomics (index_put_ with
accumulate, the backward of advanced indexing) only go parallel above 32,768 elements and with more than one
thread, so a demo-sized model never shows a race that this shape shows on every run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import socket

import numpy as np
import torch

HIDDEN, HEADS, GROUPS, MLP, VOCAB = 896, 14, 2, 4864, 151936


def batch_of(rng: np.random.Generator, prompts: int, samples: int, tokens: int):
    from yatt_hpc.batch import SampleBatch

    prompt = [rng.integers(3, 32000, rng.integers(40, 60)) for _ in range(prompts)]
    order = rng.permutation(np.repeat(np.arange(prompts), samples))  # as the DP balancer leaves them
    lengths = rng.integers(1, tokens + 1, len(order))
    responses = [rng.integers(3, 32000, n) for n in lengths]
    batch = SampleBatch(
        sample_id=np.arange(len(order), dtype=np.int64), prompt_id=order.astype(np.int64),
        prompt_len=np.array([len(prompt[g]) for g in order], np.int32),
        prompt_tokens=np.concatenate([prompt[g] for g in order]).astype(np.int32),
        response_len=lengths.astype(np.int32), response_tokens=np.concatenate(responses).astype(np.int32),
        logprobs=rng.uniform(-12, -10, int(lengths.sum())).astype(np.float32))
    return batch, rng.standard_normal(len(order)).astype(np.float32)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--padded", action="store_true", help="train.share_prompts=false")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import Qwen2Config

    from yatt_hpc.config.schema import TrainConfig
    from yatt_hpc.train import megatron_model as mm
    from yatt_hpc.train.policy import MegatronPolicy

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mm.initialize_model_parallel(0, 1, "127.0.0.1", port, tp_size=1, seed=0)
    config = Qwen2Config(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=args.layers,
                         num_attention_heads=HEADS, num_key_value_heads=GROUPS, vocab_size=VOCAB,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    model = mm.build_gpt_model(config, 1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    policy = MegatronPolicy(model, config, TrainConfig(lr=1e-3, share_prompts=not args.padded),
                            share_prompts=not args.padded)
    rng = np.random.default_rng(7)
    for _ in range(2):
        policy.update(*batch_of(rng, prompts=4, samples=4, tokens=48))
    params = [p for _, p in sorted(model.named_parameters())]
    moments = [s[k] for p in params for k in sorted(policy.optimizer.state[p]) if k != "step"
               for s in [policy.optimizer.state[p]]]
    print(json.dumps({"params": digest(params), "moments": digest(moments),
                      "each": {n: digest([p]) for n, p in sorted(model.named_parameters())}}))
    mm.destroy_model_parallel()


if __name__ == "__main__":
    main()
