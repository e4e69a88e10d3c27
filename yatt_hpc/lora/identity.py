"""Which base model a run's adapters belong to, and whether a resume or an export still has it.

    record = lora_record(cfg.train.lora, cfg.model.path)          # once per trainer rank; saved with each checkpoint
    problem = resume_problem(saved_record, record, step=20)       # None, or why the checkpoint cannot continue

A LoRA checkpoint holds the adapters only: the base weights are read from ``model.path`` again at every start.
So the checkpoint records the base's identity, a sha256 over its config.json and, for each weight file, its name,
size, safetensors header (every tensor's name, dtype, shape and offsets) and 16 blocks of 64 KiB spread evenly over
its data. Another model, or the same architecture with other weights (another fine-tune), differs there; a change
that touches none of the sampled bytes would not be seen (reading every byte of a 70B model at each start would
cost minutes). Plain Python: no torch.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

SAMPLES = 16
SAMPLE_BYTES = 64 * 1024


def base_fingerprint(model_dir: str | Path) -> str:
    """sha256 hex of a Hugging Face model directory's config.json and sampled weight files (see the module doc)."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            digest.update(fh.read(header_len))
            start = 8 + header_len
            span = max(size - start - SAMPLE_BYTES, 0)
            for k in range(SAMPLES):
                fh.seek(start + span * k // max(SAMPLES - 1, 1))
                digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()


def lora_record(lora: Any, model_path: str) -> dict[str, Any]:
    """What a checkpoint of a LoRA run says about its adapters (a `LoraConfig`) and their base (`state.h5`
    stores it with each trainer rank's record: scalars and strings only)."""
    return {"rank": int(lora.rank), "alpha": float(lora.alpha), "dropout": float(lora.dropout),
            "target_modules": ",".join(lora.target_modules),
            "base_path": str(model_path), "base_sha256": base_fingerprint(model_path)}


def resume_problem(saved: dict[str, Any] | None, now: dict[str, Any] | None, step: int) -> str | None:
    """Why a checkpoint (`saved`: its `lora_record`, None for full training) cannot continue in this run (`now`)."""
    if saved is None and now is None:
        return None
    where = f"checkpoint step-{step}"
    if now is None:
        return (f"{where} holds LoRA adapters (rank {saved['rank']} on base {saved['base_path']}) but train.lora.rank=0; "
                f"resume with train.lora.rank={saved['rank']}, or export the merged model (`yatt-hpc ckpt export-hf`) "
                "and start a fresh run from it")
    if saved is None:
        return (f"{where} holds fully trained weights but train.lora.rank={now['rank']}; resume with train.lora.rank=0, "
                "or export the checkpoint (`yatt-hpc ckpt export-hf`), point model.path at it and start a fresh run")
    for key, field in (("rank", "rank"), ("alpha", "alpha"), ("target_modules", "target_modules")):
        if saved[key] != now[key]:
            return (f"{where} was trained with train.lora.{field}={saved[key]} but this run sets {now[key]}; the "
                    f"adapters only continue as they were made: set train.lora.{field}={saved[key]}")
    if saved["base_sha256"] != now["base_sha256"]:
        return (f"{where} holds adapters of the base model at {saved['base_path']} (sha256 {saved['base_sha256'][:12]}), "
                f"but model.path={now['base_path']!r} is another model (sha256 {now['base_sha256'][:12]}); point "
                "model.path at the base the adapters were trained on")
    return None
