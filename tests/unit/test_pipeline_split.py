"""Uneven pipeline stages (`placement.trainer.pp_layers`): the one layer split (`config.placement.stage_layers`)
that the config checks, the converter, Megatron's model, checkpoints and the plan share, and its refusals.

    .venv/bin/python -m pytest tests/unit/test_pipeline_split.py -q
"""
from pathlib import Path

import pytest
import torch

from tests.mpi.convert_tp2_worker import TINY_CASES, perturbed
from yatt_hpc.config import load_config
from yatt_hpc.config.load import ConfigError
from yatt_hpc.config.placement import split_problem, stage_layers
from yatt_hpc.errors import InputError
from yatt_hpc.placement import plan
from yatt_hpc.placement.show import pipeline_text
from yatt_hpc.runtime.inputs import check_model_dirs
from yatt_hpc.train import convert

REPO = Path(__file__).resolve().parents[2]


def _cfg(*overrides):
    return load_config(REPO / "configs" / "demo_cpu.yaml", [f"model.path={REPO / 'models/demo/policy'}",
                                                            f"reward.genrm_path={REPO / 'models/demo/judge'}",
                                                            *overrides])


def _pp(pp: int, *more: str) -> tuple[str, ...]:
    return (f"placement.trainer.pp={pp}", f"placement.trainer.tasks_per_node={pp}", "placement.trainer.dp=1", *more)


@pytest.mark.parametrize("layers, pp, split, ranges", [
    pytest.param(28, 3, (10, 8), [(0, 10), (10, 20), (20, 28)], id="28-on-pp3"),
    pytest.param(4, 2, (3, 1), [(0, 3), (3, 4)], id="3+1"),
    pytest.param(10, 4, (1, 3), [(0, 1), (1, 4), (4, 7), (7, 10)], id="middle-stages-split-the-rest"),
    pytest.param(12, 3, None, [(0, 4), (4, 8), (8, 12)], id="even"),
])
def test_stage_layers_follow_the_first_and_last_counts(layers, pp, split, ranges):
    assert [(r.start, r.stop) for r in (stage_layers(s, pp, layers, split) for s in range(pp))] == ranges
    assert [convert.Stage(s, pp, split).layers(layers) for s in range(pp)] == [range(*r) for r in ranges]


