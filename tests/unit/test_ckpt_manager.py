"""One-rank checkpoints on real files: commit, corruption detection, pruning, async == sync, no pickle.

    .venv/bin/python -m pytest tests/unit/test_ckpt_manager.py -q

The multi-rank protocol runs under real mpirun in tests/mpi/test_ckpt_commit.py; a SIGKILL during
an async write is tests/unit/test_ckpt_crash.py.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from yatt_hpc.ckpt import (
    CheckpointError,
    CheckpointManager,
    RankState,
    SharedState,
    capture_rng,
    layout,
)
from yatt_hpc.ckpt.manifest import verify_step
from yatt_hpc.ckpt.state import read_manifest

IDENTITY = "trainer/dp0/tp0/pp0"
COORDS = {"dp": 0, "tp": 0, "pp": 0}
REPO = Path(__file__).resolve().parents[2]


def rank_state(step: int) -> RankState:
    gen = torch.Generator().manual_seed(step)
    model = {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen)}
    optim = {f"{k}.exp_avg": v * 0.1 for k, v in model.items()} | {"w.step": torch.tensor(float(step))}
    return RankState(IDENTITY, COORDS, model=model, optim=optim, rng=capture_rng(),
                     data_position={"next": step * 16}, extra={"ids": np.arange(step)})


def save_steps(run_dir: Path, steps, keep_last: int = 5, async_save: bool = True) -> Path:
    with CheckpointManager(run_dir, keep_last=keep_last, async_save=async_save) as mgr:
        for step in steps:
            mgr.save(step, rank_state(step), SharedState({"step": step}, config_yaml="a: 1\n"))
    return layout.checkpoints_dir(run_dir)


def test_a_save_commits_marker_manifest_and_every_file(tmp_path):
    ckpt = save_steps(tmp_path, [3])
    step3 = ckpt / "step-3"
    assert sorted(p.name for p in step3.iterdir()) == sorted(
        ["COMMITTED", "state.h5", "model-tp0-pp0.safetensors", "optim-tp0-pp0-dp0.safetensors"])
    assert {e.name for e in read_manifest(step3 / "state.h5")} == {
        "model-tp0-pp0.safetensors", "optim-tp0-pp0-dp0.safetensors"}
    assert verify_step(step3) is None
    assert not layout.list_incomplete(ckpt)


def test_load_latest_returns_the_tensors_of_the_newest_step(tmp_path):
    save_steps(tmp_path, [1, 2])
    got = CheckpointManager(tmp_path).load_latest(IDENTITY)
    want = rank_state(2)
    assert got.step == 2 and got.data_position == {"next": 32}
    assert all(torch.equal(got.model[k], want.model[k]) for k in want.model)
    assert all(torch.equal(got.optim[k], want.optim[k]) for k in want.optim)


def test_fresh_run_has_no_latest(tmp_path):
    assert CheckpointManager(tmp_path).load_latest(IDENTITY) is None


def _truncate(step_dir: Path) -> None:
    path = step_dir / "model-tp0-pp0.safetensors"
    os.truncate(path, path.stat().st_size // 2)


def _flip_byte(step_dir: Path) -> None:
    path = step_dir / "optim-tp0-pp0-dp0.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 7] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_state_byte(step_dir: Path) -> None:
    path = step_dir / "state.h5"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


CORRUPTIONS = [
    pytest.param(_truncate, "truncated", id="truncated-safetensors"),
    pytest.param(_flip_byte, "sha256 mismatch", id="flipped-byte"),
    pytest.param(lambda d: (d / "COMMITTED").unlink(), "missing commit marker", id="missing-marker"),
    pytest.param(lambda d: (d / "state.h5").unlink(), "missing file state.h5", id="missing-hdf5"),
    pytest.param(_flip_state_byte, "state.h5: sha256 mismatch", id="flipped-byte-in-hdf5"),
    pytest.param(lambda d: (d / "model-tp0-pp0.safetensors").unlink(), "missing file model", id="missing-shard"),
]


@pytest.mark.parametrize("corrupt, reason", CORRUPTIONS)
def test_a_corrupt_latest_is_reported_and_skipped_for_the_previous_one(tmp_path, caplog, corrupt, reason):
    ckpt = save_steps(tmp_path, [1, 2])
    corrupt(ckpt / "step-2")
    assert reason in verify_step(ckpt / "step-2")
    with caplog.at_level(logging.WARNING, logger="yatt_hpc.ckpt"):
        mgr = CheckpointManager(tmp_path)
        got = mgr.load_latest(IDENTITY)
    assert got.step == 1 and got.data_position == {"next": 16}
    assert any("step-2" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    assert [step for step, _ in mgr.skipped] == [2] and reason in mgr.skipped[0][1]  # for the caller to say
    # moved aside, so later saves and pruning by step order cannot keep it instead of a good one
    assert (ckpt / "step-2.corrupt").is_dir() and not (ckpt / "step-2").exists()


def test_every_checkpoint_corrupt_means_a_fresh_start(tmp_path):
    ckpt = save_steps(tmp_path, [1])
    _truncate(ckpt / "step-1")
    assert CheckpointManager(tmp_path).load_latest(IDENTITY) is None


def test_keep_last_prunes_older_committed_checkpoints(tmp_path):
    ckpt = save_steps(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    assert [s.step for s in layout.list_steps(ckpt)] == [4, 5]


def test_stale_incomplete_dirs_from_a_crash_are_removed_at_start(tmp_path, caplog):
    ckpt = save_steps(tmp_path, [1])
    stale = layout.incomplete_dir(ckpt, 2)
    stale.mkdir()
    (stale / "model-tp0-pp0.safetensors").write_bytes(b"half a file")
    with caplog.at_level(logging.WARNING, logger="yatt_hpc.ckpt"):
        mgr = CheckpointManager(tmp_path)
    assert not stale.exists()
    assert any("never committed" in r.getMessage() for r in caplog.records)
    assert mgr.load_latest(IDENTITY).step == 1


def test_async_and_sync_saves_write_byte_identical_tensor_files(tmp_path):
    a = save_steps(tmp_path / "async", [1, 2], async_save=True)
    s = save_steps(tmp_path / "sync", [1, 2], async_save=False)
    for step in (1, 2):
        names = sorted(p.name for p in (a / f"step-{step}").glob("*.safetensors"))
        assert names == sorted(p.name for p in (s / f"step-{step}").glob("*.safetensors")) and names
        for name in names:
            assert (a / f"step-{step}" / name).read_bytes() == (s / f"step-{step}" / name).read_bytes()
        assert read_manifest(a / f"step-{step}/state.h5") == read_manifest(s / f"step-{step}/state.h5")


def test_without_thread_collectives_the_commit_happens_at_wait_on_the_calling_thread(tmp_path):
    mgr = CheckpointManager(tmp_path, thread_collectives=False)
    mgr.save(1, rank_state(1))
    mgr._writer.wait()  # files written by the thread; the commit collectives still wait for us
    assert mgr.in_flight and layout.list_steps(layout.checkpoints_dir(tmp_path)) == []
    mgr.close()
    assert verify_step(layout.checkpoints_dir(tmp_path) / "step-1") is None


def test_the_snapshot_is_taken_at_save_time_not_when_the_writer_runs(tmp_path):
    state = rank_state(1)
    want = state.model["w"].clone()
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, state)
        state.model["w"].add_(1.0)  # the training loop keeps updating its parameters in place
    assert torch.equal(CheckpointManager(tmp_path).load_latest(IDENTITY).model["w"], want)


def test_commit_now_from_another_thread_finishes_the_save_in_flight_then_commits_its_own(tmp_path):
    import threading

    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(2, rank_state(2))  # the boundary save, still being written
    worker = threading.Thread(target=mgr.commit_now, args=(3, rank_state(3), SharedState({"step": 3})))
    worker.start()  # the stop watchdog's thread; the loop thread makes no checkpoint call meanwhile
    worker.join()
    ckpt = layout.checkpoints_dir(tmp_path)
    assert [s.step for s in layout.list_steps(ckpt)] == [2, 3] and not mgr.in_flight
    assert verify_step(ckpt / "step-2") is None and verify_step(ckpt / "step-3") is None
    mgr.commit_now(3, None)  # nothing in flight, nothing to write: a no-op
    mgr.close()
    assert torch.equal(CheckpointManager(tmp_path).load_latest(IDENTITY).model["w"], rank_state(3).model["w"])


def test_commit_now_refuses_without_thread_collectives(tmp_path):
    mgr = CheckpointManager(tmp_path, thread_collectives=False)
    with pytest.raises(CheckpointError, match="THREAD_MULTIPLE"):
        mgr.commit_now(1, rank_state(1))
    mgr.close()


def test_a_failed_save_raises_at_the_next_wait_and_commits_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, RankState(IDENTITY, extra={"ids": [1, 2]}))  # a list would need pickle
    with pytest.raises(CheckpointError, match="not committed.*without pickle"):
        mgr.wait()
    assert layout.list_steps(layout.checkpoints_dir(tmp_path)) == []
    mgr.close()


_PICKLE_MAGIC = [bytes([0x80, proto]) for proto in range(2, 6)]
_ALLOWED_MAGIC = (b"\x89HDF\r\n\x1a\n", b"{")  # HDF5, JSON marker; safetensors checked below


def _is_safetensors(head: bytes) -> bool:
    return len(head) > 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 0


def test_no_file_under_checkpoints_is_a_pickle_or_a_torch_zip(tmp_path):
    save_steps(tmp_path, [1, 2])
    files = [p for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()]
    assert len(files) == 8
    for path in files:
        head = path.read_bytes()[:16]
        assert not any(head.startswith(m) for m in _PICKLE_MAGIC), path
        assert not head.startswith(b"PK\x03\x04"), f"{path} is a zip (torch.save format)"
        assert head.startswith(_ALLOWED_MAGIC) or _is_safetensors(head), (path, head)


def test_checkpoint_code_never_unpickles():
    sources = "\n".join(p.read_text() for p in (REPO / "yatt_hpc/ckpt").glob("*.py"))
    for needle in ("torch.load", "pickle", "np.load", "allow_pickle"):
        assert needle not in sources.replace("without pickle", "").replace("no pickle", "").replace(
            "Never pickle", "").replace("not pickled", "").replace("Nothing is pickled", ""), needle


def test_a_run_is_complete_only_when_its_newest_checkpoint_covers_the_steps_and_verifies(tmp_path):
    from yatt_hpc.ckpt.manifest import completed_step

    ckpt = save_steps(tmp_path, [1, 2, 3])
    assert completed_step(ckpt, 3) == 3 and completed_step(ckpt, 2) == 3  # `yatt-hpc run` starts no rank
    assert completed_step(ckpt, 4) is None  # steps left: the ranks run them
    _flip_byte(ckpt / "step-3")
    assert completed_step(ckpt, 3) is None, "a damaged newest checkpoint: the ranks resume from step 2"
    assert completed_step(tmp_path / "fresh", 1) is None


def test_a_rank_without_tensors_saves_and_resumes_without_importing_torch(tmp_path):
    """A GenRM rank scoring by rule holds no model: its checkpoint (numpy and python RNG streams, its
    data position) is written and read back with torch never imported (~3 s of CPU per start on the
    2 cores the four demo ranks share), and its numpy/python streams continue exactly."""
    code = f"""
