"""Generate the config reference (Markdown) from the field docstrings: `yatt-hpc config docs`."""
from __future__ import annotations

import typing

import yaml
from pydantic import BaseModel

from yatt_hpc.config.schema import RunConfig


def reference_markdown() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    _rows(RunConfig, "", lines)
    return "\n".join(lines) + "\n"


def _rows(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _rows(ann, key + ".", lines)
            continue
        default = field.get_default(call_default_factory=True)
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        doc = " ".join((field.description or "").split()).replace("|", "\\|")
        lines.append(f"| `{key}` | {_type_name(ann)} | `{shown}` | {doc} |")


def _type_name(ann: object) -> str:
    if typing.get_origin(ann) is typing.Literal:
        return " \\| ".join(str(a) for a in typing.get_args(ann))
    text = getattr(ann, "__name__", None) or str(ann)
    return text.replace("typing.", "").replace("|", "\\|")
