"""Which prompts each trainer replica consumed, step by step: RUN_DIR/data/consumed-dpD.jsonl.

    log = ConsumedLog(path, enabled=is_owner)
    log.record(step, positions, row_ids)
    log.truncate(step)      # on resume: forget steps >= step (the restarted run redoes them)

The audit trail of exact resume: the concatenation over replicas must hold every position once.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class ConsumedLog:
    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, step: int, positions, row_ids) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "positions": [int(p) for p in positions],
                                 "rows": [int(r) for r in row_ids]}) + "\n")

    def truncate(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] < step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, self.path)
