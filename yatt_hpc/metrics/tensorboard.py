"""The TensorBoard tracker: event files under RUN_DIR/tb (`yatt-hpc tb RUN_DIR` shows them).

    tracker = TensorBoardTracker(settings); tracker.open(resume_step, None); tracker.log(step, scalars)

Scalars by tag, sample tables as text summaries (Markdown tables under `samples/<table>`), the config
and code version as text at step 0 and report.png as an image at the last step. A resumed run drops
the events past its checkpoint (`purge_step`) and writes the redone steps anew.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from yatt_hpc.metrics.tables import markdown_table
from yatt_hpc.metrics.tracking import BaseTracker, TrackerSettings


class TensorBoardTracker(BaseTracker):
    name = "tensorboard"
    purges_on_resume = True

    def __init__(self, settings: TrackerSettings) -> None:
        self.settings = settings
        self.writer = None

    def open(self, resume_step: int, saved: dict | None) -> dict:
        from torch.utils.tensorboard import SummaryWriter

        # events past the checkpoint are redone (resume_step -1: no checkpoint, the run starts over)
        self.writer = SummaryWriter(log_dir=str(Path(self.settings.run_dir) / "tb"), flush_secs=5,
                                    purge_step=resume_step + 1)
        if resume_step < 0:
            self.writer.add_text("run/code_version", self.settings.params.get("code_version", ""), global_step=0)
            self.writer.add_text("run/config", "\n".join("    " + line for line in
                                                          self.settings.config_yaml.splitlines()), global_step=0)
        self.writer.flush()
        return {"log_dir": str(Path(self.settings.run_dir) / "tb")}

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text(f"samples/{name}", markdown_table(columns, rows), global_step=step)
        self.writer.flush()

    def log_image(self, step: int, name: str, path: Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            self.writer.add_image(name, np.asarray(image.convert("RGB")), global_step=step, dataformats="HWC")
        self.writer.flush()

    def close(self, outcome: str | None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
