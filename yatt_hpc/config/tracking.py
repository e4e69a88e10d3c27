"""The `logging:` section: per-rank logs, the leader's progress line, experiment trackers and sample tables.

    from yatt_hpc.config import load_config
    cfg = load_config("configs/demo_cpu.yaml", overrides=["logging.trackers=[tensorboard,mlflow]"])
    cfg.logging.trackers          # ["tensorboard", "mlflow"]

Part of the typed configuration (`yatt_hpc.config.schema` imports it into `RunConfig`). A tracker named
here must be importable where the config is loaded: the check looks the package up (`find_spec`) and
imports nothing, so ranks that never talk to a tracker never load its library. docs/trackers.md is the guide.
"""
from __future__ import annotations

import importlib.util
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from yatt_hpc.config.section import Section

TRACKER_PACKAGES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",),
                    "mlflow": ("mlflow", "sqlalchemy", "alembic")}  # the local store is SQLite (SQLAlchemy + Alembic)
"""The packages each tracker needs on the leader, as importable top-level names."""
INSTALL = "pip install 'yatt-hpc[trackers]'"


def missing_packages(tracker: str) -> list[str]:
    """The packages of `tracker` this Python cannot import (looked up, not imported)."""
    return [name for name in TRACKER_PACKAGES[tracker] if importlib.util.find_spec(name) is None]


class LoggingConfig(Section):
    """Metrics, sample tables, experiment trackers and logs."""

    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
    """Where the leader sends the step metrics, besides RUN_DIR/metrics.jsonl (always written): `tensorboard`
    (event files under RUN_DIR/tb), `wandb` (Weights & Biases, offline under RUN_DIR/wandb unless WANDB_MODE
    says otherwise), `mlflow` (a SQLite store under RUN_DIR/mlflow unless `mlflow_tracking_uri` names one).
    Each gets the same scalars at the same steps, the resolved config and code version as run parameters,
    the sample tables and report.png at the end of the run; `[]`: metrics.jsonl only. `wandb` and `mlflow`
    need `pip install 'yatt-hpc[trackers]'` (checked when the config is loaded). See docs/trackers.md."""
    project: str | None = None
    """The W&B project and the MLflow experiment of the run; null: `yatt-hpc`. Only with wandb or mlflow."""
    run_name: str | None = None
    """The run's display name in W&B and MLflow; null: the run directory's name. Only with wandb or mlflow."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow stores the run (`http://host:5000`, `sqlite:////abs/path/mlflow.db`, `databricks`);
    null: `sqlite:///RUN_DIR/mlflow/mlflow.db` with the artifacts beside it. Only with mlflow."""
    samples_every: int = Field(10, ge=0)
    """Every N steps, a sample table: a few prompts with their responses, reward, rule and judge scores and the
    judge's verdict (and the images' names of image rows), `samples_per_replica` rows from each trainer replica;
    also one at every validation round (`eval:`). Written to RUN_DIR/samples.jsonl and every tracker
    (TensorBoard text, W&B table, MLflow artifact). 0: no sample tables."""
    samples_per_replica: int = Field(2, ge=1)
    """Rows each trainer replica contributes to a sample table: the first sample of each of its first prompt
    groups (in sample-id order); a validation table takes as many per replica and source."""
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the per-rank logs under RUN_DIR/logs."""
    progress: bool = True
    """Show a rich progress line on the leader."""

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_is_a_tracker(cls, data):
        if isinstance(data, dict) and "tensorboard" in data:
            raise ValueError(f"logging.tensorboard={data['tensorboard']!r} is no longer a setting: TensorBoard is one "
                             "of logging.trackers; write logging.trackers: [tensorboard] (the default), or [] for "
                             "none, and drop logging.tensorboard")
        return data

    @field_validator("trackers")
    @classmethod
    def _installed_once(cls, value: list[str]) -> list[str]:
        twice = sorted({t for t in value if value.count(t) > 1})
        if twice:
            raise ValueError(f"logging.trackers={value} names {', '.join(twice)} twice; list each tracker once")
        for tracker in value:
            missing = missing_packages(tracker)
            if missing:
                raise ValueError(f"logging.trackers names {tracker}, but {', '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} not installed in this Python; install "
                                 f"the trackers with `{INSTALL}`, or drop {tracker} from logging.trackers")
        return value

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _a_uri(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^(databricks(-uc)?$|[A-Za-z][A-Za-z0-9+.-]*://)", value):
            raise ValueError(f"logging.mlflow_tracking_uri={value!r} is not a tracking URI; give a server "
                             "(http://host:5000), a database (sqlite:////abs/path/mlflow.db) or databricks, or "
                             "leave it null for the store under RUN_DIR/mlflow")
        return value

    @model_validator(mode="after")
    def _read_by_a_tracker(self) -> LoggingConfig:
        remote = [t for t in self.trackers if t != "tensorboard"]
        for name in ("project", "run_name"):
            if getattr(self, name) is not None and not remote:
                raise ValueError(f"logging.{name}={getattr(self, name)!r} is read by wandb and mlflow, but "
                                 f"logging.trackers={self.trackers} has neither; add one to logging.trackers or "
                                 f"drop logging.{name}")
        if self.mlflow_tracking_uri is not None and "mlflow" not in self.trackers:
            raise ValueError(f"logging.mlflow_tracking_uri={self.mlflow_tracking_uri!r} but mlflow is not in "
                             f"logging.trackers={self.trackers}; add mlflow to logging.trackers or drop "
                             "logging.mlflow_tracking_uri")
        if self.samples_every == 0 and self.samples_per_replica != LoggingConfig.model_fields["samples_per_replica"].default:
            raise ValueError(f"logging.samples_per_replica={self.samples_per_replica} but logging.samples_every=0 "
                             "writes no sample table; set logging.samples_every to a number of steps, or drop "
                             "logging.samples_per_replica")
        return self
