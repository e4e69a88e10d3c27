"""Checkpoint names, listing, pruning choice and the save schedule (pure path logic, no tensors).

    .venv/bin/python -m pytest tests/unit/test_ckpt_layout.py -q
"""
from __future__ import annotations

from pathlib import Path

import pytest

from yatt_hpc.ckpt import layout


def test_file_names_encode_the_shard_coordinates():
    assert layout.model_file(1, 0) == "model-tp1-pp0.safetensors"
    assert layout.optim_file(1, 2, 3) == "optim-tp1-pp2-dp3.safetensors"
    assert layout.incomplete_dir(Path("c"), 7) == Path("c/step-7.incomplete")


def test_listing_orders_steps_numerically_and_ignores_incomplete_and_corrupt(tmp_path):
    for name in ("step-10", "step-9", "step-100", "step-3.incomplete", "step-4.corrupt", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-10" / layout.COMMIT_MARKER).write_text("{}")
    steps = layout.list_steps(tmp_path)
    assert [(s.step, s.committed) for s in steps] == [(9, False), (10, True), (100, False)]
    assert [p.name for p in layout.list_incomplete(tmp_path)] == ["step-3.incomplete"]


def test_pruning_keeps_the_newest_committed_and_never_touches_uncommitted(tmp_path):
    steps = [layout.StepDir(s, tmp_path / f"step-{s}", committed=s != 5) for s in (1, 2, 3, 4, 5)]
    assert [s.step for s in layout.steps_to_prune(steps, keep_last=2)] == [1, 2]


def test_keep_last_below_two_is_refused():
    with pytest.raises(ValueError, match="keep at least 2"):
        layout.steps_to_prune([], keep_last=1)


@pytest.mark.parametrize("step, interval, last, due", [
    pytest.param(10, 10, 20, True, id="periodic"),
    pytest.param(11, 10, 20, False, id="between"),
    pytest.param(20, 0, 20, True, id="final-with-interval-0"),
    pytest.param(5, 0, 20, False, id="interval-0-saves-only-at-end"),
])
def test_should_save_is_periodic_plus_final(step, interval, last, due):
    assert layout.should_save(step, interval, last) is due


def test_a_run_dir_or_its_checkpoints_dir_resolve_to_the_same_place(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert layout.resolve_checkpoints_dir(tmp_path) == tmp_path / "checkpoints"
    assert layout.resolve_checkpoints_dir(tmp_path / "checkpoints") == tmp_path / "checkpoints"
