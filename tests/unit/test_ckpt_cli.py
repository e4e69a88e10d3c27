"""`yatt-hpc ckpt list|verify|export-hf` on real checkpoints: tables, exit codes, one-line errors.

    .venv/bin/python -m pytest tests/unit/test_ckpt_cli.py -q
"""
from __future__ import annotations

import os

from click.testing import CliRunner

from tests.unit.test_ckpt_manager import save_steps
from yatt_hpc.ckpt.cli import ckpt


def run(*args):
    return CliRunner().invoke(ckpt, [str(a) for a in args])


def test_list_shows_every_step_with_size_and_verification(tmp_path):
    save_steps(tmp_path, [1, 2])
    out = run("list", tmp_path)
    assert out.exit_code == 0, out.output
    rows = [line for line in out.output.splitlines() if "MiB" in line]
    assert len(rows) == 2 and all("yes" in r for r in rows)


def test_verify_passes_on_good_checkpoints_and_exits_1_on_a_bad_one(tmp_path):
    ckpt_dir = save_steps(tmp_path, [1, 2])
    assert run("verify", tmp_path).exit_code == 0
    path = ckpt_dir / "step-2" / "model-tp0-pp0.safetensors"
    os.truncate(path, 100)
    out = run("verify", tmp_path)
    assert out.exit_code == 1 and "step 2: BAD: model-tp0-pp0.safetensors: size 100" in out.output
    assert run("verify", tmp_path, "--step", 1).exit_code == 0
    assert run("verify", ckpt_dir, "--step", 2).exit_code == 1


def test_user_errors_exit_2_with_one_line(tmp_path):
    for args in (("list", tmp_path), ("verify", tmp_path)):
        out = run(*args)
        assert out.exit_code == 2 and "no checkpoints under" in out.output
        assert len(out.output.strip().splitlines()) == 1
    save_steps(tmp_path, [1])
    out = run("verify", tmp_path, "--step", 9)
    assert out.exit_code == 2 and "no checkpoint step 9" in out.output
    out = run("export-hf", tmp_path, "--step", 9, "--out", tmp_path / "hf")
    assert out.exit_code == 2 and "no checkpoint step 9" in out.output


def test_the_yatt_hpc_command_carries_the_ckpt_group(tmp_path):
    from yatt_hpc.cli import main

    save_steps(tmp_path, [1])
    out = CliRunner().invoke(main, ["ckpt", "verify", str(tmp_path)])
    assert out.exit_code == 0 and out.output.strip() == "step 1: ok"
