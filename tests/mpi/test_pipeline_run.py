"""Pipeline parallelism on real runs: `yatt-hpc run` with three trainer stages (the demo policy's three layers,
one a stage: a first stage with the embeddings, a middle one with neither end, a last with the head).

A pp=3 run learns the demo; its checkpoint (one parameter file per stage) resumes bitwise; it resumes into one
stage (pp 3 -> 1), and a one-stage checkpoint resumes into three (pp 1 -> 3, in `make test-faults`), each
continuing with the same next prompts and the weights of the uninterrupted run up to float summation order (the
tied embeddings' two gradient halves are added by an all-reduce across stages, `train/pipeline.py`). The engines
score the trainer's weights after every sync, each stage's owner sending its own layers
(train/rollout_logp_diff_max below 1e-4, as with one stage: the engine's batched forward adds in another order).
Uneven stages (`placement.trainer.pp_layers=[2,1]`: two layers on the first stage, one on the last) train the
same weights, export to HF by the split their checkpoint records, and resume into three even stages (and into
1 + 2 layers, in `make test-faults`).

    .venv/bin/python -m pytest tests/mpi/test_pipeline_run.py -q
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import full_matrix_only
from tests.mpi.test_sharded_optimizer import prompts_of, yatt_run
from yatt_hpc.ckpt.export_hf import export_hf
from yatt_hpc.metrics.writer import step_rows
from yatt_hpc.models.hf_config import load_hf_config
from yatt_hpc.train import convert

REPO = Path(__file__).resolve().parents[2]
PP3 = ["placement.trainer.tasks_per_node=3", "placement.trainer.pp=3", "placement.trainer.dp=1", "eval.every=0"]
PP1 = ["placement.trainer.tasks_per_node=1", "placement.trainer.pp=1", "placement.trainer.dp=1", "eval.every=0"]
# uneven stages: the demo policy's three layers as two on the first stage and one on the last (and the reverse)
UNEVEN = ["placement.trainer.tasks_per_node=2", "placement.trainer.pp=2", "placement.trainer.dp=1", "eval.every=0",
          "placement.trainer.pp_layers=[2,1]"]
REVERSED = [*UNEVEN[:-1], "placement.trainer.pp_layers=[1,2]"]
LONG = 30


def hf_weights(run_dir: Path, step: int, split: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The step's parameters merged over its stages (HF names; uneven stages as `split` says)."""
    step_dir = run_dir / "checkpoints" / f"step-{step}"
    stages = sorted(step_dir.glob("model-tp0-pp*.safetensors"))
    return convert.stages_to_hf([[load_file(str(p))] for p in stages], load_hf_config(REPO / "models/demo/policy"),
                                split=split)


@pytest.fixture(scope="module")
def runs(mpirun, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    yatt_run(root / "long", f"train.steps={LONG}", "checkpoint.interval=3", "checkpoint.keep_last=10",
             "train.prompts_per_step=16", *PP3)
    yatt_run(root / "two", "train.steps=2", "train.prompts_per_step=16", *PP3)
    return root


@pytest.fixture(scope="module")
def one_stage(runs):
    """A one-stage run's step-2 checkpoint, beside the three-stage runs."""
    yatt_run(runs / "two-pp1", "train.steps=2", "train.prompts_per_step=16", *PP1)
    return runs


def resume(runs: Path, name: str, source: str, *sets: str) -> Path:
    run_dir = runs / name
    shutil.copytree(runs / source, run_dir)
    yatt_run(run_dir, "train.steps=3", "train.prompts_per_step=16", *sets)
    return run_dir


def test_a_three_stage_run_learns_and_its_engines_hold_its_weights(runs):
    rows = step_rows(runs / "long")
    assert [r["step"] for r in rows] == list(range(1, LONG + 1))
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.15, (first, last)
    assert all(r["train/rollout_logp_diff_max"] < 1e-4 for r in rows), [r["train/rollout_logp_diff_max"] for r in rows]
    assert all(r["weight_sync/buckets"] >= 3 for r in rows)  # one final bucket per stage at least
    assert sorted(p.name for p in (runs / "long" / "checkpoints" / "step-3").glob("*.safetensors")) == [
        *(f"model-tp0-pp{s}.safetensors" for s in range(3)), *(f"optim-tp0-pp{s}-dp0.safetensors" for s in range(3))]


def test_the_last_stage_head_stays_the_first_stage_embedding(runs):
    step_dir = runs / "long" / "checkpoints" / f"step-{LONG}"
    first = load_file(str(step_dir / "model-tp0-pp0.safetensors"))["embedding.word_embeddings.weight"]
    head = load_file(str(step_dir / "model-tp0-pp2.safetensors"))["output_layer.weight"]
    start = load_file(str(REPO / "models/demo/policy/model.safetensors"))["transformer.wte.weight"]
    assert torch.equal(first, head) and not torch.equal(first[: start.shape[0]], start)


def test_export_hf_merges_the_stages(runs, tmp_path):
    out = export_hf(runs / "long", LONG, tmp_path / "hf").out
    exported = load_file(str(out / "model.safetensors"))
    merged = hf_weights(runs / "long", LONG)
    assert exported.keys() == {k for k in merged if k != "lm_head.weight"}
    assert all(torch.equal(exported[k], merged[k]) for k in exported)


def test_a_pipelined_checkpoint_resumes_bitwise(runs):
    run_dir = resume(runs, "same", "two", *PP3)
    for stage in range(3):
        for name in (f"model-tp0-pp{stage}.safetensors", f"optim-tp0-pp{stage}-dp0.safetensors"):
            want = load_file(str(runs / "long" / "checkpoints" / "step-3" / name))
            got = load_file(str(run_dir / "checkpoints" / "step-3" / name))
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name


@pytest.mark.parametrize("name, source, layout", [
    pytest.param("pp3-to-pp1", "two", PP1, id="pp3-to-pp1"),
    pytest.param("pp1-to-pp3", "two-pp1", PP3, id="pp1-to-pp3", marks=full_matrix_only),  # the same merge and split
])
def test_another_pipeline_layout_continues_with_the_same_prompts_and_weights(request, runs, name, source, layout):
    if source == "two-pp1":
        request.getfixturevalue("one_stage")
    run_dir = resume(runs, name, source, *layout)
    assert prompts_of(run_dir, 3) == prompts_of(runs / "long", 3) == list(range(32, 48))
    want, got, before = hf_weights(runs / "long", 3), hf_weights(run_dir, 3), hf_weights(runs / "two", 2)
    moved = torch.cat([(want[k] - before[k]).abs().flatten() for k in want]).mean()
    off = torch.cat([(want[k] - got[k]).abs().flatten() for k in want]).mean()
    assert moved > 1e-4 and off < 1e-3 * moved, (float(moved), float(off))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["step"] >= 1] == [1, 2, 3]