import random, sys
import numpy as np
from yatt_hpc.ckpt import CheckpointManager, RankState, SharedState, capture_rng, restore_rng
np.random.seed(7); random.seed(7)
with CheckpointManager({str(tmp_path)!r}, keep_last=2, async_save=True) as mgr:
    mgr.save(1, RankState("genrm/r0", rng=capture_rng(), data_position={{"next": 3}}), SharedState({{"step": 1}}))
want = (np.random.random(), random.random())
got = CheckpointManager({str(tmp_path)!r}).load_latest("genrm/r0")
restore_rng(got.rng)
assert got.rng.torch_cpu.size == 0 and got.data_position == {{"next": 3}}, got
assert (np.random.random(), random.random()) == want
print("torch imported:", "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torch imported: False"


@pytest.mark.parametrize("cap", [pytest.param(0, id="no-copy"), pytest.param(9000, id="part"),
                                 pytest.param(None, id="uncapped")])
def test_a_capped_staging_holds_at_most_the_cap_and_saves_the_same_files(tmp_path, cap):
    """w (8 KiB) and b fit a 9000-byte cap, the optimizer's tensors follow in order until it is full; the
    rest is written before save returns, so changing every tensor right after changes no file."""
    state, want = rank_state(3), rank_state(3)
    with CheckpointManager(tmp_path / "capped", async_save=True, staging_bytes=cap) as mgr:
        mgr.save(3, state)
        staged = mgr._staging.nbytes
        for part in (state.model, state.optim):
            for tensor in part.values():
                tensor.add_(1.0)  # the training loop goes on updating in place
    total = sum(t.numel() * t.element_size() for part in (want.model, want.optim) for t in part.values())
    assert staged <= (cap if cap is not None else total) and (staged == total) == (cap is None)
    save_steps(tmp_path / "plain", [3], async_save=False)  # safetensors of the same state, written at once
    got, plain = (layout.checkpoints_dir(tmp_path / d) / "step-3" for d in ("capped", "plain"))
    for name in ("model-tp0-pp0.safetensors", "optim-tp0-pp0-dp0.safetensors"):
        assert (got / name).read_bytes() == (plain / name).read_bytes(), name
    restored = CheckpointManager(tmp_path / "capped").load_latest(IDENTITY)
    assert all(torch.equal(restored.model[k], v) for k, v in want.model.items())


def test_a_tensor_file_written_in_parts_loads_in_safetensors(tmp_path):
    from safetensors.torch import load_file

    from yatt_hpc.ckpt.writer import TensorFile

    tensors = {"h": torch.arange(6, dtype=torch.float16), "s": torch.tensor(2.5), "i": torch.arange(3),
               "b": torch.randn(3, 5).bfloat16(), "empty": torch.zeros(0, 4), "t": torch.randn(4, 3).t()}
    f = TensorFile(tmp_path / "x.safetensors", tensors, {"k": "v"})
    f.write(["t", "s"])
    assert not f.complete
    f.write()
    got = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
