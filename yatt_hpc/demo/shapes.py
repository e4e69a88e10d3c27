"""The built-in visual demo task: count the red shapes in a small drawn image.

    from yatt_hpc.demo.shapes import shapes_row, write_shapes_dataset
    row = shapes_row(seed=0, index=0)   # {"id": 0, "prompt": "<image>How many red shapes?", "answer": "3",
                                        #  "images": [b"\\x89PNG..."]}  (one 56x56 RGB PNG)
    write_shapes_dataset("data/shapes", seed=0, count=512, split="train", layout="parquet", shards=2)
    # data/shapes/train-00000-of-00002.parquet, ...: Hugging Face's layout, images = list of {bytes, path}
    write_shapes_dataset("data/shapes-jsonl", seed=0, count=512, layout="jsonl", shards=1)
    # data/shapes-jsonl/images/train-000000.png, ... and train-00000-of-00001.jsonl indexing them by path

A scene is 1-4 red shapes (the answer, uniform, so a policy guessing a digit scores 25% from step 0 and
GRPO has groups with rewards to compare) and 0-2 green or blue ones (so counting blobs is not enough),
each a circle, square or triangle of random size in its own cell of a 3x3 grid (shapes never touch),
on white. The question is always the same: a model can only beat chance by reading the image, which
is what the task is for (proving that pixels reach the policy), and a tiny model need not also learn
to bind colour words to colours. The answer is one digit.

Rows are a pure function of (seed, split, index), and the PNG bytes too: they are written by
`png_bytes` (stored, uncompressed deflate blocks), not by Pillow's encoder, whose zlib build (zlib or
zlib-ng) changes compressed bytes between machines. The split of a scene is decided by a hash of the
scene itself, so the train and held-out splits never share an image, for every seed and every index.
"""
from __future__ import annotations

import json
import random
import struct
import zlib
from pathlib import Path

from PIL import Image, ImageDraw

CANVAS = 56
GRID = 3  # the canvas is cut into GRID x GRID cells, one shape at most in each
TARGET = "red"
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 70), "blue": (50, 90, 220)}
KINDS = ("circle", "square", "triangle")
MAX_TARGETS, MAX_DISTRACTORS = 4, 2
QUESTION = f"<image>How many {TARGET} shapes?"
SPLITS = ("train", "heldout")
HELDOUT_EVERY = 10  # one scene in ten (by hash) belongs to the held-out split
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def draw_scene(seed: int, index: int, split: str = "train", canvas: int = CANVAS) -> tuple[list[tuple], int]:
    """The shapes of row `index` of `split` as (cell, kind, colour, x, y, size) tuples, and its answer."""
    if split not in SPLITS:
        raise ValueError(f"unknown shapes split {split!r}; valid splits: {', '.join(SPLITS)}")
    if index < 0:
        raise IndexError(f"shapes row index must be >= 0, got {index}")
    if canvas < 8 * GRID:
        raise ValueError(f"the shapes canvas must be at least {8 * GRID} pixels wide, got {canvas}")
    cell = canvas // GRID
    rng = random.Random(f"yatt-shapes:{seed}:{split}:{index}")  # a string seed: no PYTHONHASHSEED dependence
    while True:
        targets, distractors = rng.randint(1, MAX_TARGETS), rng.randint(0, MAX_DISTRACTORS)
        colours = [TARGET] * targets + [rng.choice([c for c in COLOURS if c != TARGET]) for _ in range(distractors)]
        shapes = []
        for slot, colour in zip(sorted(rng.sample(range(GRID * GRID), len(colours))), colours):
            size = rng.randint(cell * 5 // 9, cell - 2)
            x = slot % GRID * cell + rng.randint(1, cell - size - 1)  # a margin of 1: shapes never touch
            y = slot // GRID * cell + rng.randint(1, cell - size - 1)
            shapes.append((slot, rng.choice(KINDS), colour, x, y, size))
        if split_of(shapes) == split:
            return sorted(shapes), targets


def split_of(shapes: list[tuple]) -> str:
    """The split a scene belongs to, from a stable hash of the scene (not of the seed or index)."""
    return "heldout" if zlib.crc32(repr(sorted(shapes)).encode()) % HELDOUT_EVERY == 0 else "train"


def render(shapes: list[tuple], canvas: int = CANVAS) -> Image.Image:
    image = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _, kind, colour, x, y, size in shapes:
        box, fill = (x, y, x + size - 1, y + size - 1), COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=fill)
    return image


