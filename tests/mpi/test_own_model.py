"""README's "Train your own model" config (docs/examples/own_model.yaml), shrunk to this CPU: a model
behind a transformers tokenizer with a chat template, a directory of Parquet shards with renamed columns
and an extra metadata column, reward terms (math, format, a user function, the judge with its own template)."""
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import REPO, mpi_env
from yatt_hpc.config import load_config
from yatt_hpc.demo.char_tokenizer import TOKENIZER_FILE, CharTokenizer, save_hf_twin
from yatt_hpc.demo.task import demo_rows
from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.placement import plan

EXAMPLE = REPO / "docs/examples/own_model.yaml"
CPU = {"model.dtype": "float32", "rollout.engine": "hf", "placement.mode": "colocate",
       "placement.trainer": "{nodes: 1, tasks_per_node: 2, devices_per_task: 0, cpus_per_task: 1, tp: 1}",
       "placement.rollout": "{nodes: 1, tasks_per_node: 1, devices_per_task: 0, cpus_per_task: 1}",
       "placement.genrm": "{nodes: 1, tasks_per_node: 1, devices_per_task: 0, cpus_per_task: 1, tp: 1}",
       "train.steps": "2", "train.prompts_per_step": "4", "train.micro_batch_size": "8",
       "rollout.samples_per_prompt": "4", "rollout.max_new_tokens": "12", "data.max_prompt_tokens": "48",
       "data.system_prompt": "null", "reward.genrm_path": str(REPO / "models/demo/judge"),
       "reward.judge_template": "'{question}{response}\nCorrect? '", "reward.judge_parser": "yes_no",
       "reward.verdict_max_tokens": "4", "checkpoint.interval": "2",
       "logging.progress": "false"}


def test_the_example_config_plans_on_one_node_of_eight_gpus():
    p = plan(load_config(EXAMPLE))
    assert p.mode == "colocate" and p.total_nodes == 1 and p.total_devices == 8


def test_the_example_config_trains_shrunk_to_the_cpu(mpirun, tmp_path):
    policy = tmp_path / "policy"
    policy.mkdir()
    for f in (REPO / "models/demo/policy").iterdir():
        if f.name != TOKENIZER_FILE:
            shutil.copy(f, policy / f.name)
    save_hf_twin(CharTokenizer.load(REPO / "models/demo/policy"), policy)  # with a chat template
    shards = tmp_path / "math"
    shards.mkdir()
    rows = demo_rows(seed=7, count=64)
    for i in range(2):
        part = rows[i * 32:(i + 1) * 32]
        pq.write_table(pa.table({"problem": [r["prompt"] for r in part], "solution": [r["answer"] for r in part],
                                 "level": [i + 1] * len(part)}), shards / f"part-{i}.parquet", row_group_size=8)
    overrides = {**CPU, "model.path": str(policy), "data.source": str(shards)}
    env = mpi_env()
    env["PYTHONPATH"] = f"{REPO / 'docs/examples'}{os.pathsep}{env['PYTHONPATH']}"  # my_rewards, as the README says
    cmd = [sys.executable, "-m", "yatt_hpc.cli", "run", str(EXAMPLE), "--run-dir", str(tmp_path / "run")]
    for key, value in overrides.items():
        cmd += ["--set", f"{key}={value}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = step_rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        for term in ("correct", "boxed", "brevity", "judge"):
            assert f"reward/{term}/mean" in r, sorted(r)
        # the user function ran on the GenRM rank: 1 for a response that stopped (<= 12 tokens), 0 if truncated
        assert 0 < r["reward/brevity/mean"] <= 1
        assert r["reward/genrm_parse_fail"] < 0.5  # the short template fits the demo judge
