"""Host memory a step frees stays with the process for the next step (glibc malloc).

    restart_on_huge_pages()        # first thing a rank's program does (runtime/worker.py's __main__)
    kept = keep_freed_memory()     # once per rank, before the first big allocation (runtime/worker.py)
    give_back_freed_memory()       # a large free heap goes back: after start-up and resume (runtime/loop.py),
                                   # when a colocated phase ends (roles/colocation.py)

Why: by default glibc hands a large block (past a threshold that adapts up to 32 MiB) straight back
to the kernel when it is freed, and trims the heap's free top once it passes twice that. A rank that
allocates the same working set every step (a GenRM call's activations and KV cache, a rollout wave's
cache, a training step's activations) then faults every page of it in again, and the kernel zeroes
each one. Measured on B4's colocated GenRM (64 rows a call, two threads): 10-40k minor faults and
0.02-0.2 s of system time a call, the call 0.10-0.11 s and up to 0.3 s when the faults contended;
with the thresholds fixed, ~0 faults after the first step and 0.08-0.09 s a call, and the colocated
demo step ~8% shorter. The cost: a rank's resident memory stays at its peak working set instead of
falling between steps, which every step needs again anyway.

The settings are made with `mallopt` at run time: no block is mapped on its own (`M_MMAP_MAX` 0: a
tensor past glibc's 32 MiB mapping threshold, a real-size vocabulary's logits chunk or an embedding's gradient,
comes from the heap like the rest), and the heap's free top is never returned by `free` (`M_TRIM_THRESHOLD` -1):
only `give_back_freed_memory` returns it, where a rank's working set shrinks for good or another rank needs the
memory (below). A finite threshold is not enough: the largest mallopt takes is 2 GiB, and a real-size fp32
update frees more than that at its top between micro-batches. Measured on a Qwen2.5-0.5B-shaped fp32 update
(16 samples in micro-batches of 4, no recomputation, 2 threads): with the heap trimmed past 2 GiB, ~670 k minor
faults and 15-21 s of system time an update, 39-47 s; never trimmed, 27 faults from the third update on, 0.6 s
of system time, 30 s. And in bf16 (same shape and batch): with only the thresholds fixed and blocks still
mapped, 2.9-4.3 M minor faults and 6-8 s of system time an update, the optimizer step 2-5 s; with no block
mapped, 28 faults from the third update on, 0.6 s of system time, the optimizer step 0.5 s, the update 19 s
instead of 25 s. A user who sets glibc's own variables (`USER_VARIABLES`, which glibc has applied at start) keeps them; on
another C library nothing changes. `peer_environment` is the same settings (and the huge pages below) through
glibc's variables, for a process we do not start ourselves (the peers in bench/).

The exception is colocation, where phases take the memory in turn as they take the cores (with
`placement.host_memory: in_turns`, the default; `kept` leaves every rank its heap, roles/colocation.py): when a rank's
phase ends with at least `GIVE_BACK_BYTES` free in its heap (a real-size trainer's activations: GBs; a
0.5B bf16 trainer's gradients and the activations it keeps: ~1.5 GB, some of it in holes below the heap's top), the
heap is trimmed (`malloc_trim`) so the next phase's rank can have it; the next step faults those pages in
again. A small working set (the demo's) stays. Every rank also gives back what its start-up freed (a model
loaded and converted, a checkpoint read) before its first step: that memory no step needs again.

What is given back is faulted in again by the next phase, and in 4 KiB pages that is most of a colocated CPU
trainer's system time. So a rank's heap is put on transparent huge pages where the kernel hands them out on
request (`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise`, the common default): the rank's program
restarts itself once, before MPI starts, with glibc's tunable `glibc.malloc.hugetlb=1` (glibc 2.35 and later:
the heap is advised `MADV_HUGEPAGE` as it grows), which glibc reads only at start. Measured on B9r's colocated
Qwen2.5-0.5B-shaped step (fp32, 2 threads), the trainer's minor faults fell from ~1.1 M to ~0.11 M a step and
its system time from 10-11 s to 6.5-7 s of CPU, the weight sync from 1.6-1.8 s to 1.2 s, the step by 1-3 s; resident
memory did not grow. (torch's own `THP_MEM_ALLOC_ENABLE`, which advises only tensors of 2 MiB and up, aligned to
2 MiB, faulted more and held 0.9 GiB more at the same shape.) A user who names `glibc.malloc.hugetlb` in
`GLIBC_TUNABLES` (`=0` to keep 4 KiB pages) or sets glibc's variables above decides; with THP `always` the heap
has huge pages already, with `never` there are none, and an older glibc has no such tunable: no restart.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
NEVER_TRIM = -1  # mallopt's int, glibc's size_t: the largest threshold (man mallopt: "-1 disables trimming")
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_")
GLIBC_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str((1 << 64) - 1)}
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def huge_page_environment(environ: Mapping[str, str] = os.environ, mode_path: str = THP_MODE,
                          glibc: str | None = None) -> dict[str, str] | None:
    """The environment to restart a rank with so that glibc advises its heap onto transparent huge pages, or None
    where there is nothing to gain or the user decides (module docstring). `glibc`: its version (None: this
    process's C library's)."""
    if "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", "") or any(name in environ for name in USER_VARIABLES):
        return None
    try:
        with open(mode_path) as f:
            if "[madvise]" not in f.read():
                return None
        version = glibc if glibc is not None else _glibc_version()
    except (OSError, AttributeError):
        return None
    if tuple(int(x) for x in version.split(".")[:2]) < (2, 35):
        return None
    tunables = environ.get("GLIBC_TUNABLES")
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def peer_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`environ` with what every rank sets for itself here, as glibc's variables: a program we do not start (a
    peer in bench/) runs with the same allocator."""
    return {**(huge_page_environment(environ) or environ), **GLIBC_ENVIRONMENT}


def _glibc_version() -> str:
    version = ctypes.CDLL(None).gnu_get_libc_version  # AttributeError on another C library
    version.restype = ctypes.c_char_p
    return version().decode()


def restart_on_huge_pages() -> None:
    """Replace this process by itself (same pid, same arguments) with `huge_page_environment`, if there is one:
    only where the process is a rank's program and nothing has started yet (no MPI, no files, no threads)."""
    environment = huge_page_environment()
    if environment is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)


def heap_pages() -> str:
    """What the rank's log says of its heap's pages."""
    if HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        return "heap advised onto transparent huge pages (glibc.malloc.hugetlb=1)"
    return "heap in the kernel's default pages"


def keep_freed_memory(environ=os.environ) -> str:
    """Set glibc's allocator as above; returns what was done, for the rank's log."""
    if any(name in environ for name in USER_VARIABLES):
        return "malloc thresholds left as the environment sets them"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return "malloc thresholds unchanged (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) != 1:
        return "malloc thresholds unchanged (mallopt refused)"
    return "freed memory kept for reuse (malloc maps no block on its own and trims only when told)"


GIVE_BACK_BYTES = 256 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo():
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    return libc.mallinfo2()


def _heap_bytes() -> int:
    """The bytes glibc's main heap spans (used and free); 0 on another C library."""
    try:
        return int(_mallinfo().arena)
    except (OSError, AttributeError):
        return 0


def give_back_freed_memory(at_least: int = GIVE_BACK_BYTES) -> int:
    """Trim the heap when it holds at least `at_least` free bytes; the free bytes it held (0: left as it is, or
    not glibc)."""
    try:
        free = int(_mallinfo().fordblks)
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    if free < at_least:
        return 0
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return free
