"""pass@k and mean@k from n >= k samples of a prompt.

    pass_at_k(n=8, c=3, k=4)     # 1 - C(n - c, k) / C(n, k): the unbiased estimator (Chen et al. 2021)

The probability that at least one of k samples drawn without replacement from the n is correct,
averaged over the prompts (slime and NeMo-RL `pass@k`; verl's `best@N` is a bootstrap of it, biased low).
mean@k is the mean reward of the samples (each sample is a draw of the k; its expectation does not depend on k).
"""
from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k), as a product (no large binomials): 1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
