"""The MLflow tracker: a SQLite store under RUN_DIR/mlflow unless `logging.mlflow_tracking_uri` names one.

    tracker = MlflowTracker(settings); tracker.open(resume_step, saved); tracker.log(step, scalars)

    mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow/mlflow.db     # browse a run's local store

The run lives in the experiment `logging.project` (created when missing); a resumed run reopens the same
run id (status back to RUNNING). Parameters are the resolved config, flattened, and `code_version` (set
when the run is created); config.yaml is an artifact. Metric names keep their tags, but for characters
MLflow refuses, which become `_` (`val/<source>/pass@4` is `val/<source>/pass_4`). Sample tables are JSON artifacts
`samples/<table>/step-NNNNNN.json` ({"columns": [...], "data": [[...], ...]}, the layout of MLflow's own
`log_table`); report.png is an artifact at the end. A stopped attempt leaves the run KILLED until its
resume reopens it, a failed one FAILED, a complete one FINISHED.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path

from yatt_hpc.metrics.tracking import BaseTracker, TrackerSettings, let_in

BATCH = 100  # params per log_batch call (MLflow's limit); metrics go 1000 at a time
STATUS = {"complete": "FINISHED", "stopped": "KILLED", None: "FAILED"}


def metric_name(name: str) -> str:
    """`name` with each character MLflow refuses in a metric name as `_` (`val/x/pass@4` -> `val/x/pass_4`)."""
    return re.sub(r"[^\w\-. :/]", "_", name)


def local_store(run_dir: Path) -> tuple[str, str]:
    """(tracking URI, artifact location) of the store inside the run directory."""
    root = Path(run_dir).resolve() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


class MlflowTracker(BaseTracker):
    name = "mlflow"

    def __init__(self, settings: TrackerSettings) -> None:
        self.settings = settings
        self.client = None
        self.run_id: str | None = None

    def open(self, resume_step: int, saved: dict | None) -> dict:
        let_in("mlflow")
        from mlflow.tracking import MlflowClient

        # MLflow prints its own INFO lines to stderr; the rank's log is where a leader's notes go
        mlflow_log = logging.getLogger("mlflow")
        mlflow_log.handlers.clear()
        mlflow_log.propagate = True
        s = self.settings
        uri, artifacts = (s.mlflow_tracking_uri, None) if s.mlflow_tracking_uri else local_store(s.run_dir)
        self.client = MlflowClient(tracking_uri=uri)
        saved = saved if saved and saved.get("tracking_uri") == uri else None
        if saved is not None:
            self.run_id = saved["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(s.project)
            experiment_id = experiment.experiment_id if experiment is not None else \
                self.client.create_experiment(s.project, artifact_location=artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=s.display_name,
                                                 tags={"yatt.run_dir": str(Path(s.run_dir).resolve())}).info.run_id
            self._log_params()
        return {"run_id": self.run_id, "tracking_uri": uri}

    def _log_params(self) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in sorted(self.settings.params.items())]
        for i in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + BATCH])
        self.client.log_text(self.run_id, self.settings.config_yaml, "config.yaml")

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.client.log_text(self.run_id, json.dumps({"columns": columns, "data": rows}),
                             f"samples/{name}/step-{step:06d}.json")

    def log_image(self, step: int, name: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, outcome: str | None) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status=STATUS.get(outcome, "FAILED"))
            self.client = None
