"""Rewrite the field reference of docs/configuration.md from the config fields' docstrings.

    .venv/bin/python tools/update_config_reference.py

tests/unit/test_docs.py fails when the page's table differs from what this writes.
"""
import re
from pathlib import Path

from yatt_hpc.config.docs import reference_markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def main() -> None:
    text = PAGE.read_text()
    if START not in text:
        raise SystemExit(f"{PAGE} has no config-reference block to update")
    new = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: START + reference_markdown() + END, text, flags=re.S)
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
