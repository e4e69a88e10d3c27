"""The Weights & Biases tracker: offline under RUN_DIR/wandb unless WANDB_MODE says otherwise.

    tracker = WandbTracker(settings); tracker.open(resume_step, saved); tracker.log(step, scalars)

Offline, each attempt of a run (the first, each resume) writes RUN_DIR/wandb/offline-run-<time>-<id>/
with the same run id; `wandb sync RUN_DIR/wandb/offline-run-*` uploads them, in order, into one run.
WANDB_MODE=online (with WANDB_API_KEY or `wandb login`) logs live; WANDB_MODE=disabled turns W&B off.
The config is the resolved config plus `code_version`; sample tables are `wandb.Table`s under
`samples/<table>`; report.png is logged as `report` at the last step. A stopped attempt is marked
preempting (its run resumes), a failed one finishes with exit code 1.
"""
from __future__ import annotations

import secrets
import string
from collections.abc import Mapping
from pathlib import Path

from yatt_hpc.metrics.tracking import BaseTracker, TrackerSettings, let_in


def new_run_id() -> str:
    """A W&B run id: 8 lowercase letters and digits, like the ones W&B makes."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbTracker(BaseTracker):
    name = "wandb"

    def __init__(self, settings: TrackerSettings) -> None:
        self.settings = settings
        self.run = None
        self.wandb = None

    def open(self, resume_step: int, saved: dict | None) -> dict:
        let_in("wandb")
        import wandb

        self.wandb = wandb
        s = self.settings
        run_id = (saved or {}).get("run_id") or new_run_id()
        config = dict(s.params)
        options = {} if s.wandb_mode is None else {"mode": s.wandb_mode}
        self.run = wandb.init(project=s.project, name=s.display_name, id=run_id, resume="allow", dir=str(s.run_dir),
                              config=config, settings=wandb.Settings(console="off", silent=True, disable_git=True,
                                                                     save_code=False), **options)
        return {"run_id": run_id, "dir": str(Path(s.run_dir) / "wandb")}

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({f"samples/{name}": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def log_image(self, step: int, name: str, path: Path) -> None:
        self.run.log({name: self.wandb.Image(str(path))}, step=step)

    def close(self, outcome: str | None) -> None:
        if self.run is None:
            return
        if outcome == "stopped":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if outcome is not None else 1)
        self.run = None
        self.wandb.teardown()  # waits for W&B's service process to have written the run's files
