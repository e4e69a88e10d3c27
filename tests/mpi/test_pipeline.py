"""Real `mpirun`: a pipeline-parallel trainer (Megatron's 1F1B schedule, `train/pipeline.py`) computes what the
whole model on one rank computes.

    .venv/bin/python -m pytest tests/mpi/test_pipeline.py -q

tests/programs/pp_update.py runs one update of a tiny policy (its reference log-probs, its gradient with
grad_clip 0, its weights after an AdamW step that follows the gradient) at tp1 pp1, tp1 pp2 and tp2 pp2, and
the stages' tensors, merged under their HF names, are compared. A stage passes its hidden states to the next
unchanged and computes its layers as the whole model would, so the forward is bitwise pp=1's; the gradients
are too, except the tied word embeddings, whose two halves (the first stage's input embedding, the last
stage's head) are summed by an all-reduce instead of inside one backward (a different order of two adds).
tp2 adds the tensor-parallel reductions (float summation order, ~1e-6).
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from tests.conftest import PYTHON, REPO, full_matrix_only, mpi_env

CASE = "qwen2-gqa-qkv-bias-tied"  # Qwen2.5's layout: GQA, QKV bias, tied embeddings
OTHER_CASES = ["gpt2-tied", "qwen3-qk-norm-untied-vocab61"]  # learned positions; an untied head (test-faults)
TIED = {"grad.model.embed_tokens.weight", "weight.model.embed_tokens.weight", "grad.transformer.wte.weight",
        "weight.transformer.wte.weight"}


def _run(mpirun, out, case: str, tp: int, pp: int, *extra: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(tp * pp), PYTHON, "-m",
           "tests.programs.pp_update", "--out", str(out), "--case", case, "--tp", str(tp), "--pp", str(pp), *extra]
    proc = subprocess.run(cmd, env=mpi_env(), cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _merged(out, tp: int, pp: int, tag: str = "") -> dict[str, np.ndarray]:
    merged: dict[str, np.ndarray] = {}
    for stage in range(pp):
        part = dict(np.load(out / f"tp{tp}pp{pp}{tag}-stage{stage}.npz"))
        assert not set(part) & set(merged), "two stages wrote the same tensor"
        merged.update(part)
    return merged


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) / max(float(np.abs(a).max()), 1e-30)


@pytest.fixture(scope="module")
def updates(mpirun, tmp_path_factory):
    """The Qwen2.5-shaped case at tp1 pp1, tp1 pp2 and tp2 pp2; and with the shared-prompt stream and full
    recompute at pp1 and pp2."""
    root = tmp_path_factory.mktemp("pp_update")
    for tp, pp in ((1, 1), (1, 2), (2, 2)):
        _run(mpirun, root / "padded", CASE, tp, pp)
    for pp in (1, 2):
        _run(mpirun, root / "shared", CASE, 1, pp, "--share-prompts", "--recompute", "full")
    return root


def _check_pp2(out, pp: int = 2, tag: str = "") -> None:
    whole, staged = _merged(out, 1, 1), _merged(out, 1, pp, tag)
    assert set(whole) == set(staged)
    assert np.array_equal(np.load(out / "tp1pp1-logprobs.npy"), np.load(out / f"tp1pp{pp}{tag}-logprobs.npy"))
    for name in whole:
        if name in TIED:
            assert _relative(whole[name], staged[name]) < 1e-6, name
        else:
            assert np.array_equal(whole[name], staged[name]), name
    assert any(np.abs(v).max() > 0 for k, v in whole.items() if k.startswith("grad."))


def test_pp2_equals_pp1(updates):
    _check_pp2(updates / "padded")


@full_matrix_only
@pytest.mark.parametrize("case", OTHER_CASES)
def test_pp2_equals_pp1_for_other_families(mpirun, tmp_path, case):
    _run(mpirun, tmp_path, case, 1, 1)
    _run(mpirun, tmp_path, case, 1, 2)
    _check_pp2(tmp_path)


@pytest.mark.parametrize("pp, split", [pytest.param(2, "3,1", id="pp2-3+1"),
                                       pytest.param(3, "1,2", id="pp3-1+1+2", marks=full_matrix_only)])
def test_uneven_stages_equal_pp1(mpirun, tmp_path, pp, split):
    """placement.trainer.pp_layers: a 4-layer model as 3 + 1 layers (and 1 + 1 + 2: a middle stage with the rest)
    computes pp=1's log-probs, gradients and updated weights, each stage's layers under their HF names."""
    _run(mpirun, tmp_path, CASE, 1, 1, "--layers", "4")
    _run(mpirun, tmp_path, CASE, 1, pp, "--layers", "4", "--pp-layers", split)
    _check_pp2(tmp_path, pp, f"-layers{split.replace(',', '-')}")
    first = dict(np.load(tmp_path / f"tp1pp{pp}-layers{split.replace(',', '-')}-stage0.npz"))
    held = {int(n.split(".")[3]) for n in first if n.startswith("weight.model.layers.")}
    assert held == set(range(int(split.split(",")[0]))), held


@full_matrix_only  # four more launches (~90 s on 2 busy cores): tensor shards and adapters on uneven stages
def test_uneven_stages_with_tp2_and_with_lora_equal_pp1(mpirun, tmp_path):
    """tp2 x (3 + 1 layers) agrees with pp=1 to the tensor-parallel reductions; LoRA's adapters on 3 + 1 layers
    start as the whole model's (seeded by global layer) and give the same merged weights after one update."""
    _run(mpirun, tmp_path / "full", CASE, 1, 1, "--layers", "4")
    _run(mpirun, tmp_path / "full", CASE, 2, 2, "--layers", "4", "--pp-layers", "3,1")
    whole, staged = _merged(tmp_path / "full", 1, 1), _merged(tmp_path / "full", 2, 2, "-layers3-1")
    assert set(whole) == set(staged) and all(_relative(whole[k], staged[k]) < 1e-5 for k in whole)
    _run(mpirun, tmp_path / "lora", CASE, 1, 1, "--layers", "4", "--lora", "4")
    _run(mpirun, tmp_path / "lora", CASE, 1, 2, "--layers", "4", "--lora", "4", "--pp-layers", "3,1")
    whole, staged = _merged(tmp_path / "lora", 1, 1), _merged(tmp_path / "lora", 1, 2, "-layers3-1")
    assert set(whole) == set(staged) and all(_relative(whole[k], staged[k]) < 1e-6 for k in whole)


