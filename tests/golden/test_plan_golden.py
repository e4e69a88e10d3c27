"""`yatt-hpc plan` output, pinned as golden text (the config reference: tests/unit/test_docs.py)."""
from pathlib import Path

import pytest
from rich.console import Console

from tests.golden.golden import assert_golden
from yatt_hpc.config import load_config
from yatt_hpc.placement import plan
from yatt_hpc.placement.show import print_plan

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


@pytest.mark.parametrize("config", [pytest.param(p, id=p.stem) for p in sorted((REPO / "configs").glob("*.yaml"))])
def test_plan_output_matches_golden(config):
    console = Console(width=140, record=True, file=open("/dev/null", "w"), color_system=None)
    cfg = load_config(config)
    print_plan(plan(cfg), "RUN_DIR", console, python="python3", cfg=cfg)
    assert_golden(console.export_text(), HERE / "plans" / f"{config.stem}.txt")

