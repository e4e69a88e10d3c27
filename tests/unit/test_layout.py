"""The house layout holds: what each package may import (docs/architecture.md), and its size."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PKG = REPO / "yatt_hpc"
# package -> the yatt_hpc packages it may import (besides itself); "pkg.module" allows one module of a
# package and nothing else of it. docs/architecture.md draws the same table.
ALLOWED = {
    "sched": {"placement"},
    "comm": {"sched", "placement", "batch", "metrics.activity", "device"},
    "roles": {"algos", "comm", "sched", "batch", "metrics.activity", "ckpt", "config", "data", "errors", "placement", "reward",
              "rollout", "train", "runtime", "vision", "models", "lora",
              "agent", "critic"},  # runtime: RankStats, the per-rank stats it reports to
    "runtime": {"roles", "comm", "sched", "batch", "metrics", "ckpt", "config", "data", "errors", "launch", "algos",
                "placement", "agent.tools_group"},  # the worker builds the tools group's controller
    "demo": set(),
    # multi-turn rollouts: the loop drives a rollout/ engine, renders tool turns with the data/ tokenizer; the
    # tools group's calls cross MPI (comm) and its ranks checkpoint their RNG (ckpt)
    "agent": {"config", "rollout", "batch", "data", "comm", "ckpt", "errors"},
    # engines join a weight pair's group (device.weight_group); a MoE engine takes experts by checkpoint name (models)
    "rollout": {"metrics.activity", "device", "vision", "models"},
    "train": {"algos", "metrics.activity", "ckpt.optim", "batch", "config", "device", "vision", "models", "optim",
              "lora.layers", "moe"},  # the policy attaches adapters; its MoE layers, routing replay, lockstep
    "optim": set(),  # the optimizer: torch only
    # the value model: a GPTModel of train/ with a scalar head, trained with the policy's optimizer machinery
    "critic": {"algos", "batch", "config", "metrics.activity", "models", "train"},
    # LoRA's adapters sit on the Megatron model and move between layouts through the converter's splits
    "lora": {"config", "train.convert", "train.hf_arch", "train.mcore"},
    # a MoE policy's layers (train/'s model swaps them in), its forward with the engine's experts, and expert
    # parallelism's lockstep (a one-token forward of train.megatron_model)
    "moe": {"batch", "train.mcore", "train.shared_prompt", "train.cpu_compat", "train.megatron_model"},
    "algos": set(),  # the formulas: a leaf, and no process group in it (test below)
    "reward": {"rollout", "data", "vision", "models"},  # the judge runs on a rollout engine with the tokenizer data/ loads
    "data": {"config", "demo", "vision"},
    "vision": set(),  # a leaf: every component may decode images
    "device": set(),  # leaves: torch only (device), json + transformers lazily (models)
    "models": set(),
    "metrics": set(),  # metrics.activity is marked by comm, roles, train, rollout, ckpt: a leaf
}


def yatt_imports(path: Path) -> set[tuple[str, str]]:
    """(package, module) of every yatt_hpc import in a file (anywhere in it, lazily or not); module is ""
    when the import names the package itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "yatt_hpc" and len(parts) > 1:
                found.add((parts[1], parts[2] if len(parts) > 2 else ""))
    return found


def disallowed(imports: set[tuple[str, str]], allowed: set[str], package: str) -> set[str]:
    return {f"{pkg}.{mod}".rstrip(".") for pkg, mod in imports
            if pkg != package and pkg not in allowed and f"{pkg}.{mod}" not in allowed}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_the_layout_allows(package):
    for path in sorted((PKG / package).glob("*.py")):
        extra = disallowed(yatt_imports(path), ALLOWED[package], package)
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


@pytest.mark.parametrize("module", ["yatt_hpc.metrics.activity", "yatt_hpc.models.hf_config"])
def test_the_shared_leaves_need_neither_mpi_nor_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('mpi4py', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} pulled in {out.stdout.strip()}"


def test_nothing_but_the_shared_data_model_lives_at_the_package_root():
    roots = sorted(p.name for p in PKG.glob("*.py"))
    assert roots == ["__init__.py", "batch.py", "cli.py", "errors.py"], \
        f"yatt_hpc/ holds {roots}: a module that belongs to a room goes there (docs/architecture.md)"


def test_every_package_stays_small():
    for package in sorted(p for p in PKG.iterdir() if (p / "__init__.py").exists()):
        modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, f"{package.name}/ has {len(modules)} modules: split it by kind"


def test_the_formulas_hold_no_communication():
    """yatt_hpc/algos is pure: no torch.distributed, no MPI (global statistics come in through `reduce`)."""
    for path in sorted((PKG / "algos").glob("*.py")):
        text = path.read_text()
        for banned in ("torch.distributed", "mpi4py", "import megatron"):
            assert banned not in text, f"{path.name} uses {banned}"
