"""`yatt-hpc plan` output and the README's config reference, pinned as golden text."""
import re
from pathlib import Path

import pytest
from rich.console import Console

from tests.golden.golden import assert_golden
from yatt_hpc.config import load_config
from yatt_hpc.config.docs import reference_markdown
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


def test_readme_config_reference_is_current():
    readme = (REPO / "README.md").read_text()
    match = re.search(r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", readme, re.S)
    assert match, "README.md lacks the <!-- config-reference:start/end --> block"
    assert match.group(1) == reference_markdown(), (
        "README config reference is stale; regenerate: .venv/bin/python tools/update_readme_reference.py")