@pytest.fixture(scope="module")
def uneven(runs):
    """A two-step run on uneven stages (2 + 1 layers), beside the three-stage runs."""
    yatt_run(runs / "uneven", "train.steps=2", "train.prompts_per_step=16", *UNEVEN)
    return runs


def _close(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """`got` is `want` up to float summation order: off by far less than the step moved the weights."""
    assert want.keys() == got.keys()
    names = [k for k in want if k in before]  # a tied head is listed by the merge, not saved by HF
    moved = torch.cat([(want[k] - before[k]).abs().flatten() for k in names]).mean()
    off = torch.cat([(want[k] - got[k]).abs().flatten() for k in names]).mean()
    assert moved > 1e-4 and off < 1e-3 * moved, (float(moved), float(off))


def test_an_uneven_run_trains_its_stages_and_records_their_split(uneven):
    """Two layers on the first stage, one on the last: the engines score the trainer's weights (each stage's owner
    sends its own layers), the checkpoint holds each stage's layers under local numbers and records the split, and
    the weights are the three-stage run's up to float summation order."""
    run_dir = uneven / "uneven"
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/rollout_logp_diff_max"] < 1e-4 for r in rows), [r["train/rollout_logp_diff_max"] for r in rows]
    step_dir = run_dir / "checkpoints" / "step-2"
    held = [{n.split(".")[2] for n in load_file(str(step_dir / f"model-tp0-pp{s}.safetensors"))
             if n.startswith("decoder.layers.")} for s in range(2)]
    assert held == [{"0", "1"}, {"0"}]
    from yatt_hpc.ckpt.loader import read_rank

    assert read_rank(step_dir, "trainer/dp0/tp0/pp1").pipeline_split == (2, 1)
    start = load_file(str(REPO / "models/demo/policy/model.safetensors"))
    _close(hf_weights(uneven / "two", 2), hf_weights(run_dir, 2, (2, 1)), start)


def test_export_hf_merges_uneven_stages(uneven, tmp_path):
    out = export_hf(uneven / "uneven", 2, tmp_path / "hf").out
    exported = load_file(str(out / "model.safetensors"))
    merged = hf_weights(uneven / "uneven", 2, (2, 1))
    assert exported.keys() == {k for k in merged if k != "lm_head.weight"}
    assert all(torch.equal(exported[k], merged[k]) for k in exported)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(model.state_dict()[k], merged[k]) for k in exported)


@pytest.mark.parametrize("name, layout", [
    pytest.param("uneven-to-pp3", PP3, id="uneven-to-even-pp3"),
    pytest.param("uneven-to-reversed", REVERSED, id="uneven-to-other-uneven", marks=full_matrix_only),
])
def test_an_uneven_checkpoint_resumes_into_another_split(uneven, name, layout):
    """The saved split (2 + 1) merges the stages; the new layout splits them: three even stages, or 1 + 2."""
    run_dir = resume(uneven, name, "uneven", *layout)
    assert prompts_of(run_dir, 3) == prompts_of(uneven / "long", 3) == list(range(32, 48))
    split = (1, 2) if layout is REVERSED else None
    _close(hf_weights(uneven / "long", 3), hf_weights(run_dir, 3, split), hf_weights(uneven / "uneven", 2, (2, 1)))
