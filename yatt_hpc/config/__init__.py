"""Typed run configuration: `load_config(path, overrides) -> RunConfig` (frozen, validated)."""
from yatt_hpc.config.load import ConfigError, load_config, to_yaml
from yatt_hpc.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "to_yaml"]
