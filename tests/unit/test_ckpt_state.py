"""state.h5 contents, RNG streams and AdamW state survive a real checkpoint round trip.

    .venv/bin/python -m pytest tests/unit/test_ckpt_state.py -q
"""
from __future__ import annotations

import random

import h5py
import numpy as np
import pytest
import torch

from yatt_hpc.ckpt import (
    CheckpointManager,
    RankState,
    SharedState,
    capture_rng,
    load_optimizer_tensors,
    optimizer_tensors,
    restore_rng,
)
from yatt_hpc.ckpt.state import read_tree, write_tree

IDENTITY = "trainer/dp0/tp0/pp0"


def _draws(gen: torch.Generator) -> list:
    return [torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)],
            np.random.randn(3).tolist(), torch.rand(4, generator=gen).tolist()]


def test_free_form_tree_round_trips_every_supported_kind(tmp_path):
    tree = {"none": None, "flag": True, "count": 7, "ratio": 0.25, "name": "grpo", "ids": np.arange(5),
            "mask": torch.tensor([True, False]), "nested": {"deeper": {"x": np.ones((2, 3), np.float32)}}}
    with h5py.File(tmp_path / "t.h5", "w") as f:
        write_tree(f.create_group("t"), tree)
    with h5py.File(tmp_path / "t.h5", "r") as f:
        got = read_tree(f["t"])
    assert {k: got[k] for k in ("none", "flag", "count", "ratio", "name")} == \
        {"none": None, "flag": True, "count": 7, "ratio": 0.25, "name": "grpo"}
    assert type(got["count"]) is int and type(got["flag"]) is bool
    np.testing.assert_array_equal(got["ids"], np.arange(5))
    assert torch.equal(got["mask"], tree["mask"])
    np.testing.assert_array_equal(got["nested"]["deeper"]["x"], np.ones((2, 3), np.float32))


def test_values_that_would_need_pickle_are_refused(tmp_path):
    with h5py.File(tmp_path / "t.h5", "w") as f, pytest.raises(TypeError, match="without pickle"):
        write_tree(f.create_group("t"), {"ids": [1, 2, 3]})


def test_rng_round_trip_restores_identical_random_streams(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    gen = torch.Generator().manual_seed(4)
    np.random.randn()  # leaves a cached gaussian in numpy's legacy state
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, RankState(IDENTITY, rng=capture_rng({"sampling": gen})))
    expected = _draws(gen)
    torch.manual_seed(99), np.random.seed(99), random.seed(99), gen.manual_seed(99)
    restored = CheckpointManager(tmp_path).load_latest(IDENTITY)
    restore_rng(restored.rng, {"sampling": gen})
    assert _draws(gen) == expected


def test_restoring_an_unsaved_generator_names_the_saved_ones():
    state = capture_rng({"a": torch.Generator()})
    with pytest.raises(KeyError, match=r"\['a'\]"):
        restore_rng(state, {"b": torch.Generator()})


def _adamw_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01, betas=(0.8, 0.9))


def _train_step(model, opt, seed: int) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def test_adamw_state_round_trip_continues_training_bitwise_identically(tmp_path):
    model, opt = _adamw_model(0)
    for s in range(3):
        _train_step(model, opt, s)
    tensors, meta = optimizer_tensors(opt, model.named_parameters())
    assert {"0.weight.exp_avg", "0.weight.exp_avg_sq", "0.weight.step"} <= set(tensors)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(3, RankState(IDENTITY, {"tp": 0, "pp": 0, "dp": 0}, model=model.state_dict(),
                              optim=tensors, optim_meta=meta))
    restored = CheckpointManager(tmp_path).load_latest(IDENTITY)
    twin, twin_opt = _adamw_model(1)
    twin.load_state_dict(restored.model)
    load_optimizer_tensors(twin_opt, twin.named_parameters(), restored.optim, restored.optim_meta)
    assert twin_opt.param_groups[0]["betas"] == (0.8, 0.9)
    _train_step(model, opt, 3), _train_step(twin, twin_opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_shared_state_and_data_position_come_back_keyed_by_identity(tmp_path):
    shared = SharedState(counters={"step": 5, "samples": 640}, sampling={"carry": {"ids": np.arange(3)}},
                         config_yaml="model:\n  path: m\n")
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(5, RankState(IDENTITY, {"dp": 0}, data_position={"epoch": 1, "next": 12}), shared)
    got = CheckpointManager(tmp_path).load_latest(IDENTITY)
    assert got.step == 5 and got.data_position == {"epoch": 1, "next": 12}
    assert got.shared.counters == {"step": 5, "samples": 640}
    assert got.shared.config_yaml == shared.config_yaml
    np.testing.assert_array_equal(got.shared.sampling["carry"]["ids"], np.arange(3))
    # an identity of another layout: found=False, the saved trainers' records to reshard from
    other = CheckpointManager(tmp_path).load_latest("trainer/dp7/tp0/pp0")
    assert not other.found and other.rng is None and other.data_position == {} and other.step == 5
    assert [r.identity for r in other.trainers] == [IDENTITY] and other.shared.counters["step"] == 5


def test_a_checkpoint_records_its_stage_split_and_load_from_refuses_another(tmp_path):
    """Uneven pipeline stages (`placement.trainer.pp_layers`) are in the trainer records: a resume and export-hf merge
    by them, and `checkpoint.load_from`, which reads one shard as it is, refuses a run with another split."""
    from yatt_hpc.ckpt import CheckpointError
    from yatt_hpc.ckpt.loader import pipeline_record

    weights = {"decoder.layers.0.mlp.linear_fc2.weight": torch.ones(2, 2)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, RankState(IDENTITY, {"dp": 0, "tp": 0, "pp": 0}, model=weights, extra=pipeline_record((2, 1))),
                 SharedState())
    assert CheckpointManager(tmp_path).load_latest(IDENTITY).pipeline_split == (2, 1)
    step, got = CheckpointManager(tmp_path).load_from(tmp_path, tp=0, pp=0, split=(2, 1))
    assert step == 3 and torch.equal(got["decoder.layers.0.mlp.linear_fc2.weight"], torch.ones(2, 2))
    with pytest.raises(CheckpointError, match=r"was written with placement.trainer.pp_layers=\[2, 1\] and this run "
                                              "has even stages; use its split"):
        CheckpointManager(tmp_path).load_from(tmp_path, tp=0, pp=0)
