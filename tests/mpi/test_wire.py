"""Real `mpirun`: sample batches and weight buckets arrive bit-identical, buffers only."""
import subprocess

import numpy as np
import torch
from safetensors.torch import load_file

from tests.conftest import PYTHON, REPO, mpi_env
from tests.programs.wire_probe import make_batch, weights


def test_batches_and_weight_buckets_roundtrip(mpirun, tmp_path):
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", "3", PYTHON, str(REPO / "tests/programs/wire_probe.py"),
                           str(tmp_path)], env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (1, 2):
        got = np.load(tmp_path / f"batch-{rank}.npz")
        want = make_batch(rank)
        assert int(got["source"]) == 0
        for key in want.__dataclass_fields__:
            np.testing.assert_array_equal(got[key], getattr(want, key), err_msg=key)
        received = load_file(str(tmp_path / f"weights-{rank}.safetensors"))
        expected = dict(weights())
        assert received.keys() == expected.keys()
        for name, tensor in expected.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
        # 0.05 MiB buckets: the 120 kB tensor goes alone, so more than one bucket was used
        assert int((tmp_path / f"buckets-{rank}.txt").read_text()) >= 2
    want = make_batch(5)
    for rank in (0, 1, 2):
        got = np.load(tmp_path / f"bcast-{rank}.npz")
        for key in want.__dataclass_fields__:
            np.testing.assert_array_equal(got[key], getattr(want, key), err_msg=key)


def test_sorted_by_id_and_select_keep_ragged_columns_aligned():
    batch = make_batch(3)
    ordered = batch.sorted_by_id()
    assert list(ordered.sample_id) == sorted(batch.sample_id)
    for i, sid in enumerate(ordered.sample_id):
        j = int(np.flatnonzero(batch.sample_id == sid)[0])
        for col in ("prompt_tokens", "response_tokens", "logprobs", "answer", "question", "metadata"):
            np.testing.assert_array_equal(ordered.ragged(col)[i], batch.ragged(col)[j])
    assert ordered.metadatas() == [{"k": 1}] * len(batch)
    assert [len(q) for q in ordered.questions()] == [len(a) + 1 for a in ordered.answers()]
