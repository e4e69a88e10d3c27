"""runtime/allocator.py: a rank keeps the host memory a step frees for the next step."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


# A block past glibc's 32 MiB mapping ceiling (a real-size vocabulary's logits chunk, an embedding's gradient) is
# mapped per use by default, so each round faults all of its 64 MiB in again; kept, it is reused.
BIG_ROUNDS = ROUNDS.replace("np.ones(6 << 17) for _ in range(8)", "np.ones(8 << 20) for _ in range(1)")


def test_a_block_past_the_mapping_ceiling_is_reused_too():
    default, kept = (int(subprocess.run([sys.executable, "-c", BIG_ROUNDS, mode], capture_output=True, text=True,
                                        check=True).stdout) for mode in ("default", "keep"))
    assert default >= 4 * 32  # 4 rounds x at least 32 faults: a fresh 64 MiB mapping, even in 2 MiB huge pages
    assert kept < default / 20, (kept, default)


def test_the_users_own_glibc_variables_are_left_alone():
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_"):
        assert keep_freed_memory({name: "0"}) == "malloc thresholds left as the environment sets them"


# With the thresholds kept, 48 MiB freed stays resident; `give_back_freed_memory` returns it when the heap holds at
# least what it is asked for, and leaves a smaller free heap alone.
GIVE_BACK = """
import sys
import numpy as np, psutil
from yatt_hpc.runtime.allocator import give_back_freed_memory, keep_freed_memory
keep_freed_memory()
blocks = [np.ones(6 << 17) for _ in range(8)]  # 48 MiB from the heap, every page written
del blocks
rss = psutil.Process().memory_info().rss
small = give_back_freed_memory(at_least=1 << 40)
after_small = psutil.Process().memory_info().rss
freed = give_back_freed_memory(at_least=32 << 20)
print(small, (rss - after_small) >> 20, freed >> 20, (after_small - psutil.Process().memory_info().rss) >> 20)
"""


def test_a_large_free_heap_goes_back_to_the_kernel_and_a_small_one_stays():
    done = subprocess.run([sys.executable, "-c", GIVE_BACK], capture_output=True, text=True, check=True)
    small, kept_mb, freed_mb, returned_mb = map(int, done.stdout.split())
    assert small == 0 and kept_mb < 8  # below the bar: nothing trimmed, the 48 MiB still resident
    assert freed_mb >= 40 and returned_mb >= 40, done.stdout  # past it: the heap's free memory left the process


# A real-size fp32 update frees more than mallopt's largest finite trim threshold (2 GiB) at its heap's top between
# micro-batches: kept, the heap keeps it whatever its size (here 3 GiB, never touched, so never resident), and only
# `give_back_freed_memory` returns it.
HUGE_TOP = """
import numpy as np
from yatt_hpc.runtime.allocator import _heap_bytes, give_back_freed_memory, keep_freed_memory
keep_freed_memory()
block = np.empty(3 << 27)  # 3 GiB of float64 from the heap's top
held = _heap_bytes()
del block
after_free = _heap_bytes()
give_back_freed_memory()
print(held >> 20, after_free >> 20, _heap_bytes() >> 20)
"""


def test_a_free_top_past_2_gib_stays_until_given_back():
    done = subprocess.run([sys.executable, "-c", HUGE_TOP], capture_output=True, text=True, check=True)
    held, after_free, given_back = map(int, done.stdout.split())
    assert held >= 3 << 10 and after_free == held, done.stdout  # free() returned nothing
    assert given_back < 1 << 10, done.stdout  # malloc_trim did


def test_huge_pages_are_asked_for_only_where_the_kernel_gives_them_on_request(tmp_path):
    """`huge_page_environment`: glibc's tunable appended to the user's others under THP `madvise` on glibc 2.35+;
    nothing where THP is `always` or `never`, the file is missing, glibc is older, or the user decides."""
    from yatt_hpc.runtime.allocator import huge_page_environment

    modes = {}
    for mode in ("always [madvise] never", "[always] madvise never", "always madvise [never]"):
        modes[mode] = tmp_path / mode.split("[")[1].split("]")[0]
        modes[mode].write_text(mode + "\n")
    madvise = str(modes["always [madvise] never"])
    got = huge_page_environment({"PATH": "/bin"}, madvise, glibc="2.36")
    assert got == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    got = huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, madvise, glibc="2.36")
    assert got == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert huge_page_environment({}, str(modes["[always] madvise never"]), glibc="2.36") is None
    assert huge_page_environment({}, str(modes["always madvise [never]"]), glibc="2.36") is None
    assert huge_page_environment({}, str(tmp_path / "absent"), glibc="2.36") is None
    assert huge_page_environment({}, madvise, glibc="2.31") is None
    assert huge_page_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, madvise, glibc="2.36") is None
    assert huge_page_environment({"MALLOC_MMAP_MAX_": "0"}, madvise, glibc="2.36") is None


# A rank's program restarts itself once (same pid, same arguments) and then holds its heap in huge pages.
RESTART = """
import ctypes, os, re, sys
print("run", os.getpid(), sys.argv[1:], os.environ.get("GLIBC_TUNABLES"), flush=True)
from yatt_hpc.runtime.allocator import heap_pages, keep_freed_memory, restart_on_huge_pages
restart_on_huge_pages()
keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(64 << 20)
ctypes.memset(block, 1, 64 << 20)  # every page written, in the heap (no block mapped on its own)
huge = int(re.search(r"AnonHugePages:\\s+(\\d+) kB", open("/proc/self/smaps_rollup").read()).group(1))
print("pages:", heap_pages(), huge >= 32 << 10)
"""


def test_a_ranks_program_restarts_itself_onto_huge_pages_where_the_kernel_gives_them():
    from yatt_hpc.runtime.allocator import huge_page_environment

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(RESTART)
        done = subprocess.run([sys.executable, str(program), "--group", "trainer"], capture_output=True, text=True,
                              check=True, env=env)
    lines = done.stdout.splitlines()
    if huge_page_environment(env) is None:  # this kernel or C library has nothing to give: no restart
        assert lines[0].startswith("run") and lines[1] == "pages: heap in the kernel's default pages False", lines
        return
    first, second, heap = lines
    assert first.split()[1] == second.split()[1], "the same process (pid) both times"
    assert first.split()[2:] == ["['--group',", "'trainer']", "None"]
    assert second.split()[2:] == ["['--group',", "'trainer']", "glibc.malloc.hugetlb=1"]
    assert heap == "pages: heap advised onto transparent huge pages (glibc.malloc.hugetlb=1) True", heap


def test_a_peer_in_bench_gets_the_allocator_our_ranks_set_for_themselves():
    from yatt_hpc.runtime.allocator import GLIBC_ENVIRONMENT, huge_page_environment, peer_environment

    env = peer_environment({"PATH": "/bin"})
    assert env.items() >= {"PATH": "/bin", **GLIBC_ENVIRONMENT}.items()
    assert env.get("GLIBC_TUNABLES") == (None if huge_page_environment({"PATH": "/bin"}) is None
                                         else "glibc.malloc.hugetlb=1")
