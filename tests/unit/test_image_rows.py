"""Image rows: Hugging Face's Parquet layout and a directory of image files with a JSONL index both give each
row its encoded image bytes, read only when the row is read; every bad image is a `DatasetError` naming the
row and the fix; the count-the-shapes demo task is byte-reproducible with disjoint splits.

    .venv/bin/python -m pytest tests/unit/test_image_rows.py -q
"""
from __future__ import annotations

import hashlib
import io
import json
import struct
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from yatt_hpc.config.schema import DataConfig
from yatt_hpc.data import rows as rows_module
from yatt_hpc.data.parquet import ParquetSource
from yatt_hpc.data.prompts import PromptStream, ShapesTaskSource, build_prompt_source, open_prompt_source
from yatt_hpc.data.rows import DatasetError, RowSchema
from yatt_hpc.demo.shapes import COLOURS, QUESTION, TARGET, draw_scene, png_bytes, render, shapes_row, write_shapes_dataset
from yatt_hpc.vision.images import ImageError, ImageLimits, check_image_bytes, decode_image

IMAGES = RowSchema(images_key="images")
ROW0_SHA256 = "d4dd8a3c710567e057f1d024532b480899a5e595fc071311e30cd8db74d0412e"


def _png(width: int = 8, height: int = 6, colour=(10, 200, 30), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG that announces width x height and holds no pixels: what a decompression bomb looks like up front."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


# ------------------------------------------------------------------ both layouts, the bytes as written


@pytest.mark.parametrize("layout", ["parquet", "jsonl"])
def test_both_dataset_layouts_give_each_row_the_bytes_written(tmp_path, layout):
    files = write_shapes_dataset(tmp_path, seed=3, count=9, split="train", layout=layout, shards=2)
    assert [f.name for f in files] == [f"train-0000{k}-of-00002.{layout}" for k in range(2)]
    source = open_prompt_source(str(tmp_path), IMAGES)
    assert len(source) == 9
    for i in range(9):
        row, want = source.row(i), shapes_row(3, i, "train")
        assert (row["id"], row["prompt"], row["answer"], row["images"]) == \
            (i, want["prompt"], want["answer"], want["images"])
        assert "images" not in row["metadata"]  # the images column is the row's own, not metadata
    if layout == "parquet":  # Hugging Face's layout: a list of {bytes, path} structs
        kind = pq.read_schema(files[0]).field("images").type
        assert kind == pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    else:
        line = json.loads(files[0].read_text().splitlines()[0])
        assert line["images"] == ["images/train-000000.png"]
        assert (tmp_path / "images" / "train-000000.png").read_bytes() == shapes_row(3, 0)["images"][0]


def test_parquet_images_may_be_one_struct_or_paths_and_bytes_win_over_the_path(tmp_path):
    red, blue = _png(colour=(255, 0, 0)), _png(colour=(0, 0, 255))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "blue.png").write_bytes(blue)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"prompt": ["a", "b", "c", "d"], "answer": ["1", "2", "3", "4"],
                      "image": pa.array([{"bytes": red, "path": "pics/blue.png"},  # bytes win
                                         {"bytes": None, "path": "pics/blue.png"},  # relative to the file's directory
                                         {"bytes": None, "path": str(tmp_path / "pics" / "blue.png")},  # absolute
                                         None], type=image)})  # no image
    pq.write_table(table, tmp_path / "hf.parquet")
    source = ParquetSource(tmp_path / "hf.parquet", RowSchema(images_key="image"))
    assert [source.row(i)["images"] for i in range(4)] == [[red], [blue], [blue], []]


def test_jsonl_images_may_be_one_path_a_list_or_none(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(colour=(1, 2, 3)))
    (tmp_path / "b.png").write_bytes(_png(colour=(4, 5, 6)))
    _jsonl(tmp_path / "index.jsonl", [{"prompt": "p", "answer": "1", "images": "a.png"},
                                      {"prompt": "p", "answer": "1", "images": ["a.png", "b.png"]},
                                      {"prompt": "p", "answer": "1", "images": []}])
    source = open_prompt_source(str(tmp_path / "index.jsonl"), IMAGES)
    a, b = (tmp_path / "a.png").read_bytes(), (tmp_path / "b.png").read_bytes()
    assert [source.row(i)["images"] for i in range(3)] == [[a], [a, b], []]


