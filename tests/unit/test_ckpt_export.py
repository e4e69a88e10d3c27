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


def _trained_checkpoint(tmp_path):
    """A tiny model whose config.json says bfloat16 (as released models' do), and a float32 checkpoint of it
    after 'training' moved every weight by ~1e-5 of its size: below bfloat16's resolution (~4e-3)."""
    import json

    model_dir, run_dir = tmp_path / "model", tmp_path / "run"
    original = write_tiny_model_dir(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    trained = tiny_hf_model("gpt2-tied")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(1 + 1e-5 * torch.randn(p.shape, generator=gen))
    with CheckpointManager(run_dir) as mgr:
        mgr.save(4, RankState("trainer/dp0/tp0/pp0", {"dp": 0, "tp": 0, "pp": 0},
                              model=hf_to_megatron(trained.state_dict(), trained.config, 0, 1)),
                 SharedState(config_yaml=f"model:\n  path: {model_dir}\n"))
    return original, trained.eval(), run_dir


def test_a_plain_from_pretrained_loads_the_export_as_trained(tmp_path):
    """No dtype argument: transformers loads what config.json says, so it must say float32."""
    _, trained, run_dir = _trained_checkpoint(tmp_path)
    done = export_hf(run_dir, 4, tmp_path / "hf")
    assert done.dtype == "float32" and done.lost_in_cast is None
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert [k for k, v in trained.state_dict().items() if not torch.equal(loaded.state_dict()[k], v)] == []
    ids = torch.randint(0, trained.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = trained(ids).logits
        assert ((loaded(ids).logits - want).abs().max() / want.abs().max()).item() <= TOLERANCE


def test_a_bfloat16_export_says_so_and_warns_that_training_rounded_away(tmp_path):
    import json

    from click.testing import CliRunner

    from yatt_hpc.cli import main

    original, _, run_dir = _trained_checkpoint(tmp_path)
    result = CliRunner().invoke(main, ["ckpt", "export-hf", str(run_dir), "--step", "4", "--out",
                                       str(tmp_path / "hf"), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert "are back at their original value in bfloat16" in result.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    # what the warning measured: most trained weights are their original's bfloat16 rounding again
    got = loaded.state_dict()
    same = sum(int((got[k] == v.bfloat16()).sum()) for k, v in original.state_dict().items())
    assert same / sum(v.numel() for v in original.state_dict().values()) > 0.9
