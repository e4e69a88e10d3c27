"""runtime/allocator.py: a rank keeps the host memory a step frees for the next step."""
from __future__ import annotations

import subprocess
import sys

from yatt_hpc.runtime.allocator import keep_freed_memory

# Each round allocates and writes 8 blocks of 6 MiB, then frees them all; the minor page faults of
# rounds 2-5 are counted. glibc by default trims the heap's free top (past its adapted trim threshold
# of 12 MiB) after each round, so every round faults part of its pages in again (~4k a round here).
ROUNDS = """
import resource, sys
import numpy as np
from yatt_hpc.runtime.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory().startswith("freed memory kept"), keep_freed_memory()
faults = 0
for round in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(6 << 17) for _ in range(8)]  # 6 MiB of float64 each, every page written
    del blocks
    if round:
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True)
    return int(done.stdout.strip())


def test_a_step_reuses_what_the_last_one_freed_without_faulting_it_in_again():
    default, kept = _faults("default"), _faults("keep")
    assert default > 4 * 1000  # the rounds faulted (part of) their blocks in again
    assert kept < default / 20, (kept, default)


def test_the_users_own_glibc_variables_are_left_alone():
    said = keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert said == "malloc thresholds left as the environment sets them"