def test_text_rows_have_no_images_in_every_source(tmp_path):
    _jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1", "images": ["not read.png"]}])
    assert open_prompt_source(str(tmp_path / "t.jsonl")).row(0)["images"] == []  # data.images_key unset
    assert open_prompt_source(str(tmp_path / "t.jsonl")).row(0)["metadata"] == {"images": ["not read.png"]}
    assert build_prompt_source(DataConfig(source="demo:train", num_prompts=4)).row_at(0)["images"] == []


# ------------------------------------------------------------------ lazy and per rank


def test_a_rank_reads_only_its_own_rows_images(tmp_path, monkeypatch):
    write_shapes_dataset(tmp_path, seed=0, count=8, layout="jsonl", shards=2)
    opened = []
    read = rows_module.read_image_file
    monkeypatch.setattr(rows_module, "read_image_file", lambda path, *a: opened.append(path.name) or read(path, *a))
    stream = PromptStream(open_prompt_source(str(tmp_path), IMAGES), seed=5)
    assert opened == []  # opening a directory source reads no image
    per_rank = 2
    mine = stream.rows_at(1 * per_rank, per_rank)  # rank 1 of 4 at step 0
    assert sorted(opened) == sorted(f"train-{r['id']:06d}.png" for r in mine)


def test_a_broken_row_fails_when_read_and_the_others_still_read(tmp_path):
    write_shapes_dataset(tmp_path, seed=0, count=6, layout="jsonl", shards=1)
    (tmp_path / "images" / "train-000004.png").unlink()
    source = open_prompt_source(str(tmp_path), IMAGES)
    assert [source.row(i)["images"] == shapes_row(0, i)["images"] for i in (0, 1, 2, 3, 5)] == [True] * 5
    with pytest.raises(DatasetError) as err:
        source.row(4)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path}/train-00000-of-00001.jsonl:5: column 'images' image 0 (images/train-000004.png)")
    assert "does not exist" in msg and "relative to the dataset file's directory" in msg


# ------------------------------------------------------------------ bad images, named with the fix


def _bad_jsonl(tmp_path, images) -> str:
    _jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1", "images": []},
                                  {"prompt": "p", "answer": "1", "images": images}])
    return str(tmp_path / "d.jsonl")


@pytest.mark.parametrize("write, images, needles", [
    pytest.param(None, ["gone.png"], ["image 0 (gone.png)", "does not exist", "put the file there"], id="missing-file"),
    pytest.param(b"hello, not a picture", ["x.png"], ["not an image Pillow can read", "store PNG or JPEG"],
                 id="undecodable"),
    pytest.param(_png(64, 64, (9, 9, 9))[:-30], ["x.png"], ["damaged or truncated", "re-encode or replace"],
                 id="truncated-png"),
    pytest.param(_png(64, 64)[:20], ["x.png"], ["header cannot be read", "damaged"],
                 id="cut-header"),
    pytest.param(b"", ["x.png"], ["empty (0 bytes)"], id="empty-file"),
    pytest.param(_png_header(9000, 9000), ["x.png"], ["9000x9000 = 81000000 pixels", "over the limit of 67108864",
                                                      "data.max_image_pixels", "downscale"], id="over-pixel-limit"),
    pytest.param(None, 7, ["column 'images' image 0", "got int 7", "a file path"], id="wrong-type"),
    pytest.param(None, [{"bytes": None, "path": None}], ["with one of them set", "got dict"], id="empty-struct"),
])
def test_bad_images_name_the_row_the_problem_and_the_fix(tmp_path, write, images, needles):
    if write is not None:
        (tmp_path / "x.png").write_bytes(write)
    source = open_prompt_source(_bad_jsonl(tmp_path, images), IMAGES)
    assert source.row(0)["images"] == []
    with pytest.raises(DatasetError) as err:
        source.row(1)
    assert str(err.value).startswith(f"{tmp_path}/d.jsonl:2: column 'images' image 0")
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_images_key_without_the_column_names_it_and_the_fix(tmp_path):
    _jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"t.jsonl:1: row has no 'pics' column .*\"pics\": \[\].*unset "
                                           r"data.images_key"):
        open_prompt_source(str(tmp_path / "t.jsonl"), RowSchema(images_key="pics")).probe()
    pq.write_table(pa.table({"prompt": ["p"], "answer": ["1"]}), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"t.parquet: no 'pics' column \(data.images_key; it has: 'prompt', "
                                           r"'answer'\)"):
        ParquetSource(tmp_path / "t.parquet", RowSchema(images_key="pics"))


