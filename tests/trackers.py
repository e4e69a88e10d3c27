"""Reading what the trackers wrote, with their own formats: W&B's offline run files."""
from __future__ import annotations

import json
import struct
from pathlib import Path


def wandb_records(path: Path) -> list:
    """The records of a W&B offline run file (`run-<id>.wandb`), as W&B's own `Record` messages. The file is
    W&B's header (":W&B", a 2-byte magic, a version byte), then a LevelDB-style log of 32 KiB blocks: each
    record a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    data, block, records, parts = Path(path).read_bytes(), 32768, [], []
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def wandb_history(path: Path) -> list[dict]:
    """The history rows ({key: value}, `_step` among them) of one offline run file."""
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def wandb_run_record(path: Path):
    """The run record (id, project, display name, config) of one offline run file."""
    return next(r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run")
