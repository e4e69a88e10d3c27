"""The trainer's AdamW: torch's own AdamW update, without ``torch.optim.Optimizer`` around it.

    optimizer = AdamW(params, lr=3e-4, weight_decay=0.0)
    optimizer.zero_grad(set_to_none=True); loss.backward(); optimizer.step()
    sd = optimizer.state_dict(); optimizer.load_state_dict(sd)       # torch.optim's state_dict layout

Why not ``torch.optim.AdamW``: every ``torch.optim.Optimizer`` method that touches its parameters is
wrapped in ``torch._disable_dynamo``, which imports ``torch._dynamo`` on its first call (the
constructor's ``add_param_group`` is the first). That import is ~1.5 s of CPU on each trainer rank,
before the first step, and it is never used: the trainer compiles nothing. Measured here on the
demo's 2 trainer ranks sharing 2 cores: the whole run's start -> step 1 falls by ~1 s with it gone.

What runs is torch's: ``torch.optim.adam.adam`` with ``decoupled_weight_decay=True`` (which is what
``torch.optim.AdamW`` calls), fused where torch has a fused kernel for every parameter's device and
dtype (CPU and CUDA floats: one kernel over all tensors instead of ~10 per tensor; torch's default
elsewhere), and the same
state per parameter (``step``, ``exp_avg``, ``exp_avg_sq``) under the same ``state_dict`` layout, so
``yatt_hpc.ckpt.optim`` saves and restores it unchanged and checkpoints written with
``torch.optim.AdamW`` load. tests/unit/test_adamw.py holds it to ``torch.optim.AdamW(fused=...)``
bit for bit, across a save and a load, and checks ``torch._dynamo`` stays unloaded.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.adam import adam
from torch.optim.optimizer import _get_fused_kernels_supported_devices

_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _fused_ok(params: list[torch.Tensor]) -> bool:
    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) and not torch.is_complex(p) for p in params)


class AdamW:
    """AdamW (decoupled weight decay) over one group of parameters; no amsgrad, no maximize."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        params = list(params)
        if not params:
            raise ValueError("AdamW got an empty parameter list")
        self.param_groups: list[dict[str, Any]] = [
            {"params": params, "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
             "fused": _fused_ok(params)}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._pre_hooks: list[Callable] = []

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def register_step_pre_hook(self, hook: Callable) -> None:
        """`hook(optimizer, args, kwargs)` before every step, as torch.optim calls its pre-hooks."""
        self._pre_hooks.append(hook)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def _new_state(self, p: torch.Tensor, fused: bool) -> dict[str, torch.Tensor]:
        # torch keeps `step` on the parameter's device for its fused kernel, on the CPU otherwise
        step = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
        return {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    @torch.no_grad()
    def step(self) -> None:
        for hook in self._pre_hooks:
            hook(self, (), {})
        group = self.param_groups[0]
        params = [p for p in self.params if p.grad is not None]
        if not params:
            return
        for p in params:  # a new parameter's state only: setdefault would build (and drop) zeros every step
            if p not in self.state:
                self.state[p] = self._new_state(p, group["fused"])
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [], [s["step"] for s in states], fused=group["fused"] or None,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    # ------------------------------------------------------------------ torch.optim's state_dict layout

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {key: tensor}}, "param_groups": [{..., "params": [index, ...]}]}`` (references)."""
        index = {p: i for i, p in enumerate(self.params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": {index[p]: dict(s) for p, s in self.state.items()},
                "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The inverse of ``state_dict``, also for one ``torch.optim.AdamW`` wrote; state moves to each
        parameter's device and dtype (``step`` stays float32, on the device only for the fused kernel)."""
        groups = sd["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"the saved optimizer has {[len(g['params']) for g in groups]} parameters per group; "
                             f"this one has one group of {len(self.params)}")
        saved = groups[0]
        live = self.param_groups[0]
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in saved:
                live[key] = tuple(saved[key]) if key == "betas" else saved[key]
        state = {}
        for slot, values in sd["state"].items():
            p = self.params[saved["params"].index(int(slot))]
            missing = set(_STATE_KEYS) - set(values)
            if missing:
                raise ValueError(f"saved optimizer state for parameter {slot} lacks {sorted(missing)}")
            step_device = p.device if live["fused"] else "cpu"
            # a copy: the fused kernel increments `step` in place, once per parameter that holds it
            state[p] = {"step": torch.as_tensor(values["step"], dtype=torch.float32).to(step_device).reshape(()).clone(),
                        "exp_avg": values["exp_avg"].to(device=p.device, dtype=p.dtype),
                        "exp_avg_sq": values["exp_avg_sq"].to(device=p.device, dtype=p.dtype)}
        self.state = state
