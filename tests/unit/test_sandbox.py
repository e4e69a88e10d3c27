"""The sandboxed Python tool against what an untrusted program tries; each is contained and an error for the model.

    .venv/bin/python -m pytest tests/unit/test_sandbox.py -q

Needs a rank that can make a network namespace (root, or unprivileged user namespaces); elsewhere the tool is
refused, which the last test checks by asking for an interpreter that is not there.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO
from yatt_hpc.agent.sandbox import PythonSandbox, SandboxError
from yatt_hpc.agent.tools import ToolBox, ToolCall, build_tool
from yatt_hpc.config.agent import AgentConfig, SandboxConfig, ToolSpec


@pytest.fixture(scope="module")
def box():
    try:
        return PythonSandbox(SandboxConfig(timeout_s=3, cpu_s=2, memory_mb=256, processes=16, output_chars=200, file_mb=16))
    except SandboxError as err:
        pytest.skip(f"no sandbox on this machine: {err}")


def test_a_program_runs_and_its_output_comes_back(box):
    run = box.run("import math\nprint(math.factorial(5))")
    assert (run.status, run.output) == ("ok", "120\n")


def test_writing_outside_its_directory_fails_and_leaves_nothing(box):
    # a directory of the rank's, writable by the rank, outside what the sandbox shadows with its own tmpfs
    # (a checkout under /tmp is not there at all inside the sandbox: the write would fail for another reason)
    shadowed = str(REPO).startswith(("/tmp/", "/var/tmp/", "/dev/shm/"))
    target = (Path.home() if shadowed else REPO) / f"sandbox-escape-{uuid.uuid4().hex}"
    probe = f"/tmp/yatt-escape-{uuid.uuid4().hex}"
    run = box.run(f"open({str(target)!r}, 'w').write('x')")
    assert run.status == "error" and "Permission denied" in run.output and not target.exists()
    run = box.run(f"open({probe!r}, 'w').write('x'); print('inside')")  # its own /tmp, gone with it
    assert run.status == "ok" and not os.path.exists(probe)
    run = box.run("open('big', 'wb').write(b'x' * (64 * 2**20))")  # past RLIMIT_FSIZE (16 MiB)
    assert run.status == "error"


def test_a_socket_reaches_nothing(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    run = box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    server.close()
    assert run.status == "error" and "connected" not in run.output.splitlines()
    assert "OSError" in run.output or "Error" in run.output


def test_a_fork_bomb_is_contained(box):
    start = time.monotonic()
    run = box.run("import os\nwhile True:\n    os.fork()")
    assert run.status in ("error", "timeout") and time.monotonic() - start < 15
    assert box.run("print('after')").output == "after\n", "the sandbox still works after it"


@pytest.mark.parametrize("code", [pytest.param("while True: pass", id="busy-loop"),
                                  pytest.param("import time\ntime.sleep(60)", id="sleep")])
def test_an_endless_program_is_killed(box, code):
    start = time.monotonic()
    run = box.run(code)
    assert run.status in ("timeout", "error") and time.monotonic() - start < 10
    assert "timeout" in run.output or "CPU time" in run.output


def test_a_program_past_its_cpu_limit_is_named_so():
    """CPU time runs out long before the wall clock: the CPU limit's SIGKILL (all a namespace's PID 1 gets of
    RLIMIT_CPU) is reported as the CPU limit, not as an unexplained kill."""
    try:
        box = PythonSandbox(SandboxConfig(timeout_s=30, cpu_s=1, memory_mb=256, processes=16, output_chars=200))
    except SandboxError as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    run = box.run("while True: pass")
    assert run.status == "error" and "CPU time limit" in run.output, run


def test_a_huge_output_is_cut_and_the_program_stopped(box):
    start = time.monotonic()
    run = box.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert run.status == "error" and len(run.output) < 500 and time.monotonic() - start < 10
    ok = box.run("print('y' * 1000)")
    assert ok.status == "ok" and ok.output.startswith("y" * 100) and "cut to 200 characters" in ok.output


def test_memory_past_the_limit_is_an_error(box):
    assert box.run("b = bytearray(1024 * 2**20)").status == "error"


def test_the_tool_reports_failures_to_the_model_through_the_toolbox(box):
    cfg = AgentConfig(tools=[ToolSpec(function="builtin:python")], sandbox=SandboxConfig(timeout_s=1))
    tools = ToolBox([build_tool(cfg.tools[0], cfg)], timeout_s=1)
    ok, failed, timed = tools.run([ToolCall("python", {"code": "print(2 + 2)"}),
                                   ToolCall("python", {"code": "raise SystemExit(3)"}),
                                   ToolCall("python", {"code": "while True: pass"})])
    assert (ok.status, ok.content) == ("ok", "4\n")
    assert failed.status == "error" and "exit status 3" in failed.content
    assert timed.status == "timeout"
    tools.close()


def test_allow_network_gives_the_program_the_ranks_network(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    open_box = PythonSandbox(SandboxConfig(timeout_s=3, allow_network=True))
    run = open_box.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    server.close()
    assert (run.status, run.output) == ("ok", "connected\n")


def test_an_unusable_interpreter_is_refused_naming_the_setting():
    with pytest.raises(SandboxError, match="agent.sandbox.python"):
        PythonSandbox(SandboxConfig(python="/no/such/python"))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root to start a non-root rank")
def test_a_non_root_rank_sandboxes_through_a_user_namespace():
    """The same child as an unprivileged user (`nobody`): a user namespace maps it to root inside, which may
    make the network, mount and PID namespaces; the network is unreachable and a fork bomb hits RLIMIT_NPROC."""
    from yatt_hpc.agent.sandbox import CHILD

    limits = json.dumps({"isolate": True, "allow_network": False, "cpu_s": 2, "memory_mb": 256, "file_mb": 4,
                         "processes": 16, "timeout_s": 5, "uid": None, "python": "/usr/bin/python3"})
    probe = ("import os, socket\nprint(sorted(os.listdir('/tmp')))\ntry:\n"
             "    socket.create_connection(('10.255.255.1', 80), timeout=1)\nexcept OSError as e:\n    print('blocked')\n")
    bomb = "import os\nwhile True:\n    os.fork()\n"
    out = [subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-I", str(CHILD), limits],
                          input=code, capture_output=True, text=True, timeout=30) for code in (probe, bomb)]
    if "sandbox setup failed" in out[0].stderr:
        pytest.skip(f"no unprivileged user namespaces here: {out[0].stderr.strip()}")
    assert out[0].returncode == 0 and out[0].stdout.split("\n")[:2] == ["['work']", "blocked"], out[0]
    assert out[1].returncode != 0 and "BlockingIOError" in out[1].stderr + out[1].stdout