def png_bytes(image: Image.Image) -> bytes:
    """An RGB image as a PNG whose bytes depend on the pixels alone (no metadata, stored deflate blocks)."""
    rgb = image.convert("RGB")
    width, height = rgb.size
    pixels, stride = rgb.tobytes(), 3 * width
    raw = b"".join(b"\x00" + pixels[y * stride:(y + 1) * stride] for y in range(height))  # filter 0: none
    blocks = [raw[i:i + 0xFFFF] for i in range(0, len(raw), 0xFFFF)]
    stored = b"".join(struct.pack("<BHH", k == len(blocks) - 1, len(b), len(b) ^ 0xFFFF) + b
                      for k, b in enumerate(blocks))
    idat = b"\x78\x01" + stored + struct.pack(">I", zlib.adler32(raw))  # zlib header: deflate, no compression
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def shapes_row(seed: int, index: int, split: str = "train", canvas: int = CANVAS) -> dict:
    """Row `index` of `split`: `{"id": index, "prompt": QUESTION, "answer": "1".."4", "images": [png]}`."""
    shapes, answer = draw_scene(seed, index, split, canvas)
    return {"id": index, "prompt": QUESTION, "answer": str(answer), "images": [png_bytes(render(shapes, canvas))]}


def write_shapes_dataset(out_dir: str | Path, seed: int, count: int, split: str = "train", layout: str = "parquet",
                         shards: int = 2, canvas: int = CANVAS) -> list[Path]:
    """Rows 0..count-1 of `split` in `shards` files named like Hugging Face's (`train-00000-of-00002.parquet`),
    in contiguous runs of rows. `parquet`: images = list of {bytes, path} (the bytes inline); `jsonl`:
    images = list of paths to the PNG files written under `out_dir/images/`. The paths of the files."""
    if layout not in ("parquet", "jsonl"):
        raise ValueError(f"unknown layout {layout!r}; use parquet or jsonl")
    if not 1 <= shards <= max(count, 1):
        raise ValueError(f"shards must be in 1..count ({count}), got {shards}")
    out = Path(out_dir)
    (out / "images" if layout == "jsonl" else out).mkdir(parents=True, exist_ok=True)
    written = []
    for k in range(shards):
        rows = [shapes_row(seed, i, split, canvas) for i in range(k * count // shards, (k + 1) * count // shards)]
        path = out / f"{split}-{k:05d}-of-{shards:05d}.{layout}"
        (_write_parquet if layout == "parquet" else _write_jsonl)(path, rows, split)
        written.append(path)
    return written


def _write_parquet(path: Path, rows: list[dict], split: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("answer", pa.string()),
                        ("images", pa.list_(image))])
    records = [{**r, "images": [{"bytes": b, "path": _image_name(split, r["id"], k)} for k, b in enumerate(r["images"])]}
               for r in rows]
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, row_group_size=256)


def _write_jsonl(path: Path, rows: list[dict], split: str) -> None:
    lines = []
    for r in rows:
        names = [f"images/{_image_name(split, r['id'], k)}" for k in range(len(r["images"]))]
        for name, data in zip(names, r["images"]):
            (path.parent / name).write_bytes(data)
        lines.append(json.dumps({**r, "images": names}))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _image_name(split: str, index: int, k: int) -> str:
    return f"{split}-{index:06d}.png" if k == 0 else f"{split}-{index:06d}-{k}.png"
