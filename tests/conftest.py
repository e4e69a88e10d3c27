"""Shared test fixtures: where real MPI and a real Slurm cluster come from.

Tests that need `mpirun` or a Slurm cluster skip with the reason printed when none can be had,
and FAIL instead when YATT_REQUIRE_MPI=1 / YATT_REQUIRE_SLURM=1 (CI sets both).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable

# `make test` (CI) runs one case of each fault and recovery path; the cases that repeat a path in
# another placement or with another trigger run with YATT_FULL_FAULT_MATRIX=1 (`make test-faults`).
FULL_MATRIX = os.environ.get("YATT_FULL_FAULT_MATRIX") == "1"
full_matrix_only = pytest.mark.skipif(not FULL_MATRIX, reason="a repeat of a path CI covers: runs in `make test-faults` "
                                                                  "(YATT_FULL_FAULT_MATRIX=1)")


def _unavailable(what: str, env: str, reason: str):
    if os.environ.get(env) == "1":
        pytest.fail(f"{what} is required ({env}=1) but unavailable: {reason}", pytrace=False)
    pytest.skip(f"{what} unavailable: {reason}")


NO_EVAL = ("eval.sources=[]", "eval.samples_per_prompt=1", "eval.max_prompts=null")
"""Overrides that take the demo config's validation away (a dynamic split refuses it): every eval field it
sets goes back to its default, as `eval:` refuses settings with no source to apply to."""


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    if os.geteuid() == 0:  # Open MPI refuses root without both of these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def mpirun() -> str:
    path = shutil.which("mpirun")
    if not path:
        _unavailable("mpirun", "YATT_REQUIRE_MPI", "no mpirun on PATH (tools/slurm-dev-cluster.sh start installs Open MPI)")
    return path


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The name of a reachable Slurm cluster with idle nodes."""
    if not shutil.which("sinfo"):
        _unavailable("Slurm", "YATT_REQUIRE_SLURM", "no sinfo on PATH; run `sudo tools/slurm-dev-cluster.sh start`")
    probe = subprocess.run(["sinfo", "-h", "-o", "%D %T"], capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        _unavailable("Slurm", "YATT_REQUIRE_SLURM", f"sinfo failed: {probe.stderr.strip()}")
    nodes = sum(int(line.split()[0]) for line in probe.stdout.splitlines() if line.strip())
    if nodes < 2:
        _unavailable("Slurm", "YATT_REQUIRE_SLURM", f"need >= 2 nodes, sinfo shows {nodes}")
    cluster = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    return next((line.split("=", 1)[1].strip() for line in cluster.splitlines() if line.startswith("ClusterName")), "?")


def checkpoint_weights(run_dir: Path, step: int) -> dict:
    """The parameters (TP rank 0, every expert-parallel rank's experts) a run's checkpoint step-`step` holds."""
    from yatt_hpc.ckpt.loader import read_weights

    return read_weights(run_dir / "checkpoints" / f"step-{step}")


def final_state(run_dir: Path, steps: int, *, longer_run: bool = False):
    """(weights, consumed prompts per replica as (step, positions)) of a `steps`-step demo run. With
    `longer_run`, the same of the first `steps` steps of a run that went on (its later rows are left
    out); otherwise every row it logged counts, so a step logged twice or too many shows."""
    import json

    consumed = []
    for dp in (0, 1):
        rows = [json.loads(line) for line in (run_dir / "data" / f"consumed-dp{dp}.jsonl").read_text().splitlines()]
        consumed.append([(r["step"], r["positions"]) for r in rows if not longer_run or r["step"] < steps])
    return checkpoint_weights(run_dir, steps), consumed


class ReferenceRun:
    """An uninterrupted demo run that exact-resume tests compare with (`reference_run`). Nothing in a
    step depends on `train.steps` or on when checkpoints are taken, so its step-k checkpoint and its
    consumed-prompt logs up to step k are what any k-step run of the same shape ends with."""

    STEPS = 20
    SETS = ("train.prompts_per_step=8", "rollout.samples_per_prompt=4", "checkpoint.interval=1",
            f"checkpoint.keep_last={STEPS}", "logging.progress=false")

    def __init__(self, run_dir: Path, output: str = "") -> None:
        self.dir = run_dir
        self.output = output  # what the launch printed (stdout then stderr), redirected to a pipe

    def weights(self, step: int) -> dict:
        return checkpoint_weights(self.dir, step)

    def state(self, step: int):
        """`final_state` of a `step`-step run: this run's first `step` steps."""
        return final_state(self.dir, step, longer_run=True)


@pytest.fixture(scope="session")
def reference_run(mpirun, tmp_path_factory) -> ReferenceRun:
    """The demo (colocate, 8 prompts x 4 samples) run straight through ReferenceRun.STEPS steps, every
    checkpoint kept, TensorBoard on: one launch for every test that needs 'where an uninterrupted run
    ends' or a finished run to read (tests/mpi/test_grpo_run.py, test_placement_modes.py)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    sets = [a for kv in (f"train.steps={ReferenceRun.STEPS}", *ReferenceRun.SETS) for a in ("--set", kv)]
    proc = subprocess.run([PYTHON, "-m", "yatt_hpc.cli", "run", str(REPO / "configs/demo_cpu.yaml"), "--run-dir",
                           str(run_dir), *sets], cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return ReferenceRun(run_dir, proc.stdout + proc.stderr)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Random tiny GPT-2 policy and judge with the character tokenizer: fast plumbing tests that do
    not need a policy that learns (the demo models under models/demo are for that)."""
    from yatt_hpc.demo.tiny_models import save_random_pair

    return save_random_pair(tmp_path_factory.mktemp("tiny_models"), n_embd=32, n_positions=64)


@pytest.fixture(scope="module")
def one_rank_world():
    """TP=1 Megatron process group (gloo on CPU, NCCL with CUDA) on a free local port; megatron's
    globals are torn down afterwards. Yields the tensor-parallel group."""
    import socket

    from megatron.core import parallel_state

    from yatt_hpc.train import megatron_model as mm

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mm.initialize_model_parallel(0, 1, "127.0.0.1", port, tp_size=1, seed=0)
    yield parallel_state.get_tensor_model_parallel_group()
    mm.destroy_model_parallel()


class SmallDisk:
    """Real tmpfs mounts of a chosen size (and inode count): a disk that really fills up."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    def mount(self, where: Path, size: str, inodes: int | None = None) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        self._run(["mount", "-t", "tmpfs", "-o", self._options(size, inodes), "tmpfs", str(where)], where)
        self.mounted.append(where)
        return where

    def grow(self, where: Path, size: str, inodes: int | None = None) -> None:
        """Make room, keeping what is on it (`mount -o remount`)."""
        self._run(["mount", "-o", "remount," + self._options(size, inodes), str(where)], where)

    @staticmethod
    def _options(size: str, inodes: int | None) -> str:
        return f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")

    @staticmethod
    def _run(cmd: list[str], where: Path) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs at {where} ({' '.join(cmd)}: {proc.stderr.strip()}); "
                        "the disk-full tests need CAP_SYS_ADMIN")

    def unmount_all(self) -> None:
        for where in reversed(self.mounted):
            if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.fixture
def small_disk():
    """Mount small tmpfs file systems (root only: CI runs the tests as root); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("the disk-full tests mount a small tmpfs, which needs root (CI runs the tests as root)")
    disk = SmallDisk()
    yield disk
    disk.unmount_all()

# Every run a test starts checks the step protocol at run time (yatt_hpc/roles/protocol.py): a rank
# that would take another collective than the others fails naming where, instead of hanging.
os.environ.setdefault("YATT_PROTOCOL_CHECK", "1")


def _become_subreaper() -> None:
    """Orphans of what a test started (mpirun once its launcher exited, say) become children of this
    pytest process instead of init's, so `leftover_pids` finds them by parentage, never by name."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


_become_subreaper()


def tree_pids(root: int) -> list[int]:
    """`root` (a Popen the test started) and every live process descended from it: the processes the
    test started, found by parentage, never by matching names. Zombies are left out."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # after "(comm)": state ppid ...
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid == root and not Path(f"/proc/{pid}").exists():
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return [p for p in out if p != root or Path(f"/proc/{p}").exists()]


def leftover_pids(baseline: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Every live process this pytest process started, directly or not, minus `baseline` (what was
    alive before the test began: e.g. the orted of pytest's own MPI singleton, which must live)."""
    return [p for p in tree_pids(os.getpid()) if p != os.getpid() and p not in baseline]


def kill_leftovers(baseline: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """SIGKILL whatever `leftover_pids(baseline)` finds; returns their pids."""
    return _sigkill(leftover_pids(baseline))


def kill_tree(root: int) -> list[int]:
    """SIGKILL `root` and its descendants (see tree_pids), children first found, then all; returns their pids."""
    return _sigkill(tree_pids(root))


def _sigkill(pids: list[int]) -> list[int]:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def wait_for_file(path: Path, timeout_s: float = 300, alive=None) -> None:
    """Poll until `path` exists (an event a process marks with a file), bounded; `alive()` False ends the wait early."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert alive is None or alive(), f"the run ended before {path} was written"
        assert time.monotonic() < deadline, f"{path} was not written within {timeout_s:g}s"
        time.sleep(0.02)


def wait_for_log_line(path: Path, text: str, timeout_s: float = 300, alive=None) -> None:
    """Poll `path` until it holds `text` (an event a rank logs), bounded; `alive()` False ends the wait early."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert alive is None or alive(), f"the run ended before {path.name} said {text!r}"
        assert time.monotonic() < deadline, f"{path} never said {text!r} within {timeout_s:g}s"
        time.sleep(0.02)