def test_a_parquet_images_column_of_the_wrong_type_fails_when_the_file_opens(tmp_path):
    pq.write_table(pa.table({"prompt": ["p"], "answer": ["1"], "images": [3]}), tmp_path / "t.parquet")
    with pytest.raises(DatasetError, match=r"column 'images' \(data.images_key\) has type int64; images must be a "
                                           r"list of struct<bytes: binary, path: string>"):
        ParquetSource(tmp_path / "t.parquet", IMAGES)


def test_a_parquet_images_column_without_images_key_says_to_set_it(tmp_path):
    write_shapes_dataset(tmp_path, seed=0, count=2, shards=1)
    with pytest.raises(DatasetError, match="set data.images_key=images"):
        open_prompt_source(str(tmp_path))


# ------------------------------------------------------------------ the image checks themselves


def test_check_reads_the_header_only_and_decode_gives_rgb():
    assert check_image_bytes(_png(8, 6), "o", ImageLimits()) == (8, 6, "PNG")
    for mode, colour in [("RGBA", (1, 2, 3, 0)), ("P", 5), ("L", 7)]:
        image = decode_image(_png(8, 6, colour, mode), "o", ImageLimits())
        assert (image.mode, image.size) == ("RGB", (8, 6))
    # a header that announces 12000x12000 (400 MiB of pixels) is refused without a pixel decoded
    with pytest.raises(ImageError, match="12000x12000 = 144000000 pixels, over the limit"):
        decode_image(_png_header(12000, 12000), "o", ImageLimits())
    with pytest.raises(ImageError, match="over Pillow's own limit of 178956970 pixels"):
        check_image_bytes(_png_header(20000, 20000), "o", ImageLimits())


def test_a_truncated_jpeg_fails_to_decode_naming_the_origin():
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    with pytest.raises(ImageError, match=r"^row 3 image 0: the JPEG image cannot be decoded .*re-encode"):
        decode_image(data[:len(data) * 2 // 3], "row 3 image 0", ImageLimits())


@pytest.mark.parametrize("limits, data, needle", [
    pytest.param(ImageLimits(max_bytes=100), _png(64, 64, (1, 1, 1)), "over the limit of 100", id="max-bytes"),
    pytest.param(ImageLimits(min_side=7), _png(8, 6), "below the smallest side of 7", id="min-side"),
    pytest.param(ImageLimits(max_pixels=47), _png(8, 6), "8x6 = 48 pixels, over the limit of 47", id="max-pixels"),
])
def test_each_limit_is_enforced_from_the_header(limits, data, needle):
    with pytest.raises(ImageError, match=needle):
        check_image_bytes(data, "o", limits)


def test_limits_past_pillows_own_are_refused_and_the_defaults_agree_with_the_config():
    with pytest.raises(ValueError, match="max_pixels must be in"):
        ImageLimits(max_pixels=10**10)
    assert ImageLimits().max_pixels == DataConfig().max_image_pixels


# ------------------------------------------------------------------ the config fields take effect or are refused


def test_images_key_and_max_image_pixels_reach_the_row_reader(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(40, 30))
    _jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "1", "pics": ["a.png"]}])
    rows = build_prompt_source(DataConfig(source=str(tmp_path / "t.jsonl"), images_key="pics"))
    assert rows.row_at(0)["images"] == [(tmp_path / "a.png").read_bytes()]
    with pytest.raises(DatasetError, match="40x30 = 1200 pixels, over the limit of 1000 .data.max_image_pixels."):
        build_prompt_source(DataConfig(source=str(tmp_path / "t.jsonl"), images_key="pics", max_image_pixels=1000))
    with pytest.raises(DatasetError, match="56x56 = 3136 pixels, over the limit of 3000"):
        build_prompt_source(DataConfig(source="demo:shapes-train", num_prompts=4, max_image_pixels=3000))


