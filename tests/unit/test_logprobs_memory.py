"""Log-probs at a real vocab size (Qwen2's 151,936) need the gradient and a few chunks, not [B, T, V] copies.

    .venv/bin/python -m pytest tests/unit/test_logprobs_memory.py -q -s     # -s prints the measurements

One fresh CPU process builds fp32 logits [2, 128, 151936] (148 MiB), then runs forward + backward and
reads the peak resident set (VmHWM, reset through /proc/self/clear_refs where the kernel allows it, so
the peak is this step's) against the resident set just before. The gradient itself is one logits-sized
tensor; everything beyond it must be chunk scratch. glibc's mmap threshold is pinned at 1 MiB so that
freed chunks go back to the kernel at once: the number is then what the function keeps live (measured
here: the gradient + 19 MiB with 16-row chunks), not what the allocator chose to keep.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO

VOCAB = 151_936
CHUNK_ROWS = 16
PATCHED_CHUNK_BYTES = 16 * 2**20
SLACK = 32 * 2**20  # allocator rounding, the [rows] statistics, the targets

PROBE = f"""
import json, sys
import torch
torch.set_num_threads(1)
import yatt_hpc.train.logprobs as lp

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then VmHWM may still hold an earlier peak: the measurement only errs high

generator = torch.Generator().manual_seed(0)
warm = torch.randn(2, 3, 50, generator=generator, requires_grad=True)  # first-call allocations
torch.autograd.grad(lp.token_logprobs_and_entropy(warm, torch.zeros(2, 3, dtype=torch.long)), warm,
                    (torch.ones(2, 3), torch.ones(2, 3)))
logits = torch.randn(2, 128, {VOCAB}, generator=generator).requires_grad_()
targets = torch.randint(0, {VOCAB}, (2, 128), generator=generator)
upstream = (torch.randn(2, 128, generator=generator), torch.randn(2, 128, generator=generator))

def extra_bytes(**kwargs):
    reset_peak()
    before = status("VmRSS")
    outputs = lp.token_logprobs_and_entropy(logits, targets, temperature=0.7, **kwargs)
    (grad,) = torch.autograd.grad(outputs, logits, upstream)
    peak = status("VmHWM")
    assert grad.shape == logits.shape and torch.isfinite(grad).all()
    del outputs, grad
    return peak - before

report = {{"logits_bytes": logits.numel() * 4, "chunk_rows": extra_bytes(chunk_tokens={CHUNK_ROWS})}}
lp.CHUNK_BYTES = {PATCHED_CHUNK_BYTES}
report["chunk_bytes"] = extra_bytes()
print(json.dumps(report))
"""


def test_forward_and_backward_at_vocab_151936_need_the_gradient_plus_bounded_chunks():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    size = report["logits_bytes"]
    print(f"\nlogits {size / 2**20:.0f} MiB; peak extra with {CHUNK_ROWS}-row chunks "
          f"{report['chunk_rows'] / 2**20:.0f} MiB ({report['chunk_rows'] / size:.2f}x), with "
          f"CHUNK_BYTES={PATCHED_CHUNK_BYTES >> 20} MiB {report['chunk_bytes'] / 2**20:.0f} MiB "
          f"({report['chunk_bytes'] / size:.2f}x)")
    # the gradient, plus forward/backward scratch of about three fp32 chunks
    row_chunk = CHUNK_ROWS * VOCAB * 4
    assert report["chunk_rows"] <= size + 3 * row_chunk + SLACK
    byte_chunk = PATCHED_CHUNK_BYTES // (4 * VOCAB) * VOCAB * 4
    assert report["chunk_bytes"] <= size + 3 * byte_chunk + SLACK
