"""Compare text with a golden file; on mismatch show the diff and how to regenerate.

    YATT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/golden    # rewrite the golden files
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest


def assert_golden(text: str, path: Path) -> None:
    if os.environ.get("YATT_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"golden file {path} is missing; create it with: YATT_UPDATE_GOLDEN=1 pytest {path.parent}", pytrace=False)
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(path), "now"))
        pytest.fail(f"output differs from {path}:\n{diff}\nIf the change is intended, regenerate with:\n"
                    f"  YATT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest {path.parent}", pytrace=False)
