"""The job scripts `yatt-hpc plan CONFIG --sbatch` / `submit` render, pinned as golden text.

    YATT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/golden/test_sbatch_golden.py   # regenerate
"""
from pathlib import Path

import pytest

from tests.golden.golden import assert_golden
from yatt_hpc.config import load_config
from yatt_hpc.launch.sbatch import render_sbatch
from yatt_hpc.placement import plan

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
RUN_DIR, PYTHON = "/scratch/runs/RUN", "/opt/yatt/.venv/bin/python"

SCENARIOS = [
    pytest.param("configs/demo_cpu.yaml", (), None, "colocated", id="colocated"),
    pytest.param("configs/partial_gpu.yaml", (), None, "partial", id="partial"),
    pytest.param("configs/disjoint_cpu.yaml", ("slurm.env.OMPI_MCA_btl=self,tcp",), None, "disjoint_3_components",
                 id="disjoint-3-components"),
    pytest.param("configs/qwen2_7b_disjoint_1024gpu.yaml", (), None, "disjoint_1024gpu", id="disjoint-1024-gpu"),
    pytest.param("configs/qwen2_72b_disjoint_h200.yaml", (), None, "disjoint_72b_h200", id="disjoint-72b-h200"),
    pytest.param("configs/qwen3_30b_a3b_disjoint_h200.yaml", (), None, "disjoint_30b_a3b_h200", id="disjoint-30b-a3b-h200"),
    pytest.param("configs/disjoint_cpu.yaml", (), RUN_DIR + "/submitit", "submit_disjoint", id="submit-form"),
    pytest.param("configs/tools_disjoint_cpu.yaml", ("slurm.env.OMPI_MCA_btl=self,tcp",), None, "disjoint_tools_group",
                 id="disjoint-tools-group"),
]


@pytest.mark.parametrize("config, overrides, submitit_folder, name", SCENARIOS)
def test_sbatch_script_matches_golden(config, overrides, submitit_folder, name):
    cfg = load_config(REPO / config, overrides)
    text = render_sbatch(cfg, plan(cfg), RUN_DIR, PYTHON, submitit_folder=submitit_folder)
    assert_golden(text, HERE / f"{name}.sbatch")
