"""Comparing two policy updates that should be the same (a shared-prompt forward against the padded
rows): what the two paths may differ in is the gradient, in its last bits, never the optimizer.

AdamW's step is lr * m / (sqrt(v) + eps). With the trainer's eps (1e-8), an entry whose gradient is at
rounding level in both runs moves by up to lr either way on those last bits (a CI run saw 1.1e-4 apart
after two lr=1e-3 steps), so comparing the parameters after AdamW is ill-conditioned. With eps far
above every gradient entry the step is ~lr * m, linear in the gradient, and the two updates can be
compared closely, each relative to how far the update moved that parameter. A move is read as the
difference of two stored float32 parameters, so it is known only to about one unit in the last place of
the parameter's own size: a tensor that moved by a few hundred of those units (a vision block's ~7e-7
move of weights ~1e-2, where one unit is ~1e-9) is compared to that resolution, not below it."""
from __future__ import annotations

import torch


def linear_steps(policy):
    """`policy` with AdamW's eps at 1.0: its steps ~lr * (running mean of the gradient)."""
    policy.optimizer.param_groups[0]["eps"] = 1.0
    return policy


def parameters(policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy.model.named_parameters()}


def assert_same_update(ours, theirs, before: dict[str, torch.Tensor], rel: float = 1e-3) -> None:
    """Each parameter of `ours` moved from `before` as `theirs` did, within `rel` of the largest move in
    that tensor; one that `theirs` left where it was (frozen, or a zero gradient) did not move in ours."""
    mine, other = dict(ours.model.named_parameters()), dict(theirs.model.named_parameters())
    trained = 0
    for name, start in before.items():
        moved, moved_too = other[name].detach() - start, mine[name].detach() - start
        scale = float(moved.abs().max())
        if scale == 0:
            assert not moved_too.any(), f"{name} moved in one update only"
            continue
        trained += 1
        resolution = 2 * torch.finfo(start.dtype).eps * float(start.abs().max())  # of one stored move
        torch.testing.assert_close(moved_too, moved, atol=rel * scale + resolution, rtol=rel, msg=name)
    assert trained, "no parameter moved: the updates would compare nothing"
