"""Experiment trackers behind one interface, each fed from its own thread, a failure reported once.

    trackers = build_trackers(TrackerSettings(names=["tensorboard", "mlflow"], run_dir=run_dir, ...))
    for t in trackers:
        t.open(resume_step)             # the run of RUN_DIR/trackers.json, or a new one
        t.log(step, scalars); t.log_table(step, "train", columns, rows); t.log_image(step, "report", path)
        t.close("complete")             # or "stopped" (requeue or give-up), None (the run failed)

Only the leader builds trackers (`metrics/writer.py`); their libraries are imported in `open`, so no
other rank loads them. A tracker that talks to something outside the process (W&B, MLflow) runs in a
`TrackerThread`: the step loop only queues calls, so a slow or unreachable server never stalls a step,
and the first call that raises is reported once (the rank's log and stderr) and the tracker is dropped
for the rest of the run; training and checkpoints go on.

Resume: RUN_DIR/trackers.json keeps each tracker's run id and the last step it took. A resumed run
reopens the same run, and a step that a stopped attempt already logged (one past its checkpoint, redone
now) is not sent again: every step reaches a tracker once. TensorBoard instead drops its events past
the checkpoint (`purge_step`) and takes the redone steps anew, as metrics.jsonl does.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
STATE_FILE = "trackers.json"
CLOSE_WAIT_S = 120.0  # what closing waits for a tracker's queued calls (an upload to a slow server)


@dataclass(frozen=True)
class TrackerSettings:
    """What the trackers need, read from the config and the environment by the worker (the edge)."""

    names: list[str]
    run_dir: Path
    project: str = "yatt-hpc"
    run_name: str | None = None
    mlflow_tracking_uri: str | None = None
    wandb_mode: str | None = "offline"  # None: W&B reads WANDB_MODE itself
    config_yaml: str = ""
    params: dict[str, str] = field(default_factory=dict)  # the resolved config, flattened, and the code version

    @property
    def display_name(self) -> str:
        return self.run_name or Path(self.run_dir).resolve().name


class BaseTracker:
    """One experiment tracker as the leader's metrics writer sees it."""

    name = "tracker"
    purges_on_resume = False  # True: takes redone steps again (drops its own past the checkpoint)

    def open(self, resume_step: int, saved: dict | None) -> dict:
        """Start or reopen the run (`saved`: this tracker's entry of trackers.json); return the entry to keep."""
        raise NotImplementedError

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        raise NotImplementedError

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list]) -> None:
        raise NotImplementedError

    def log_image(self, step: int, name: str, path: Path) -> None:
        raise NotImplementedError

    def close(self, outcome: str | None) -> None:
        """End the run: `complete`, `stopped` (it will be resumed), or None (the run failed)."""


class TrackerState:
    """RUN_DIR/trackers.json: {tracker: {"run_id": ..., "logged_through": step, ...}}, rewritten atomically."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / STATE_FILE
        self._lock = threading.Lock()
        try:
            self.entries: dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            self.entries = {}

    def get(self, name: str) -> dict | None:
        return self.entries.get(name)

    def logged_through(self, name: str) -> int:
        return int((self.entries.get(name) or {}).get("logged_through", -1))

    def update(self, name: str, **values) -> None:
        with self._lock:
            self.entries[name] = {**self.entries.get(name, {}), **values}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)


class TrackerFailed:
    """Says once, in the rank's log (with the traceback) and on stderr, that a tracker was dropped."""

    def __init__(self, stream=None) -> None:
        self.stream = stream

    def __call__(self, tracker: str, what: str, err: BaseException) -> None:
        text = (f"yatt-hpc: the {tracker} tracker failed ({what}: {err.__class__.__name__}: {err}); it is off for the "
                f"rest of this run, training and checkpoints go on (metrics.jsonl holds every step)")
        log.error("%s", text, exc_info=err)
        print(text, file=self.stream or sys.stderr, flush=True)


class TrackerThread:
    """Runs one tracker's calls in order on a thread of its own; after the first failure, none.

    `submit(what, fn)` queues `fn(tracker)`; `after` (optional) runs on the thread once `fn` succeeded
    (recording the step a tracker took). `close(outcome)` queues the tracker's close and waits, bounded."""

    def __init__(self, tracker: BaseTracker, failed: Callable[[str, str, BaseException], None]) -> None:
        self.tracker, self.failed = tracker, failed
        self.name = tracker.name
        self.broken = False
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name=f"tracker-{tracker.name}", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[BaseTracker], None], after: Callable[[], None] | None = None) -> None:
        if not self.broken:
            self._calls.put((what, fn, after))

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            what, fn, after = item
            if self.broken:
                continue
            try:
                fn(self.tracker)
                if after is not None:
                    after()
            except Exception as err:  # noqa: BLE001 - any failure of a tracker must not end the run
                self.broken = True
                self.failed(self.name, what, err)

    def close(self, outcome: str | None, wait_s: float = CLOSE_WAIT_S) -> None:
        self.submit("close", lambda t: t.close(outcome))
        self._calls.put(None)
        self._thread.join(wait_s)
        if self._thread.is_alive():
            log.warning("the %s tracker still had calls queued %.0fs after the run ended; left behind", self.name, wait_s)


HIDDEN = ("wandb", "mlflow")


def hide_tracker_libraries() -> None:
    """Keep W&B and MLflow out of this process until a tracker opens (`let_in`). Megatron-Core imports
    wandb whenever it is installed (its inference context, its timers): ~1.2 s on every trainer rank, and
    a library only the leader's tracker may load. `sys.modules[name] = None` is Python's own "cannot be
    imported": Megatron's `try: import wandb` then takes its no-W&B path. Before any library is imported."""
    for name in HIDDEN:
        if name not in sys.modules:
            sys.modules[name] = None


def let_in(name: str) -> None:
    """Undo `hide_tracker_libraries` for one library, on the leader, as its tracker opens."""
    if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]


def build_trackers(settings: TrackerSettings) -> list[BaseTracker]:
    """The configured trackers, in config order (their libraries are imported when they open)."""
    out: list[BaseTracker] = []
    for name in settings.names:
        if name == "tensorboard":
            from yatt_hpc.metrics.tensorboard import TensorBoardTracker

            out.append(TensorBoardTracker(settings))
        elif name == "wandb":
            from yatt_hpc.metrics.wandb_tracker import WandbTracker

            out.append(WandbTracker(settings))
        elif name == "mlflow":
            from yatt_hpc.metrics.mlflow_tracker import MlflowTracker

            out.append(MlflowTracker(settings))
        else:
            raise ValueError(f"unknown tracker {name!r}; valid: tensorboard, wandb, mlflow")
    return out


def code_version(package_dir: Path | None = None) -> str:
    """`git describe --always --dirty` of the source tree the package runs from, else its installed version."""
    where = package_dir or Path(__file__).resolve().parents[2]
    if (where / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(where), "describe", "--always", "--dirty", "--tags"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("yatt-hpc")
    except PackageNotFoundError:
        return "unknown"


def flat_params(tree: Mapping, prefix: str = "") -> dict[str, str]:
    """A nested config as {"train.lr": "0.0003", ...}: the run parameters every tracker shows."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return out