def test_stage_layers_are_megatrons():
    """Megatron-Core's own count and offset of each stage's layers (transformer_block.py, transformer_layer.py)
    for the same TransformerConfig fields the trainer builds with."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from yatt_hpc.train.mcore import TransformerConfig

    for layers, pp, split in ((28, 3, (10, 8)), (10, 4, (1, 3)), (4, 2, (3, 1))):
        config = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   num_layers_in_first_pipeline_stage=split[0],
                                   num_layers_in_last_pipeline_stage=split[1])
        for s in range(pp):
            ours = stage_layers(s, pp, layers, split)
            assert get_transformer_layer_offset(config, pp_rank=s) == ours.start, (layers, pp, split, s)
            assert get_num_layers_to_build(config, pp_rank=s) == len(ours), (layers, pp, split, s)


@pytest.mark.parametrize("overrides, needle", [
    pytest.param(("placement.trainer.pp_layers=[2,1]",), r"placement.trainer.pp_layers=\[2, 1\] splits pipeline "
                 r"stages, but placement.trainer.pp=1 has one stage; set placement.trainer.pp > 1", id="pp1"),
    pytest.param(_pp(2, "placement.trainer.pp_layers=[0,3]"), r"placement.trainer.pp_layers=\[0, 3\]: every "
                 "pipeline stage holds at least one transformer layer", id="empty-stage"),
    pytest.param(_pp(2, "placement.trainer.pp_layers=[1,2,3]"), r"placement.trainer.pp_layers", id="three-counts"),
    pytest.param(_pp(2, "placement.trainer.pp_layers=[2,1]", "train.adv_estimator=gae"),
                 r"placement.trainer.pp_layers=\[2, 1\] with train.adv_estimator=gae: .* drop "
                 "placement.trainer.pp_layers", id="critic"),
])
def test_refused_splits_name_the_field_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg(*overrides)


@pytest.mark.parametrize("overrides, needle", [
    pytest.param(_pp(2, "placement.trainer.pp_layers=[1,1]"), r"placement.trainer.pp_layers=\[1, 1\] with "
                 r"placement.trainer.pp=2 and 3 layers: two stages hold 1 \+ 1 = 2 layers, not 3; give them counts "
                 "that add up to 3", id="two-stages-miss-layers"),
    pytest.param(_pp(3, "placement.trainer.pp_layers=[1,2]"), r"the 1 middle stage\(s\) get the other 0 layers.*"
                 "choose first and last so that 3 - first - last is a positive multiple of 1", id="empty-middle"),
    pytest.param(_pp(2), r"placement.trainer.pp=2 does not divide the policy's 3 transformer layers.*or give the first "
                 "and last stage their own counts with placement.trainer.pp_layers", id="even-needs-a-divisor"),
    pytest.param(_pp(2, "placement.trainer.pp_layers=[2,1]", "train.recompute=full", "train.recompute_num_layers=2"),
                 r"train.recompute_num_layers=2 is more than the model's 1 transformer layers.*per pipeline stage",
                 id="recompute-per-stage"),
])
def test_splits_the_policys_layers_refuse_name_the_field_at_start(overrides, needle):
    with pytest.raises(InputError, match=needle):
        check_model_dirs(_cfg(*overrides))


def test_the_demo_policys_three_layers_split_two_and_one():
    check_model_dirs(_cfg(*_pp(2, "placement.trainer.pp_layers=[2,1]")))
    assert split_problem(3, 2, (2, 1)) is None and split_problem(3, 2, None) is not None


def test_the_plan_shows_each_stages_layers():
    cfg = _cfg(*_pp(2, "placement.trainer.pp_layers=[2,1]"))
    text = pipeline_text(plan(cfg), cfg.placement.trainer.pp_layers, 3)
    assert "pp_layers: 2 on the first, 1 on the last" in text
    assert "0: trainer ranks 0-0 with layers 0-1, 1: trainer ranks 1-1 with layers 2-2" in text
    even = _cfg(*_pp(3))
    assert "2: trainer ranks 2-2 with layers 2-2" in pipeline_text(plan(even), None, 3)
    assert "with layers" not in pipeline_text(plan(even), None, None)  # the model's config.json not readable
    bad = _cfg(*_pp(2, "placement.trainer.pp_layers=[1,1]"))
    assert "refused at start: placement.trainer.pp_layers=[1, 1]" in pipeline_text(plan(bad), (1, 1), 3)


def test_uneven_stages_split_and_merge_bitwise():
    """A 4-layer model as 3 + 1 layers: local names from 0 on each stage, merged back bitwise only by the same split."""
    cls, make = TINY_CASES["qwen2-gqa-qkv-bias-tied"]
    config = type(make()).from_dict({**{k: v for k, v in make().to_dict().items() if k != "layer_types"},
                                     "num_hidden_layers": 4})
    torch.manual_seed(0)
    hf = perturbed(cls(config).eval())
    original = hf.state_dict()
    stages = [[convert.hf_to_megatron(original, hf.config, 0, 1, stage)] for stage in convert.Stage(0, 2, (3, 1)).all()]
    assert {k.split(".")[2] for k in stages[0][0] if k.startswith("decoder.layers.")} == {"0", "1", "2"}
    assert {k.split(".")[2] for k in stages[1][0] if k.startswith("decoder.layers.")} == {"0"}
    restored = convert.stages_to_hf(stages, hf.config, split=(3, 1))
    assert sorted(restored) == sorted(original) and all(torch.equal(restored[k], original[k]) for k in original)
    with pytest.raises(KeyError):  # read as even stages, the first stage lacks its third layer's place
        convert.stages_to_hf(stages, hf.config, split=(1, 3))
