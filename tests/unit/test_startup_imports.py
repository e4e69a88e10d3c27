"""Rank start-up: what each group's modules import (four ranks share two cores while they start).

The trainer imports Megatron-Core without torch.compile's machinery (yatt_hpc/train/mcore.py) or
transformers' model-loading stack (transformers.activations: ~2 s a rank); a GenRM rank that scores by
rule only imports neither torch nor transformers (~3 s a rank).
"""
import subprocess
import sys

from tests.conftest import REPO


def test_the_trainer_modules_import_megatron_without_loading_dynamo_or_inductor():
    code = ("import sys; import yatt_hpc.roles.trainer, yatt_hpc.train.policy, yatt_hpc.train.megatron_model; "
            "import megatron.core.jit as jit, torch; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'transformers.activations') "
            "if m in sys.modules)); "
            "print(jit.jit_fuser is torch.compile)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded, fuser_is_compile = out.stdout.split("\n")[:2]
    assert loaded == "[]", f"imported at start-up: {loaded}"
    assert fuser_is_compile == "False", "megatron's jit_fuser is the deferring decorator"


def test_a_genrm_rank_module_set_imports_neither_torch_nor_transformers():
    """What a rule-only GenRM rank loads: the worker, the loop and the GenRM controller's modules (the judge,
    and with it torch, is imported only when reward.mode names a judge; tests/mpi/test_grpo_run.py checks a
    real rule-only rank's log)."""
    code = ("import sys; import yatt_hpc.runtime.worker, yatt_hpc.runtime.loop, yatt_hpc.roles.genrm; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"imported by a GenRM rank's modules: {out.stdout.strip()}"


def test_the_deferred_decorator_compiles_once_on_the_first_call_with_the_same_options():
    from yatt_hpc.train.mcore import _deferred_compile

    calls = []

    def real(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = _deferred_compile(real)

    @compile_later
    def plain(x):
        return x + 1

    @compile_later(mode="max-autotune")
    def tuned(x):
        return x * 2

    assert calls == [], "nothing is compiled at decoration"
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert tuned(3) == ("compiled", 6)
    assert calls == [("plain", {}), ("tuned", {"mode": "max-autotune"})], "once each, with the decorator's options"
    assert plain.__name__ == "plain"
