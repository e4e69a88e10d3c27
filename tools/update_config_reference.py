"""Rewrite the config reference block in README.md from the field docstrings.

    .venv/bin/python tools/update_readme_reference.py
"""
import re
from pathlib import Path

from yatt_hpc.config.docs import reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"


def main() -> None:
    text = README.read_text()
    new = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: START + reference_markdown() + END, text, flags=re.S)
    if START not in text:
        raise SystemExit("README.md has no config-reference block to update")
    README.write_text(new)


if __name__ == "__main__":
    main()
