"""The trainer's AdamW (yatt_hpc/optim/adamw.py) is torch.optim.AdamW's update without torch.optim's
machinery: bit for bit the same parameters and state, the same checkpoint tensors, and no torch._dynamo."""
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from yatt_hpc.ckpt import load_optimizer_tensors, optimizer_tensors
from yatt_hpc.optim.adamw import AdamW

HYPER = {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.05}


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2), ())]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _run(opt, params, steps: range) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _grads(params, step)
        opt.step()


def _assert_same(ours, ours_params, theirs, theirs_params) -> None:
    for a, b in zip(ours_params, theirs_params, strict=True):
        assert torch.equal(a, b)
        sa, sb = ours.state[a], theirs.state[b]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[key], sb[key]), key
        assert float(sa["step"]) == float(sb["step"])


def test_the_update_is_torchs_adamw_bit_for_bit():
    ours_params, theirs_params = _params(0), _params(0)
    ours = AdamW(ours_params, **HYPER)
    theirs = torch.optim.AdamW(theirs_params, fused=ours.param_groups[0]["fused"], **HYPER)
    assert ours.param_groups[0]["fused"], "CPU float parameters take torch's fused kernel"
    _run(ours, ours_params, range(6))
    _run(theirs, theirs_params, range(6))
    _assert_same(ours, ours_params, theirs, theirs_params)
    assert not torch.equal(ours_params[0], _params(0)[0]), "the parameters moved"


def test_state_is_built_once_for_each_parameter():
    """A step builds the state of a parameter it has not stepped before and no other (zeros as large as the model,
    twice, thrown away every step: 1 GB of transient and ~0.3 s per step for a real vocabulary's embedding)."""
    params = _params(0)
    opt = AdamW(params, **HYPER)
    built = []
    real = opt._new_state
    opt._new_state = lambda p, fused: (built.append(p), real(p, fused))[1]
    _run(opt, params, range(3))
    assert len(built) == len(params) and {id(p) for p in built} == {id(p) for p in params}


def test_a_parameter_without_a_gradient_is_left_alone_and_has_no_state():
    params = _params(1)
    opt = AdamW(params, **HYPER)
    before = params[1].detach().clone()
    _grads(params, 0)
    params[1].grad = None
    opt.step()
    assert torch.equal(params[1], before) and params[1] not in opt.state
    assert all(float(opt.state[p]["step"]) == 1 for p in params if p is not params[1])


def test_a_checkpoint_written_from_torchs_adamw_resumes_here_exactly():
    """Saved through yatt_hpc.ckpt.optim from torch.optim.AdamW after 3 steps, loaded into ours: 3 more
    steps give what torch's own 6 give; ours saved and loaded again continues the same way."""
    named = lambda ps: [(f"p{i}", p) for i, p in enumerate(ps)]  # noqa: E731
    theirs_params = _params(2)
    theirs = torch.optim.AdamW(theirs_params, fused=True, **HYPER)
    _run(theirs, theirs_params, range(3))
    tensors, meta = optimizer_tensors(theirs, named(theirs_params))

    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in theirs_params]
    ours = AdamW(ours_params, lr=1.0, weight_decay=0.0)  # hyper-parameters come from the checkpoint
    load_optimizer_tensors(ours, named(ours_params), {k: v.clone() for k, v in tensors.items()}, meta)
    assert ours.param_groups[0]["betas"] == HYPER["betas"] and ours.param_groups[0]["lr"] == HYPER["lr"]
    _run(ours, ours_params, range(3, 5))
    _run(theirs, theirs_params, range(3, 5))
    _assert_same(ours, ours_params, theirs, theirs_params)

    again_tensors, again_meta = optimizer_tensors(ours, named(ours_params))
    assert set(again_tensors) == set(tensors)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    twin = AdamW(twin_params, lr=1.0)
    load_optimizer_tensors(twin, named(twin_params), {k: v.clone() for k, v in again_tensors.items()}, again_meta)
    _run(twin, twin_params, range(5, 6))
    _run(theirs, theirs_params, range(5, 6))
    _assert_same(twin, twin_params, theirs, theirs_params)


def test_the_pre_hook_runs_before_the_parameters_change():
    params = _params(3)
    opt = AdamW(params, **HYPER)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append((o is opt, params[0].detach().clone())))
    start = params[0].detach().clone()
    _run(opt, params, range(1))
    assert len(seen) == 1 and seen[0][0] and torch.equal(seen[0][1], start)


def test_a_state_for_another_parameter_count_is_refused():
    opt = AdamW(_params(4), **HYPER)
    sd = opt.state_dict()
    sd["param_groups"][0]["params"] = [0, 1]
    with pytest.raises(ValueError, match="has one group of 4"):
        opt.load_state_dict(sd)


def test_stepping_and_checkpointing_never_import_torch_dynamo():
    code = ("import sys, torch; from yatt_hpc.optim.adamw import AdamW; "
            "p = [torch.nn.Parameter(torch.ones(3))]; o = AdamW(p, lr=0.1); p[0].grad = torch.ones(3); o.step(); "
            "o.load_state_dict(o.state_dict()); o.zero_grad(); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
