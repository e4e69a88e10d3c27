"""The built-in Python tool: each call a fresh interpreter in a sandbox (`agent.tools: [{function: builtin:python}]`).

    box = PythonSandbox(SandboxConfig())          # refuses here when no network namespace can be made
    box.run("print(6 * 7)")                       # SandboxRun(output='42\\n', status='ok', ...)

Test: .venv/bin/python -m pytest tests/unit/test_sandbox.py

A call starts `sandbox_child.py` (a new session of its own) with the program on stdin. That process unshares
a network namespace (no interface but a down loopback: no connection leaves it), a mount namespace (fresh
tmpfs on /tmp, /var/tmp, /dev/shm: what the program writes there vanishes with it) and a PID namespace (the
program is its PID 1: when it ends, every process it forked is killed), sets RLIMIT_CPU, RLIMIT_AS,
RLIMIT_FSIZE, RLIMIT_NPROC, drops to a uid of its own (as root; elsewhere a user namespace maps the rank's
uid) and execs `python -I main.py` in its private directory. Output (stdout and stderr together) is read
here up to `output_chars` and the rest drained and dropped; past the wall-clock limit the whole session is
killed. A program that fails, is killed or times out comes back as an error text for the model, never an
exception on the rank.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from yatt_hpc.config.agent import SandboxConfig

CHILD = Path(__file__).with_name("sandbox_child.py")
TIMEOUT, SETUP_FAILED = 124, 125
CUT_MARK = b"\x00[cut]\x00"
DRAIN_LIMIT = 64 * 2**20  # bytes of output read (and dropped) before a flooding program is killed
_UIDS = itertools.count()
_UID_BASE = 200_000  # the sandbox's uids when the rank is root: unused by any account, one per call in flight


class SandboxError(RuntimeError):
    """The sandbox cannot run here as configured; the message names the setting that would allow it."""


@dataclass(frozen=True)
class SandboxRun:
    output: str
    status: str  # ok | error | timeout
    exit_code: int
    seconds: float


class PythonSandbox:
    """Runs Python source under `SandboxConfig`'s limits; thread-safe (each call its own processes)."""

    name = "python"
    description = "Run a Python 3 program in a fresh sandboxed interpreter and read what it prints (no network)."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"]}

    def __init__(self, cfg: SandboxConfig, user: str = "the Python tool") -> None:
        """`user`: who runs programs here, as a refusal names it."""
        self.cfg = cfg
        self.isolate = True
        if not os.access(cfg.python, os.X_OK):
            raise SandboxError(f"agent.sandbox.python={cfg.python!r} is not an executable file here; give the path "
                               "of a Python 3 interpreter every user may run")
        probe = self._start("pass", isolate=True)
        ok = probe.wait(timeout=30) == 0
        why = probe.stderr.read().decode(errors="replace").strip() if probe.stderr else ""
        if not ok:
            if not cfg.allow_network:
                raise SandboxError(f"{user} cannot make a network namespace on this rank ({why or 'no reason'}); "
                                   "run these ranks where unshare(CLONE_NEWNET) is allowed (as root, or with "
                                   "unprivileged user namespaces), or set agent.sandbox.allow_network=true")
            self.isolate = False  # limits and a private directory only; the config allows the network

    def __call__(self, code: str) -> str:
        """The tool as the model calls it: the program's output, or an error text."""
        run = self.run(code)
        if run.status == "ok":
            return run.output
        raise ToolFailure(run.output, timeout=run.status == "timeout")

    def _limits(self, isolate: bool) -> str:
        uid = _UID_BASE + (os.getpid() * 97 + next(_UIDS)) % 100_000 if os.getuid() == 0 else None
        c = self.cfg
        return json.dumps({"isolate": isolate, "allow_network": c.allow_network, "cpu_s": c.cpu_s,
                           "memory_mb": c.memory_mb, "file_mb": c.file_mb, "processes": c.processes,
                           "timeout_s": c.timeout_s, "uid": uid, "python": c.python})

    def _start(self, code: str, isolate: bool) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-I", str(CHILD), self._limits(isolate)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE if code == "pass" else subprocess.STDOUT,
                                start_new_session=True, env={"PATH": "/usr/bin:/bin"})
        try:
            proc.stdin.write(code.encode("utf-8", errors="replace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        return proc

    def run(self, code: str) -> SandboxRun:
        start = time.monotonic()
        proc = self._start(code, self.isolate)
        kept, flooded = _read_capped(proc, self.cfg.output_chars * 4, start + self.cfg.timeout_s + 5.0)
        try:
            code_ = proc.wait(timeout=max(0.0, start + self.cfg.timeout_s + 5.0 - time.monotonic()))
        except subprocess.TimeoutExpired:
            code_ = TIMEOUT
        _kill_session(proc)
        text = kept.decode("utf-8", errors="replace")
        text = _cut(text, self.cfg.output_chars, flooded)
        seconds = time.monotonic() - start
        if code_ == 0 and not flooded:
            return SandboxRun(text, "ok", 0, seconds)
        if code_ == TIMEOUT:
            return SandboxRun(f"timeout: the program ran past {self.cfg.timeout_s:g} s and was killed\n{text}",
                              "timeout", code_, seconds)
        if flooded:
            return SandboxRun(f"error: the program wrote over {DRAIN_LIMIT // 2**20} MiB of output and was killed\n{text}",
                              "error", code_, seconds)
        why = {SETUP_FAILED: "the sandbox could not start", 128 + signal.SIGXCPU: "CPU time limit",
               128 + signal.SIGKILL: "killed", 128 + signal.SIGXFSZ: "file size limit"}.get(code_, f"exit status {code_}")
        return SandboxRun(f"error ({why})\n{text}", "error", code_, seconds)


class ToolFailure(Exception):
    """A tool's failure the model should read (its text); `timeout` marks a call past its limit."""

    def __init__(self, text: str, timeout: bool = False) -> None:
        super().__init__(text)
        self.timeout = timeout


def _read_capped(proc: subprocess.Popen, keep: int, deadline: float) -> tuple[bytes, bool]:
    """The first and the last `keep` bytes of the output (a traceback's last line is the one that matters);
    the middle read and dropped (so a flood cannot block the program on a full pipe and the rank holds no more
    than 2 x `keep`), up to DRAIN_LIMIT, after which the program is killed."""
    head, tail, seen = bytearray(), bytearray(), 0

    def kept() -> bytes:
        return bytes(head) + (CUT_MARK if seen > len(head) + len(tail) else b"") + bytes(tail)

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not sel.select(timeout=min(left, 0.5)):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                return kept(), False
            seen += len(chunk)
            room = keep - len(head)
            head.extend(chunk[:room] if room > 0 else b"")
            tail.extend(chunk[max(room, 0):])
            del tail[:-keep]
            if seen > DRAIN_LIMIT:
                _kill_session(proc)
                return kept(), True
    _kill_session(proc)
    return kept(), False


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the call's session (sandbox_child and, through it, the namespace's PID 1); reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    if proc.stderr is not None:
        proc.stderr.close()


def _cut(text: str, limit: int, flooded: bool) -> str:
    """At most `limit` characters: the first and the last half, the cut marked."""
    mark = CUT_MARK.decode()
    dropped = mark in text
    if dropped:
        head, tail = text.split(mark, 1)
        text = head + tail
    if len(text) <= limit and not dropped and not flooded:
        return text
    half = limit // 2
    return text[:half] + f"\n... [output cut to {limit} characters] ...\n" + text[-half:]

