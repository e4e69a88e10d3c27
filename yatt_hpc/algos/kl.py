"""KL(pi || pi_ref) estimators per token, and the adaptive KL coefficient.

    kl_tok = kl_estimate("k3", logp, ref_logp)
    ctl = AdaptiveKL(coef=1e-3, target=0.01, horizon=10000); ctl.update(observed_kl, n_samples)

With d = log pi - log pi_ref on tokens sampled from pi (Schulman 2020, "Approximating KL divergence"):
k1 = d (unbiased, high variance; verl `kl`/`k1`, the default of slime, OpenRLHF and AReaL),
k2 = d^2 / 2 (verl `mse`/`k2`), k3 = exp(-d) + d - 1 (unbiased, never negative; verl `low_var_kl`/`k3`,
clamped to [-10, 10] like verl's, the default of verl, NeMo-RL and TRL), and k3+ (verl `k3+`): k3's value
with k2's gradient (straight-through), whose gradient is unbiased for the KL's gradient as a loss term.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
K3_LIMIT = 10.0


def kl_estimate(kind: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) of `kind` (KL_ESTIMATORS); the gradient flows through `logp`."""
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    k3 = torch.clamp(torch.exp(-d) + d - 1.0, -K3_LIMIT, K3_LIMIT)
    if kind == "k3":
        return k3
    if kind == "k3+":
        k2 = 0.5 * d * d
        return k3.detach() + k2 - k2.detach()
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS)}")


@dataclass
class AdaptiveKL:
    """Ziegler et al. 2019's proportional controller (verl `kl_ctrl.type=adaptive`, OpenRLHF, TRL's PPO):
    after each step, coef *= 1 + clip(observed / target - 1, -0.2, 0.2) * n / horizon, n the step's samples.
    Without a target the coefficient stays fixed."""

    coef: float
    target: float | None
    horizon: int

    def update(self, observed: float, n: int) -> float:
        if self.target is None:
            return self.coef
        error = min(max(observed / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n / self.horizon
        return self.coef
