"""Pre-launch input checks that read the filesystem (`yatt_hpc/runtime/inputs.py`)."""
from pathlib import Path

import pytest

from yatt_hpc.config import load_config
from yatt_hpc.errors import InputError
from yatt_hpc.runtime.inputs import check_model_dirs

REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides):
    return load_config(REPO / "configs" / "demo_cpu.yaml", [f"model.path={REPO / 'models/demo/policy'}",
                                                            f"reward.genrm_path={REPO / 'models/demo/judge'}",
                                                            *overrides])


def test_model_arch_must_match_config_json():
    check_model_dirs(_cfg("model.arch=auto"))
    check_model_dirs(_cfg("model.arch=gpt2"))  # the demo policy is a GPT-2
    with pytest.raises(InputError, match=r"model.arch=qwen2 but .*config.json has model_type='gpt2'; set model.arch=auto"):
        check_model_dirs(_cfg("model.arch=qwen2"))


def test_a_missing_model_dir_names_the_field(tmp_path):
    with pytest.raises(InputError, match=r"model.path=.*no such directory"):
        check_model_dirs(_cfg(f"model.path={tmp_path / 'absent'}"))


def test_pipeline_stages_must_split_the_layers_evenly():
    check_model_dirs(_cfg("placement.trainer.pp=3", "placement.trainer.tasks_per_node=3", "placement.trainer.dp=1"))
    with pytest.raises(InputError, match=r"placement.trainer.pp=2 does not divide the policy's 3 transformer layers"
                                         r".*set placement.trainer.pp to one of \[1, 3\]"):
        check_model_dirs(_cfg("placement.trainer.pp=2", "placement.trainer.tasks_per_node=2", "placement.trainer.dp=1"))


def test_pipeline_stages_refuse_a_vision_language_policy():
    vlm = load_config(REPO / "configs" / "demo_vlm_cpu.yaml", ["placement.trainer.pp=2", "placement.trainer.dp=1"])
    with pytest.raises(InputError, match=r"placement.trainer.pp=2: pipeline parallelism with a vision-language policy"):
        check_model_dirs(vlm)


def test_recompute_layers_count_per_pipeline_stage():
    # 3 layers over 3 stages: one layer a stage, so two layers to recompute are more than a stage has
    with pytest.raises(InputError, match=r"recompute_num_layers=2 is more than the model's 1 transformer layers; "
                                         r".*\(per pipeline stage\)"):
        check_model_dirs(_cfg("placement.trainer.pp=3", "placement.trainer.tasks_per_node=3", "placement.trainer.dp=1",
                              "train.recompute=full", "train.recompute_num_layers=2"))
