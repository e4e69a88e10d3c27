"""The leader styles its console only for a terminal the user sees: mpirun gives ranks a pseudo-terminal,
so the launcher, which holds the user's stdout, decides (YATT_COLOR), and NO_COLOR always wins."""
import io
import sys

import pytest

from yatt_hpc.launch.local import launch_env
from yatt_hpc.runtime.worker import leader_console


@pytest.mark.parametrize("tty,environ,want", [
    pytest.param(True, {}, "1", id="terminal"),
    pytest.param(False, {}, "0", id="redirected"),
    pytest.param(True, {"NO_COLOR": "1"}, "0", id="no-color"),
    pytest.param(False, {"YATT_COLOR": "1"}, "1", id="the-user-asks"),
])
def test_the_launcher_tells_the_ranks_whether_the_user_sees_a_terminal(monkeypatch, tty, environ, want):
    stdout = io.StringIO()
    stdout.isatty = lambda: tty
    monkeypatch.setattr(sys, "stdout", stdout)
    assert launch_env(environ)["YATT_COLOR"] == want


@pytest.mark.parametrize("color,styled", [("0", False), ("1", True)])
def test_the_leader_console_styles_only_what_the_launcher_allows(monkeypatch, color, styled):
    monkeypatch.setenv("YATT_COLOR", color)
    console = leader_console()
    with console.capture() as out:
        console.print("[bold]step 1/2[/bold]")
    assert console.is_terminal is styled and ("\x1b[" in out.get()) is styled
