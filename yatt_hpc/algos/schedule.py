"""The learning rate of each RL step: linear warmup, then constant, linear or cosine decay to a floor.

    lr = learning_rate(step, base=1e-6, warmup_steps=10, decay="cosine", decay_steps=200, min_lr=1e-7)

`step` counts RL steps from 0; every optimizer step of an RL step (its mini-batches and epochs)
uses that step's rate, as verl's scheduler (stepped once per RL step). Warmup: base x (step + 1) /
warmup_steps, so the first step already trains (Megatron's convention; transformers' schedulers give
step 0 a rate of 0). Decay runs over steps warmup_steps .. decay_steps, then holds min_lr. A pure
function of the step: a resumed run gets the same rate without any state in the checkpoint.
"""
from __future__ import annotations

import math

DECAYS = ("constant", "linear", "cosine")


def learning_rate(step: int, *, base: float, warmup_steps: int = 0, decay: str = "constant",
                  decay_steps: int = 0, min_lr: float = 0.0) -> float:
    """The rate of RL step `step` (0-based). constant: base after warmup; linear and cosine (Loshchilov &
    Hutter 2017) go from base to min_lr over decay_steps (verl `lr_scheduler_type`, transformers'
    `lr_scheduler_type`, both with `min_lr` / `min_lr_ratio`)."""
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if decay == "constant":
        return base
    span = max(decay_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    if decay == "linear":
        return min_lr + (base - min_lr) * (1.0 - progress)
    if decay == "cosine":
        return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay {decay!r}; choose one of {', '.join(DECAYS)}")
