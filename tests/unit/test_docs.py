"""The pages a user reads stay true: generated pages are current, links resolve, shown commands work.

    .venv/bin/python -m pytest tests/unit/test_docs.py -q

Commands are taken from the ```bash blocks of README.md and docs/*.md. `yatt-hpc` commands are parsed
against the CLI (every subcommand, option and file they name must exist); the cheap ones (`plan`,
`config`) are run. `make` targets must exist in the Makefile, scripts and files on disk. `make demo`
itself runs the demo command (and tests/mpi runs it on every CI run).
"""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tests.conftest import REPO
from yatt_hpc.cli import main as cli
from yatt_hpc.config.docs import reference_markdown

PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_PAGES = [p for p in PAGES if p.name != "BENCHMARKS.md"]
CHEAP = {("plan",), ("config", "show"), ("config", "docs")}  # pure: read the config, print, write nothing


def load_renderer():
    spec = importlib.util.spec_from_file_location("bench_render", REPO / "bench" / "render.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_benchmarks_md_is_rendered_from_the_current_results():
    assert (REPO / "BENCHMARKS.md").read_text() == load_renderer().render(), \
        "BENCHMARKS.md is stale: .venv/bin/python bench/run_all.py --render-only"


def test_every_benchmark_result_has_an_entry_and_a_limit():
    render = load_renderer()
    known = {b.result for b in render.BENCHES}
    for path in sorted((REPO / "bench" / "results").glob("*.json")):
        assert path.stem in known, f"{path.name} has no Bench entry in bench/render.py"
    assert all(b.limits.strip() for b in render.BENCHES)


def test_the_config_reference_is_generated_from_the_field_docstrings():
    page = (REPO / "docs" / "configuration.md").read_text()
    match = re.search(r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", page, re.S)
    assert match, "docs/configuration.md lacks the <!-- config-reference:start/end --> block"
    assert match.group(1) == reference_markdown(), \
        "the config reference is stale: .venv/bin/python tools/update_config_reference.py"


def test_no_page_dates_itself():
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bsession\b(?! ?-wide)(?!-)", line) or "per session" in line, \
                f"{page.relative_to(REPO)}:{n} dates or narrates itself: {line.strip()[:120]}"


# -- links ---------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    found = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            found.add("".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return LINK.findall(text)


@pytest.mark.parametrize("page", [pytest.param(p, id=p.relative_to(REPO).as_posix()) for p in PAGES])
def test_every_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+://|mailto:", target):
            continue  # external: not fetched
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def test_the_readme_reaches_every_guide():
    readme = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    for guide in sorted((REPO / "docs").glob("*.md")):
        assert guide.resolve() in readme, f"README.md does not link {guide.relative_to(REPO)}"


# -- commands ------------------------------------------------------------------------------------------------

def shown_commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line, argv) of every command in the page's ```bash blocks: comments dropped, continuations joined,
    `A; B` split, leading VAR=value assignments and sudo dropped."""
    out, block, start = [], None, 0
    lines = page.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            block = [] if line.strip() == "```bash" and block is None else None
            continue
        if block is None:
            continue
        if block and block[-1][1].endswith("\\"):
            block[-1] = (block[-1][0], block[-1][1][:-1] + " " + line.strip())
        else:
            block.append((n, line.strip()))
        if not line.rstrip().endswith("\\"):
            start, parts = block[-1][0], [[]]
            for token in shlex.split(block[-1][1], comments=True):
                parts[-1].append(token.removesuffix(";"))
                if token.endswith(";"):
                    parts.append([])
            for argv in parts:
                while argv and (re.match(r"^[A-Z_]+=", argv[0]) or argv[0] == "sudo"):
                    argv.pop(0)
                if argv:
                    out.append((start, argv))
    return out


def cli_path(argv: list[str]) -> tuple[tuple[str, ...], click.Command, list[str]]:
    """The subcommand names argv invokes, the leaf command, and the leaf's own arguments."""
    cmd, names = cli, []
    while isinstance(cmd, click.Group) and argv and not argv[0].startswith("-"):
        sub = cmd.get_command(click.Context(cmd), argv[0])
        assert sub is not None, f"yatt-hpc has no command {' '.join([*names, argv[0]])}"
        names.append(argv.pop(0))
        cmd = sub
    return tuple(names), cmd, argv


def check_yatt(argv: list[str]) -> None:
    names, cmd, rest = cli_path(list(argv))
    try:
        cmd.make_context(" ".join(names), list(rest))
    except click.BadParameter as err:
        # run outputs (runs/...) need not exist in a checkout; everything else a command names must
        if not (err.param and any(a.startswith("runs/") for a in rest) and "does not exist" in str(err)):
            raise
    for arg in rest:
        if arg.endswith((".yaml", ".py", ".txt", ".sbatch")):
            assert (REPO / arg).exists(), f"yatt-hpc {' '.join(argv)}: no file {arg}"
    if names in CHEAP:
        result = CliRunner().invoke(cli, argv, catch_exceptions=False)
        assert result.exit_code == 0, f"yatt-hpc {' '.join(argv)} exited {result.exit_code}:\n{result.output[-2000:]}"


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))


