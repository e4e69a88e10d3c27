"""Where checkpoints live and what their files are called; pure path logic plus directory listing.

    from yatt_hpc.ckpt import layout
    layout.checkpoints_dir(run_dir)              # RUN_DIR/checkpoints
    layout.step_dir(ckpt_dir, 40)                # .../step-40   (committed)
    layout.incomplete_dir(ckpt_dir, 40)          # .../step-40.incomplete   (being written)
    layout.list_steps(ckpt_dir)                  # [StepDir(step=20, ...), StepDir(step=40, ...)]

A checkpoint is ``step-N/`` holding one safetensors file per trainer shard for parameters
(``model-tp{t}-pp{p}``, written by the shard's dp-rank-0), one per rank for optimizer state
(``optim-tp{t}-pp{p}-dp{d}``), with a critic its own two (``critic-tp{t}-pp{p}``,
``critic-optim-tp{t}-pp{p}-dp{d}``), ``state.h5`` (everything else plus the manifest) and the commit
marker ``COMMITTED``, written last. ``step-N.incomplete/`` is a save in progress or a crashed one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.h5"
COMMIT_MARKER = "COMMITTED"
INCOMPLETE_SUFFIX = ".incomplete"
CORRUPT_SUFFIX = ".corrupt"
METADATA_KEY = "yatt_hpc"  # the one safetensors metadata entry: JSON (identity, optimizer groups)
_STEP_RE = re.compile(r"^step-(\d+)$")
_INCOMPLETE_RE = re.compile(r"^step-(\d+)\.incomplete$")


@dataclass(frozen=True)
class StepDir:
    """One ``step-N/`` directory; ``committed`` means its commit marker exists (not yet verified)."""

    step: int
    path: Path
    committed: bool


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def resolve_checkpoints_dir(path: str | Path) -> Path:
    """Accept a run directory or its ``checkpoints/`` directory; return the latter."""
    path = Path(path)
    return path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() or path.name != CHECKPOINTS else path


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step}"


def incomplete_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step}{INCOMPLETE_SUFFIX}"


def model_file(tp: int, pp: int, ep: int = 0) -> str:
    """Shard (tp, pp)'s parameters; under expert parallelism, expert-parallel rank `ep` > 0 writes its experts
    (model-wide numbers) to a file of its own beside it, and readers merge them (`loader.read_weights`)."""
    return f"model-tp{tp}-pp{pp}.safetensors" if ep == 0 else f"model-tp{tp}-pp{pp}-ep{ep}.safetensors"


def optim_file(tp: int, pp: int, dp: int) -> str:
    return f"optim-tp{tp}-pp{pp}-dp{dp}.safetensors"


def critic_file(tp: int, pp: int) -> str:
    """The value model's parameters of shard (tp, pp) (`train.adv_estimator: gae`)."""
    return f"critic-tp{tp}-pp{pp}.safetensors"


def critic_optim_file(tp: int, pp: int, dp: int) -> str:
    return f"critic-{optim_file(tp, pp, dp)}"


def model_shards(path: Path) -> dict[tuple[int, int], Path]:
    """The parameter files of one step directory keyed by (tp, pp)."""
    found = {}
    for file in path.glob("model-tp*-pp*.safetensors"):
        m = re.match(r"^model-tp(\d+)-pp(\d+)\.safetensors$", file.name)
        if m:
            found[int(m[1]), int(m[2])] = file
    return found


def list_steps(ckpt_dir: Path) -> list[StepDir]:
    """Every ``step-N/`` directory, oldest first (``.incomplete`` and ``.corrupt`` ones excluded)."""
    if not ckpt_dir.is_dir():
        return []
    steps = []
    for entry in ckpt_dir.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            steps.append(StepDir(int(m[1]), entry, (entry / COMMIT_MARKER).is_file()))
    return sorted(steps, key=lambda s: s.step)


def list_incomplete(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if _INCOMPLETE_RE.match(p.name) and p.is_dir())


def steps_to_prune(steps: list[StepDir], keep_last: int) -> list[StepDir]:
    """Committed checkpoints beyond the newest ``keep_last`` (pure; never the uncommitted ones)."""
    if keep_last < 2:
        raise ValueError(f"keep_last={keep_last}: keep at least 2 so a corrupt latest has a predecessor")
    committed = [s for s in steps if s.committed]
    return committed[:-keep_last]


def should_save(step: int, interval: int, last_step: int) -> bool:
    """True after ``step`` (1-based count of finished steps) when a periodic or final save is due."""
    return step == last_step or (interval > 0 and step % interval == 0)
