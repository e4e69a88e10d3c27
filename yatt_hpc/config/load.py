"""Load a YAML config file plus `--set a.b=v` overrides into a frozen `RunConfig`.

    cfg = load_config("configs/demo_cpu.yaml", overrides=["train.steps=3", "placement.mode=disjoint"])

Every user mistake becomes one `ConfigError` whose message names the field, the value and the
fix; the CLI prints it and exits 2. Nothing here prints or exits by itself.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from yatt_hpc.config.schema import RunConfig


class ConfigError(Exception):
    """A config the user has to fix. `str(err)` is the whole message, one line per problem."""


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
    """Read `path`, apply `overrides` (`a.b=v`, v parsed as YAML), validate, return the frozen config."""
    raw = read_yaml(path)
    for item in overrides:
        apply_override(raw, item)
    return validate(raw, source=str(path))


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file, e.g. configs/demo_cpu.yaml")
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass the path of a YAML file inside it")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({err.__class__.__name__}: {err}); "
                          "check its permissions and that it is UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{at}: "
                          f"{getattr(err, 'problem', err)}; fix the syntax there") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections "
                          f"(model, data, train, ...), not a {type(data).__name__}")
    return data


def apply_override(raw: dict, item: str) -> None:
    """Apply one `a.b.c=value` to the raw mapping in place; the value is parsed as YAML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {item!r} is not of the form section.field=value; e.g. --set train.steps=10")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # not YAML: take the literal string and let validation judge it
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[:depth + 1])
            raise ConfigError(f"--set {item!r}: {where} is a value ({child!r}), not a section; "
                              f"set {where}=... directly")
        node = child
    node[parts[-1]] = value


def validate(raw: dict, source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError("\n".join(describe(e) for e in err.errors())) from None


def describe(error: dict[str, Any]) -> str:
    """One validation error as `field: value ... — fix` text."""
    loc = [str(p) for p in error["loc"]]
    field = ".".join(loc) or "<top level>"
    value = error.get("input")
    kind = error["type"]
    if kind == "extra_forbidden":
        valid = ", ".join(valid_keys(loc[:-1]))
        return f"unknown key {field!r}; valid keys here: {valid}"
    if kind == "value_error":
        # our own validators already wrote field, value and fix
        return str(error["msg"]).removeprefix("Value error, ")
    shown = _short(value)
    return f"{field}: invalid value {shown} ({error['msg'].rstrip('.')}); fix {field} in the config or with --set {field}=..."


def valid_keys(loc: list[str]) -> list[str]:
    """The field names (YAML spelling) of the section at `loc`."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None)
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return [f.alias or name for name, f in model.model_fields.items()]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (aliases as YAML keys), stable key order."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