def check_command(argv: list[str]) -> None:
    prog, args = argv[0], argv[1:]
    if prog.endswith("yatt-hpc"):
        check_yatt(args)
    elif prog == "make":
        assert set(a for a in args if "=" not in a) <= make_targets(), f"make {args}: no such target"
    elif prog in ("bash", "sbatch") or prog.startswith(("tools/", "./")):
        script = args[0] if prog in ("bash", "sbatch") else prog
        assert (REPO / script).exists(), f"{' '.join(argv)}: no {script}"
    elif prog.endswith("python"):
        if args[:2] == ["-m", "pytest"]:
            assert all((REPO / a).exists() for a in args[2:] if not a.startswith("-")), f"{argv}: no such tests"
        else:
            assert (REPO / args[0]).exists(), f"{' '.join(argv)}: no {args[0]}"
    elif prog == "pip" and args[:1] == ["install"]:  # an extra of setup.py: `pip install 'yatt-hpc[trackers]'`
        for spec in args[1:]:
            extra = re.fullmatch(r"yatt-hpc\[(\w+)\]", spec)
            assert extra and f'"{extra.group(1)}":' in (REPO / "setup.py").read_text(), f"{argv}: no such extra"
    elif prog in ("wandb", "mlflow"):  # a tracker's own command, installed with the trackers extra
        assert Path(sys.executable).with_name(prog).exists(), f"{' '.join(argv)}: {prog} is not installed"
    else:
        raise AssertionError(f"a shown command this test cannot check: {' '.join(argv)} (teach check_command)")


@pytest.mark.parametrize("page", [pytest.param(p, id=p.relative_to(REPO).as_posix()) for p in COMMAND_PAGES])
def test_every_shown_command_matches_the_cli_and_the_repository(page, monkeypatch):
    monkeypatch.chdir(REPO)  # configs name paths relative to the repository root, as the pages do
    commands = shown_commands(page)
    assert commands or page.name in ("architecture.md",), f"{page.name} shows no command to run"
    for line, argv in commands:
        try:
            check_command(argv)
        except (AssertionError, click.ClickException) as err:
            raise AssertionError(f"{page.relative_to(REPO)}:{line}: {err}") from err


def test_the_first_two_commands_lead_the_readme():
    commands = shown_commands(REPO / "README.md")
    assert [argv for _, argv in commands[:2]] == [["make", "demo"], ["make", "test"]]


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_a_new_benchmark_json_renders_with_one_entry(tmp_path, monkeypatch):
    render = load_renderer()
    report = {"question": "B10 checkpoint staging memory at a 0.5B shape", "target": "<= 1.2x the state", "met": True,
              "verdict": "peak 1.1x the state", "notes": "", "machine": {"cpus": 2, "mem_mb": 24576, "python": "3.11"},
              "rows": [{"label": "peak host memory", "value": "2.1 [2.0-2.2] GiB (n=3)"}]}
    (tmp_path / "ckpt_memory.json").write_text(json.dumps(report))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    monkeypatch.setattr(render, "BENCHES", [])
    with pytest.raises(SystemExit, match="ckpt_memory.json has no entry"):
        render.render()
    monkeypatch.setattr(render, "BENCHES", [render.Bench("B10", "ckpt_memory", limits="The staging buffers.")])
    page = render.render()
    assert "## B10: checkpoint staging memory at a 0.5B shape" in page and "| peak host memory | 2.1" in page
    assert "**What limits it.** The staging buffers." in page
