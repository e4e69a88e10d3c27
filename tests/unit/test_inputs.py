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
