"""fp32 matrix products on the CPU through oneDNN instead of MKL, where that is faster.

    if runs_on_onednn(x, weight):                  # fp32, on the CPU, a weight of ONEDNN_MIN_WEIGHT and up
        y = onednn_linear(x, weight, bias)         # x @ weight.T + bias, no autograd

torch sends an fp32 `F.linear` / `torch.matmul` to MKL's sgemm (its CPU BLAS) and a bf16 one to oneDNN. On
the AMD EPYC (Zen 4, AVX-512) machine here MKL streams a decode step's weights at 4-5 GB/s and oneDNN at
10-16 GB/s. At Qwen2.5-0.5B's shape, 16 rows (a rollout's decode step), median of 10 calls, 2 threads:

| weight | MKL | oneDNN |
|---|---|---|
| output projection 151,936 x 896 | 100-145 ms | 43 ms |
| MLP 4,864 x 896 | 2.1-4.5 ms | 1.2-2.1 ms |
| 896 x 896 | 0.24 ms | 0.21 ms |
| 64 x 64 | 8 us | 26 us |

and at 322 rows (a training micro-batch's forward) 1.2-1.7x as fast on every projection but the smallest. On an
Intel Xeon with AMX (Sapphire Rapids class, 2 threads) MKL does better and the gap is the output projection's:
95 against 40 ms at 16 rows and 366 against 320 ms at 322, the MLP and attention projections within 10% either way.
Below `ONEDNN_MIN_WEIGHT` weights MKL is the faster. The op is `torch.ops.mkldnn._linear_pointwise`, the one
torch's own CPU compiler emits for a linear layer, given the layer's dense weight as it is (no packed copy:
a weight sync's in-place writes reach it). It has no backward: the engine calls it in inference mode, the
trainer for its layers' forward only (`train/cpu_compat.py`). It is fp32 throughout in its own summation
order: on [322, 896] x [896, 151,936] within 3e-4 of MKL's result, and within 1.4e-4 of the float64 product
where MKL is within 7e-5.
"""
from __future__ import annotations

import functools

import torch

ONEDNN_MIN_WEIGHT = 1 << 18
"""Weights (a 512 x 512 layer) at and past which oneDNN's matmul is the faster one for an fp32 projection."""


@functools.cache
def onednn_linear_available() -> bool:
    """This torch build has oneDNN's linear op and it computes a product here."""
    try:
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 3), torch.ones(2, 3), None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 2), 3.0)))


def runs_on_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`x @ weight.T` goes through oneDNN: both fp32 on the CPU, the weight large enough, the op available."""
    return (x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
            and weight.numel() >= ONEDNN_MIN_WEIGHT and onednn_linear_available())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` over x's last dimension, through oneDNN (no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
