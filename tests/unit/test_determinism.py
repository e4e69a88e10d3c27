"""Training is bitwise reproducible run to run on CPU with more than one thread, at a real layer shape.

Two fresh processes, two threads each, run the same two GRPO updates of a Qwen2.5-0.5B-shaped policy (two of
its layers, the padded 151,936 vocabulary; tests/programs/update_digest.py) with every trainer default on
(shared-prompt forward, chunked log-probs, micro-batches) and must end with the same parameters and AdamW
moments, bit for bit. At the demo's size no kernel reaches the sizes where PyTorch's CPU kernels go parallel,
so only a shape like this one can show a race (docs/determinism.md lists what was audited).
"""
import json
import subprocess
import sys

from tests.conftest import REPO


def _digest(*flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.programs.update_digest", "--layers", "2", "--threads", "2",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_processes_with_two_threads_train_bitwise_alike_with_shared_prompts():
    first, second = _digest(), _digest()
    differ = sorted(name for name in first["each"] if first["each"][name] != second["each"][name])
    assert not differ, f"{len(differ)} of {len(first['each'])} parameters differ between two runs: {differ[:5]}"
    assert first["moments"] == second["moments"], "AdamW moments differ between two runs"
