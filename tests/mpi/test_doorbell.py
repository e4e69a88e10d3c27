"""Real `mpirun`: a rank waiting for a peer on its node sleeps until the peer rings (comm/doorbell.py).

The waits poll every 30 s: a wait a bell did not end would last 30 s and count as a timeout. Without
bells (none opened) the same exchange completes by polling alone: a bell only ever shortens a wait."""
import json
import subprocess

import pytest

from tests.conftest import PYTHON, REPO, mpi_env


@pytest.mark.parametrize("mode", ["bells", "no-bells"])
def test_messages_barriers_and_gates_wake_the_waiting_ranks(mpirun, tmp_path, mode):
    proc = subprocess.run([mpirun, "--oversubscribe", "-np", "3", PYTHON, str(REPO / "tests/programs/doorbell_probe.py"),
                           str(tmp_path), mode], env=mpi_env(), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    for r in (1, 2):
        assert ranks[r]["got"] == [[i, r] for i in range(5)]
    if mode == "bells":
        assert all(x["enabled"] for x in ranks)
        assert [x["timeouts"] for x in ranks] == [0, 0, 0], "a wait ran to its 30 s poll: no bell ended it"
        assert all(ranks[r]["rung"] >= 5 for r in (1, 2)), ranks  # every round ends at least one sleep
    else:
        assert not any(x["enabled"] for x in ranks) and all(x["rung"] == 0 for x in ranks)
