"""Installs reproduce: constraints/lock.txt (`make lock`, uv pip compile) pins every dependency of setup.py
inside its range, keeps the CPU torch, and is what this venv was installed from (`make install`)."""
import ast
import importlib.metadata
import re

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

LOCK = REPO / "constraints" / "lock.txt"


def lock_pins() -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)", LOCK.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def setup_requirements() -> list[Requirement]:
    """install_requires and the dev extra, read from setup.py's literals (setup.py is not run)."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    return [Requirement(r) for r in kw["install_requires"] + kw["extras_require"]["dev"]]


def test_the_lock_pins_every_requirement_of_setup_py_inside_its_range():
    pins = lock_pins()
    for req in setup_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is in setup.py but not in {LOCK.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"{LOCK.name} pins {req.name}=={pins[name]}, outside setup.py's {req}: run `make lock`"


def test_the_lock_keeps_the_cpu_build_of_torch_and_no_cuda_packages():
    pins = lock_pins()
    cpu = re.search(r"^torch==(\S+)", (REPO / "constraints" / "cpu.txt").read_text(), re.M).group(1)
    assert pins["torch"].split("+")[0] == cpu and pins["torch"].endswith("+cpu"), pins["torch"]
    cuda = sorted(n for n in pins if n.startswith(("nvidia-", "triton", "cuda-")))
    assert not cuda, f"{LOCK.name} pins CUDA packages {cuda}: `make lock` must find the CPU torch (TORCH_SOURCE)"


def test_the_peer_venv_and_the_project_share_the_lock():
    pins = lock_pins()
    for line in (REPO / "bench" / "peers" / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            assert req.specifier.contains(pins[canonicalize_name(req.name)]), f"{req} vs the lock"


def test_this_venv_holds_the_locked_versions():
    drift = []
    for name, version in lock_pins().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # the peer's packages (trl...) are in the lock, not in the project's venv
        if installed != version:
            drift.append(f"{name} {installed} (lock: {version})")
    assert not drift, f"the venv differs from {LOCK.name}: {', '.join(drift)}; `make install` installs the lock"
