"""A small random GRPO batch for the policy-update tests (CPU and CUDA)."""
from __future__ import annotations

import numpy as np

from yatt_hpc.batch import SampleBatch


def random_update_batch(vocab: int, samples: int = 8, seed: int = 0) -> tuple[SampleBatch, np.ndarray]:
    """`samples` sequences of random prompt/response tokens with flat old logprobs, and +-1 advantages."""
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(4, 10, samples), rng.integers(2, 12, samples)
    batch = SampleBatch(
        sample_id=np.arange(samples, dtype=np.int64), prompt_id=np.arange(samples, dtype=np.int64) // 4,
        prompt_len=plen.astype(np.int32), prompt_tokens=rng.integers(3, vocab, plen.sum()).astype(np.int32),
        response_len=rlen.astype(np.int32), response_tokens=rng.integers(3, vocab, rlen.sum()).astype(np.int32),
        logprobs=np.full(rlen.sum(), -2.0, np.float32))
    return batch, np.where(np.arange(samples) % 2 == 0, 1.0, -1.0).astype(np.float32)
