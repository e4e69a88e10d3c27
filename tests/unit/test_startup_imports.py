"""Rank start-up: the trainer imports Megatron-Core without torch.compile's machinery (yatt_hpc/train/mcore.py)."""
import subprocess
import sys

from tests.conftest import REPO


def test_the_trainer_modules_import_megatron_without_loading_dynamo_or_inductor():
    code = ("import sys; import yatt_hpc.roles.trainer, yatt_hpc.train.policy, yatt_hpc.train.megatron_model; "
            "import megatron.core.jit as jit, torch; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules)); "
            "print(jit.jit_fuser is torch.compile)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded, fuser_is_compile = out.stdout.split("\n")[:2]
    assert loaded == "[]", f"imported at start-up: {loaded}"
    assert fuser_is_compile == "False", "megatron's jit_fuser is the deferring decorator"


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
