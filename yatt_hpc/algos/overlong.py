"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) as a reward term.

    penalty = overlong_penalty(response_lens, max_len=1024, buffer_len=256, factor=1.0)   # <= 0 per sample

A response longer than max_len - buffer_len loses (len - (max_len - buffer_len)) / buffer_len x factor,
so a response at the cap loses `factor` (verl `reward_model.overlong_buffer` {len, penalty_factor},
TRL `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`).
"""
from __future__ import annotations

import numpy as np


def overlong_penalty(response_lens: np.ndarray, *, max_len: int, buffer_len: int, factor: float) -> np.ndarray:
    expected = max_len - buffer_len
    over = np.maximum(np.asarray(response_lens, np.float64) - expected, 0.0)
    return (-over / buffer_len * factor).astype(np.float32)
