"""B12's arithmetic (bench/memory_on_paper.py): parameter counts, the calibration from the measured layouts
(bench/memory_at_scale.py), and the on-paper memory of a layout, each against a case computed by hand; and the page
renders its extra tables.

    .venv/bin/python -m pytest tests/unit/test_memory_at_scale.py -q
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys

import pytest

from tests.conftest import REPO


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


mas = load("memory_at_scale")
paper = importlib.import_module("memory_on_paper")  # as memory_at_scale imports it (it puts bench/ on the path)
TOY = paper.Shape("toy", layers=4, hidden=10, heads=2, kv_heads=2, intermediate=20, vocab=100, tied=False)
CAL = paper.Calibration(unsharded_per_param=8, optimizer_per_param=8, step_transient=2, replicated_per_hidden=1,
                      split_per_width=2, full_kept_per_hidden=0.5, vocab_per_entry=3)


def test_parameter_counts_are_the_published_ones():
    # a toy layer: Q 10x10 + 10, K and V 10x10 + 10 each, O 10x10, MLP 3 x 10 x 20, two norms of 10
    assert TOY.layer_params == 110 + 220 + 100 + 600 + 20
    assert TOY.params == 4 * 1050 + 2 * 100 * 10 + 10
    assert paper.QWEN05.params == 494_032_768  # Qwen2.5-0.5B (and what Megatron built in the bench)
    assert paper.PAPER_MODELS[0].params == 7_615_616_512  # Qwen2.5-7B
    assert [round(s.params / 1e9, 1) for s in paper.PAPER_MODELS] == [7.6, 32.8, 72.7]


@pytest.mark.parametrize("layout, tokens, want", [
    # state 6200 params / tp 2 x (8 + 8/4); a layer 1 x 10 + 2 x 50 / 2 = 60 a token, x 4 layers, + logits 3 x 100 / 2
    pytest.param(paper.PaperLayout("tp2 sharded", 2, 4, shard=True), 100,
                 {"state": 31000, "activations": 100 * (4 * 60 + 150), "total": 31000 + 39000}, id="tp2-sharded"),
    # 10 tokens: the activations (3900) are below the optimizer step's transient, 2 x 100 x 10 / 2 x 4 bytes
    pytest.param(paper.PaperLayout("tp2 sharded", 2, 4, shard=True), 10,
                 {"state": 31000, "activations": 3900, "total": 35000}, id="transient-dominates"),
    # pp 2: 2 layers and one vocabulary table a stage; full recompute keeps 0.5 x 10 a layer and token plus one
    # layer's 60 while it is recomputed; the first stage holds 2 micro-batches (2 x 2 x 5 + 60 = 80), the last
    # one and, after the logits' 150 are freed, the recomputed layer (2 x 5 + max(60, 150) = 160)
    pytest.param(paper.PaperLayout("pp2", 2, 4, pp=2, shard=True, recompute="full"), 100,
                 {"state": 3100 / 2 * 10, "activations": 16000, "total": 15500 + 16000}, id="pp2-full"),
    # full recompute, one stage: 4 layers x 5 kept, then the larger of the logits' 150 and a recomputed layer's 60
    pytest.param(paper.PaperLayout("full", 2, 4, shard=True, recompute="full"), 100,
                 {"state": 31000, "activations": 100 * (4 * 5 + 150), "total": 31000 + 17000}, id="tp2-full"),
    # unsharded: all 16 bytes a parameter on every data-parallel rank; a layer 10 + 2 x 50 = 110 a token
    pytest.param(paper.PaperLayout("tp1", 1, 8), 1, {"state": 6200 * 16, "activations": 4 * 110 + 300,
                                                  "total": 6200 * 16 + 2 * 1000 * 4}, id="tp1-plain"),
])
def test_paper_memory_matches_the_hand_computed_case(layout, tokens, want):
    got = paper.paper_memory(TOY, layout, CAL, tokens)
    assert got == pytest.approx(want)


def test_calibration_recovers_the_coefficients_the_measurements_were_made_from():
    s = paper.QWEN05
    replicated, split, vocab, kept = 40e3, 100e3, 1.2e6, 4e3  # per token: a layer's two parts, the logits, full

    def points(per_token: float, held: float = 16.0, params: int = s.params) -> dict:
        return {str(n): {"micro_batch_tokens": n, "activations": 5e8 + per_token * n, "held": held * params,
                         "optimizer": held * params + 2 * 5e8, "params": params, "largest_tensor": 5e8}
                for n in (540, 1020)}

    def layers(n: int, tp: int = 1, full: bool = False) -> dict:
        if full:
            return points(n * kept + max(replicated + split, vocab))
        return points(n * (replicated + split / tp) + vocab / tp)

    results = {"plain": layers(24), "6-layers": layers(6), "sharded-dp2": points(1e6, held=12.0),
               "tp2": layers(12, tp=2), "tp2-6-layers": layers(6, tp=2),  # as LAYOUTS run them
               "full": layers(24, full=True), "full-6-layers": layers(6, full=True)}
    cal = mas.calibrate(results)
    assert (cal.unsharded_per_param, cal.optimizer_per_param, cal.step_transient) == pytest.approx((8, 8, 2))
    assert cal.replicated_per_hidden == pytest.approx(replicated / s.hidden)
    assert cal.split_per_width == pytest.approx(split / s.split_width)
    assert cal.full_kept_per_hidden == pytest.approx(kept / s.hidden)
    assert cal.vocab_per_entry == pytest.approx(vocab / s.vocab)


def test_seven_b_takes_the_largest_tensor_parallel_size_its_heads_allow():
    assert [paper.largest_tp(s) for s in paper.PAPER_MODELS] == [4, 8, 8]  # 7B: 28 heads over 4 key/value heads


def test_a_report_with_tables_renders_them_under_the_result(tmp_path, monkeypatch):
    render = load("render")
    report = {"question": "B12 memory", "target": "report", "met": None, "verdict": "v", "notes": "",
              "machine": {}, "rows": [{"label": "plain", "value": "11 GB"}],
              "tables": [{"title": "On paper", "columns": ["model", "GB"], "rows": [["72B", "130"]]}]}
    (tmp_path / "memory_at_scale.json").write_text(json.dumps(report))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    monkeypatch.setattr(render, "BENCHES", [render.Bench("B12", "memory_at_scale", limits="Arithmetic.")])
    page = render.render()
    assert "**Result.** v.\n\n**On paper.**\n\n| model | GB |\n|---|---|\n| 72B | 130 |" in page
