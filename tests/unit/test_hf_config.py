"""load_hf_config (yatt_hpc/models/hf_config.py) reads a GPT-2 config.json that states every field as written,
and gives what transformers' AutoConfig gives for everything the trainer and the judge read from it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig, GPT2Config, LlamaConfig

from tests.conftest import REPO
from yatt_hpc.models.hf_config import StatedConfig, load_hf_config
from yatt_hpc.train.hf_arch import describe_hf_config

GPT2_VARIANTS = {
    "small": {"n_embd": 32, "n_layer": 2, "n_head": 4},
    "untied_inner_eps": {"n_embd": 48, "n_layer": 3, "n_head": 6, "n_inner": 80, "tie_word_embeddings": False,
                         "layer_norm_epsilon": 1e-6, "activation_function": "relu", "n_positions": 96},
}


@pytest.mark.parametrize("variant", sorted(GPT2_VARIANTS))
@pytest.mark.parametrize("tp", [1, 2])
def test_a_stated_gpt2_config_describes_what_autoconfig_describes(tmp_path, variant, tp):
    GPT2Config(vocab_size=60, **GPT2_VARIANTS[variant]).save_pretrained(tmp_path)
    ours, theirs = load_hf_config(tmp_path), AutoConfig.from_pretrained(tmp_path)
    assert isinstance(ours, StatedConfig)
    assert describe_hf_config(ours, tp) == describe_hf_config(theirs, tp)
    for name in ("hidden_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        assert getattr(ours.get_text_config(), name) == getattr(theirs.get_text_config(), name), name
    assert hasattr(ours, "vision_config") == hasattr(theirs, "vision_config")


def test_the_shipped_demo_models_read_without_transformers():
    for name in ("policy", "judge"):
        directory = REPO / "models" / "demo" / name
        assert isinstance(load_hf_config(directory), StatedConfig)
        assert describe_hf_config(load_hf_config(directory), 1) == describe_hf_config(
            AutoConfig.from_pretrained(directory), 1)


def test_a_config_that_leaves_a_field_to_transformers_defaults_goes_through_autoconfig(tmp_path):
    GPT2Config(vocab_size=60, n_embd=32, n_layer=2, n_head=4).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["layer_norm_epsilon"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = load_hf_config(tmp_path)
    assert not isinstance(read, StatedConfig) and read.layer_norm_epsilon == 1e-5  # GPT2Config's default


def test_other_architectures_go_through_autoconfig(tmp_path):
    LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    assert not isinstance(load_hf_config(tmp_path), StatedConfig)


def test_a_trainer_rank_reading_the_demo_config_never_imports_transformers():
    code = ("import sys; import yatt_hpc.roles.trainer, yatt_hpc.train.policy; "
            "from yatt_hpc.models.hf_config import load_hf_config; from yatt_hpc.train.hf_arch import describe_hf_config; "
            f"describe_hf_config(load_hf_config({str(REPO / 'models' / 'demo' / 'policy')!r}), 1); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
