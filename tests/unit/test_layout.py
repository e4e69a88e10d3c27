"""The house layout holds: what each package may import (docs/architecture.md), and its size."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PKG = REPO / "yatt_hpc"
# package -> the yatt_hpc packages/modules it may import (besides itself); docs/architecture.md draws it
ALLOWED = {
    "sched": {"placement"},
    "comm": {"sched", "placement", "batch", "activity", "weight_group"},
    "roles": {"comm", "sched", "batch", "activity", "ckpt", "config", "data", "errors", "placement", "reward",
              "rollout", "train", "runtime", "vision", "hf_config"},  # runtime: RankStats, the per-rank stats it reports to
    "runtime": {"roles", "comm", "sched", "batch", "activity", "ckpt", "config", "data", "errors", "launch",
                "metrics", "placement"},
    "demo": set(),
    "rollout": {"activity", "offload", "vision", "weight_group"},  # engines join a weight pair's group
    "train": {"activity", "batch", "config", "offload", "vision", "hf_config"},
    "reward": {"rollout", "data", "vision", "hf_config"},  # the judge runs on a rollout engine with the tokenizer data/ loads
    "data": {"config", "demo", "vision"},
    "vision": set(),  # a leaf: every component may decode images
}


def yatt_imports(path: Path) -> set[str]:
    """The yatt_hpc top-level packages/modules a file imports (anywhere in it, lazily or not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {n.split(".")[1] for n in names if n.startswith("yatt_hpc.")}
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_the_layout_allows(package):
    for path in sorted((PKG / package).glob("*.py")):
        extra = yatt_imports(path) - ALLOWED[package] - {package}
        assert not extra, f"{path.relative_to(REPO)} imports yatt_hpc.{sorted(extra)}: not allowed for {package}/"


def test_the_scheduling_package_needs_neither_mpi_nor_torch():
    modules = [f"yatt_hpc.sched.{p.stem}" for p in sorted((PKG / "sched").glob("*.py")) if p.stem != "__init__"]
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in ('mpi4py', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing yatt_hpc.sched pulled in {out.stdout.strip()}"


def test_the_vision_package_needs_no_torch():
    code = "import sys, yatt_hpc.vision.images; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing yatt_hpc.vision pulled in torch"


def test_every_package_stays_small():
    for package in sorted(p for p in PKG.iterdir() if (p / "__init__.py").exists()):
        modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, f"{package.name}/ has {len(modules)} modules: split it by kind"