def test_tp2_pp2_equals_pp1(updates):
    out = updates / "padded"
    whole, staged = _merged(out, 1, 1), _merged(out, 2, 2)
    assert set(whole) == set(staged)
    assert np.abs(np.load(out / "tp1pp1-logprobs.npy") - np.load(out / "tp2pp2-logprobs.npy")).max() < 1e-5
    for name in whole:
        assert _relative(whole[name], staged[name]) < 1e-5, name


def test_shared_prompts_with_full_recompute_through_the_stages(updates):
    """The shared-prompt stream's recomputed layers attend on their own micro-batch's layout although 1F1B
    runs another micro-batch's forward between a forward and its backward."""
    out = updates / "shared"
    whole, staged = _merged(out, 1, 1), _merged(out, 1, 2)
    for name in whole:
        assert _relative(whole[name], staged[name]) < 1e-6, name


@full_matrix_only  # three more launches (~100 s on 2 busy cores); tests/mpi/test_lora_tp2.py covers TP in CI
def test_lora_through_the_stages_equals_one_stage(mpirun, tmp_path):
    """train.lora at pp=2 (and tp=2 pp=2): each stage's adapters start as the whole model's (seeded by global
    layer), the KL reference is the base, and the merged weights after one update are the same."""
    for tp, pp in ((1, 1), (1, 2), (2, 2)):
        _run(mpirun, tmp_path, CASE, tp, pp, "--lora", "4")
    whole, staged, both = _merged(tmp_path, 1, 1), _merged(tmp_path, 1, 2), _merged(tmp_path, 2, 2)
    assert set(whole) == set(staged) == set(both)
    assert np.array_equal(np.load(tmp_path / "tp1pp1-logprobs.npy"), np.load(tmp_path / "tp1pp2-logprobs.npy"))
    moved = 0
    for name in whole:
        assert _relative(whole[name], staged[name]) < 1e-6 and _relative(whole[name], both[name]) < 1e-5, name
        moved += name.endswith("q_proj.weight")
    assert moved
