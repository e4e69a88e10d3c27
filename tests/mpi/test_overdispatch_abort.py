"""Real `mpirun` + a real HF engine: a STOP that arrives mid-generation aborts the engine, but only
when no other replica in the chunk still wants its samples (tests/programs/abort_probe.py)."""
import json
import subprocess

from tests.conftest import PYTHON, REPO, mpi_env


def test_stop_aborts_the_engine_only_when_the_whole_chunk_is_stopped(mpirun, tiny_models, tmp_path):
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", "2", PYTHON, str(REPO / "tests/programs/abort_probe.py"),
                           tiny_models["policy"], str(tmp_path)], env=mpi_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads((tmp_path / "abort.json").read_text())
    assert seen["alone"]["stops"] == [7] and seen["shared"]["stops"] == [7]
    alone = seen["alone"]
    # a random policy may sample eos in the first steps; every row still running was cut short
    assert alone["finish"].count("abort") > len(alone["finish"]) // 2, "the engine ran the stopped chunk to its end"
    assert all(t < 56 for f, t in zip(alone["finish"], alone["tokens"]) if f == "abort")
    assert "abort" not in seen["shared"]["finish"], "owner 8 still wanted these samples"
