"""Sample tables: the columns every tracker shows, and their Markdown form (TensorBoard's text plugin).

    columns, rows = table_of(samples)          # samples: the dicts the trainer replicas sent
    markdown_table(columns, rows)              # | step | table | replica | ... |

A sample is a dict with the keys of `COLUMNS` (the trainer builds them: `roles/samples.py`); a missing
key is an empty cell (None). `terms` (a dict, the reward terms' scores) becomes one column per term.
"""
from __future__ import annotations

COLUMNS = ["step", "table", "replica", "sample", "prompt", "response", "answer", "reward", "verdict", "finish",
           "tokens", "images"]
MAX_CELL = 2000  # characters of a text cell in the Markdown form (a long response stays readable)


def table_of(samples: list[dict]) -> tuple[list[str], list[list]]:
    """Columns (COLUMNS with the reward terms after `reward`) and one row per sample."""
    terms: list[str] = []
    for sample in samples:
        terms += [t for t in sample.get("terms", {}) if t not in terms]
    at = COLUMNS.index("reward") + 1
    columns = COLUMNS[:at] + [f"term/{t}" for t in terms] + COLUMNS[at:]
    rows = []
    for sample in samples:
        scores = sample.get("terms", {})
        rows.append([sample.get(c) for c in COLUMNS[:at]] + [scores.get(t) for t in terms]
                    + [sample.get(c) for c in COLUMNS[at:]])
    return columns, rows


def markdown_table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return " "
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    if len(text) > MAX_CELL:
        text = text[:MAX_CELL] + " ..."
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>") or " "