@pytest.mark.parametrize("fields, needles", [
    pytest.param({"source": "demo:shapes-train", "images_key": "images"},
                 ["data.images_key='images'", "built-in demo task", "drop data.images_key"], id="images-key-on-demo"),
    pytest.param({"source": "data.jsonl", "max_image_pixels": 1000},
                 ["data.max_image_pixels=1000", "the rows have none", "set data.images_key"], id="pixels-without-images"),
    pytest.param({"source": "data.jsonl", "images_key": "images", "max_image_pixels": 10**9},
                 ["max_image_pixels", "178956970"], id="pixels-past-pillow"),
])
def test_image_fields_are_refused_where_they_cannot_act(fields, needles):
    with pytest.raises(ValueError) as err:
        DataConfig(**fields)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


# ------------------------------------------------------------------ the count-the-shapes demo task


def test_shapes_rows_are_byte_reproducible_and_pinned():
    assert shapes_row(0, 0) == shapes_row(0, 0) and shapes_row(0, 7, "heldout") == shapes_row(0, 7, "heldout")
    assert shapes_row(0, 0)["images"] != shapes_row(1, 0)["images"]
    assert hashlib.sha256(shapes_row(0, 0)["images"][0]).hexdigest() == ROW0_SHA256


def test_the_png_is_the_drawn_scene_and_the_answer_counts_its_target_colour():
    answers = set()
    for i in range(40):
        row = shapes_row(2, i)
        shapes, answer = draw_scene(2, i)
        assert row["prompt"] == QUESTION and row["answer"] == str(answer) and len(row["answer"]) == 1
        assert answer == sum(colour == TARGET for _, _, colour, *_ in shapes)
        pixels = np.asarray(decode_image(row["images"][0], "o", ImageLimits()))
        assert pixels.shape == (56, 56, 3) and np.array_equal(pixels, np.asarray(render(shapes)))
        assert np.any(np.all(pixels == COLOURS[TARGET], axis=-1))
        answers.add(row["answer"])
    assert answers == {"1", "2", "3", "4"}
    assert png_bytes(render(draw_scene(0, 0)[0])) == shapes_row(0, 0)["images"][0]


@pytest.mark.parametrize("seed", [0, 1])
def test_train_and_heldout_shapes_never_share_an_image(seed):
    train = {shapes_row(seed, i, "train")["images"][0] for i in range(300)}
    heldout = {shapes_row(seed, i, "heldout")["images"][0] for i in range(60)}
    assert len(heldout) > 55 and not train & heldout


def test_demo_shapes_sources_serve_the_task_rows():
    source = open_prompt_source("demo:shapes-heldout", num_prompts=5)
    assert isinstance(source, ShapesTaskSource) and len(source) == 5 and source.name == "demo:shapes-heldout"
    row = source.row(2)
    assert row["images"] == shapes_row(0, 2, "heldout")["images"] and row["origin"] == "demo:shapes-heldout#2"
    assert row["metadata"] == {} and row["answer"] == shapes_row(0, 2, "heldout")["answer"]
    with pytest.raises(DatasetError, match="demo:shapes-train, demo:shapes-heldout"):
        open_prompt_source("demo:shapes-test")
