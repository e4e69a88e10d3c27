"""A real `yatt-hpc run` whose responses are 3,000 tokens long trains with activation recomputation and
token-budget micro-batches: every response reaches the limit, each micro-batch's forward stays within the
budget (a group of four such responses would be 12,000 tokens in one fixed micro-batch), and the trainer
rank's memory stays bounded. bench/long_responses.py measures the same shape with and without them.

    .venv/bin/python -m pytest tests/mpi/test_long_responses_run.py -q
"""
import subprocess
import sys

from tests.conftest import REPO, mpi_env
from tests.programs.long_responses import long_run_config
from yatt_hpc.metrics.writer import step_rows

LENGTH = 3000
BUDGET = 4096
TRAINER_PEAK_MB = 800
"""The trainer rank's peak RSS allowed. Measured on the 2-core dev machine: 480 MB with recomputation and the
budget (the process's own ~370 MB of torch and Megatron included), 1,064 MB for the same run without them."""


def test_a_run_with_3000_token_responses_trains_within_the_budget(mpirun, tmp_path):
    config = long_run_config(tmp_path / "setup", LENGTH)
    proc = subprocess.run([sys.executable, "-m", "yatt_hpc.cli", "run", str(config), "--run-dir", str(tmp_path / "run"),
                           "--set", "train.recompute=full", "--set", f"train.max_tokens_per_micro_batch={BUDGET}"],
                          cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = step_rows(tmp_path / "run")
    assert row["rollout/response_len_mean"] == LENGTH
    # one sample per micro-batch: its prompt and 2,999 response inputs; two would be over the budget
    assert LENGTH < row["train/micro_batch_tokens_max"] <= BUDGET
    assert row["memory/peak_rss_mb/trainer"] < TRAINER_PEAK_MB, row["memory/peak_rss_mb/trainer"]
