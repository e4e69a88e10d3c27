"""tests/programs/held_engine.py, the stand-in that holds one rollout until an event (the stop tests lean on it)."""
from __future__ import annotations

import threading

import pytest

from tests.conftest import wait_for_file
from tests.programs.held_engine import DIR_ENV, HeldEngine, held_env, holding_marker, release
from yatt_hpc.rollout.engine import TEST_WRAPPER_ENV, maybe_wrap_for_tests


class Inner:
    """What the wrapper reads of an engine: its weight version, and generate."""

    weight_version = 0

    def generate(self, requests, on_result=None, on_step=None):
        return [f"done {r}" for r in requests]


@pytest.fixture
def held_dir(tmp_path, monkeypatch):
    for name, value in held_env(tmp_path / "held", "released").items():
        monkeypatch.setenv(name, value)
    return tmp_path / "held"


def test_the_rollout_on_the_chosen_weights_holds_until_released_then_runs_once(held_dir):
    inner = Inner()
    engine = HeldEngine(inner)
    assert engine.generate(["a"]) == ["done a"]  # version 0: step 1 runs through
    inner.weight_version = 1
    out = []
    rollout = threading.Thread(target=lambda: out.append(engine.generate(["b"])), daemon=True)
    rollout.start()
    wait_for_file(holding_marker(held_dir), timeout_s=30, alive=rollout.is_alive)  # what the stop tests wait for
    assert rollout.is_alive() and out == []
    release(held_dir)
    rollout.join(30)
    assert not rollout.is_alive() and out == [["done b"]]
    assert engine.generate(["c"]) == ["done c"]  # once per engine


def test_an_engine_built_after_a_hold_runs_through(held_dir):
    holding_marker(held_dir).parent.mkdir(parents=True)
    holding_marker(held_dir).write_text("1\n")  # an earlier attempt held
    inner = Inner()
    inner.weight_version = 5
    assert HeldEngine(inner).generate(["a"]) == ["done a"]


def test_the_test_hook_wraps_a_list_in_its_order(held_dir):
    engine = Inner()
    spec = "tests.programs.held_engine:HeldEngine,tests.programs.wrapped_engine:WrappedEngine"
    wrapped = maybe_wrap_for_tests(engine, "hf", {TEST_WRAPPER_ENV: spec})
    assert type(wrapped).__name__ == "WrappedEngine" and isinstance(wrapped.inner, HeldEngine)
    assert wrapped.inner.inner is engine


def test_an_unknown_hold_end_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    monkeypatch.setenv("YATT_TEST_HOLD_UNTIL", "never")
    with pytest.raises(ValueError, match="YATT_TEST_HOLD_UNTIL='never': one of stopped, signal, released"):
        HeldEngine(Inner())
