"""`export_hf`: a checkpoint of Megatron shards becomes an HF directory whose logits equal the original.

    .venv/bin/python -m pytest tests/unit/test_ckpt_export.py -q

TP=1 here (one rank); tests/mpi/test_ckpt_commit.py exports a TP=2 checkpoint written by two ranks.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.mpi.convert_tp2_worker import tiny_hf_model
from yatt_hpc.ckpt import CheckpointError, CheckpointManager, RankState, SharedState
from yatt_hpc.ckpt.export_hf import export_hf
from yatt_hpc.train.convert import hf_to_megatron

# The export's claim is exact: every weight bitwise the original's (`exported_model` checks it). The
# logits then show that the copied config runs those weights as the original does; they are two float32
# forward passes, not one, and a CI run saw 4.1e-5 between them on logits of magnitude ~3.3 (1.2e-5 of
# the largest), so the bound is relative to the logits' scale: 4x that noise, and half of what the
# smallest config slip tried moves them (gelu for gelu_new: 1.1e-4; layer_norm_epsilon 1e-3: 1.1e-2).
TOLERANCE = 5e-5


def write_tiny_model_dir(path):
    """A tiny seeded GPT-2 in HF layout plus a tokenizer file, as `model.path` would hold."""
    model = tiny_hf_model("gpt2-tied")
    model.save_pretrained(path)
    (path / "yatt_tokenizer.json").write_text('{"vocab": "tiny"}')
    return model


def exported_model(original, exported_dir):
    """The exported directory loaded by transformers; every weight must equal the original's bit for bit."""
    exported = AutoModelForCausalLM.from_pretrained(exported_dir).eval()
    want, got = original.state_dict(), exported.state_dict()
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    return exported


def max_logit_diff(original, exported_dir) -> float:
    """Largest logit difference between the export and the original over their largest logit."""
    exported = exported_model(original, exported_dir)
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = original(ids).logits
        return ((exported(ids).logits - want).abs().max() / want.abs().max()).item()


def test_exported_checkpoint_loads_in_transformers_with_the_original_logits(tmp_path):
    model_dir, run_dir, out = tmp_path / "model", tmp_path / "run", tmp_path / "hf"
    original = write_tiny_model_dir(model_dir)
    shard = hf_to_megatron(original.state_dict(), original.config, 0, 1)
    with CheckpointManager(run_dir) as mgr:
        mgr.save(4, RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0}, model=shard),
                 SharedState(config_yaml=f"model:\n  path: {model_dir}\n"))
    export_hf(run_dir, 4, out)
    assert {"model.safetensors", "config.json", "generation_config.json", "yatt_tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    assert max_logit_diff(original.eval(), out) <= TOLERANCE


def test_export_without_the_original_model_dir_says_how_to_fix_it(tmp_path):
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, RankState("trainer/dp0/tp0/pp0", {"tp": 0, "pp": 0}, model={"x": torch.ones(1)}),
                 SharedState(config_yaml=f"model:\n  path: {tmp_path / 'gone'}\n"))
    with pytest.raises(CheckpointError, match="pass --model-dir"):
        export_hf(tmp_path, 1, tmp_path / "hf")
