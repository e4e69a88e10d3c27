"""Encoded images (PNG, JPEG, ...): read, checked from their header, decoded to RGB, with errors naming the row.

    from yatt_hpc.vision.images import ImageLimits, check_image_bytes, decode_image, read_image_file
    limits = ImageLimits(max_pixels=4096 * 4096)
    data = read_image_file("/data/img/3.png", "train.jsonl:3 image 0", limits)    # the file's bytes
    check_image_bytes(data, "train.jsonl:3 image 0", limits)   # (width, height, "PNG"), no pixel decoded
    decode_image(data, "train.jsonl:3 image 0", limits)        # PIL.Image.Image in mode RGB

Rows carry encoded bytes, never pixels (a decoded 1-megapixel image is ~3 MB, its JPEG ~0.2 MB): the
rank that consumes a row decodes it. `check_image_bytes` is what a row reader calls when the row is
read: the size limits are checked from the header (Pillow's `Image.open` is lazy) before any pixel is
decoded, so an oversized image (a decompression bomb) costs nothing, and `verify()` walks the file's
chunks (a PNG's CRCs) without decoding, so a truncated PNG fails when its row is read. A truncated
JPEG can only be told by decoding: `decode_image` catches it. Every problem is an `ImageError` whose
message starts with the origin given (the row and the image), then the problem, the value and the fix.
"""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

MIB = 1 << 20
_MAGIC = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF"}
PILLOW_PIXEL_LIMIT = 2 * Image.MAX_IMAGE_PIXELS
"""Pillow refuses to open an image above this many pixels (its decompression-bomb error); no limit can pass it."""


class ImageError(ValueError):
    """A user error in an image (missing, unreadable, too large); the message is complete and printed as is."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be. `max_bytes`: its encoded size; `max_pixels`: width x height, checked from the
    header before decoding; `min_side`: its shorter side, in pixels."""

    max_bytes: int = 20 * MIB
    max_pixels: int = 8192 * 8192  # 67 M: any photo; below Pillow's own warning threshold (89 M)
    min_side: int = 1

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.min_side < 1:
            raise ValueError(f"ImageLimits: max_bytes and min_side must be >= 1, got {self.max_bytes}, {self.min_side}")
        if not 1 <= self.max_pixels <= PILLOW_PIXEL_LIMIT:
            raise ValueError(f"ImageLimits: max_pixels must be in 1..{PILLOW_PIXEL_LIMIT} (Pillow opens nothing "
                             f"larger), got {self.max_pixels}")


def read_image_file(path: str | Path, origin: str, limits: ImageLimits) -> bytes:
    """The bytes of an image file; its size is checked before it is read."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ImageError(f"{origin}: image file {str(path)!r} does not exist; put the file there, or fix the "
                         "row's path (a relative path is relative to the dataset file's directory)") from None
    except OSError as err:
        raise ImageError(f"{origin}: image file {str(path)!r} cannot be read ({err.strerror}); fix its "
                         "permissions or the row's path") from None
    _check_size(size, origin, limits)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ImageError(f"{origin}: image file {str(path)!r} cannot be read ({err.strerror}); fix its "
                         "permissions or the row's path") from None


def check_image_bytes(data: bytes, origin: str, limits: ImageLimits) -> tuple[int, int, str]:
    """(width, height, format) of an encoded image, checked without decoding its pixels."""
    image = _open(data, origin, limits)
    try:
        image.verify()
    except Exception as err:  # Pillow's plugins raise SyntaxError, OSError, struct.error... for a damaged file
        raise ImageError(f"{origin}: the {image.format} image is damaged or truncated ({_reason(err)}); "
                         "re-encode or replace the file") from None
    return image.width, image.height, image.format


def decode_image(data: bytes, origin: str, limits: ImageLimits) -> Image.Image:
    """The decoded image in mode RGB (an alpha channel is dropped, a palette expanded)."""
    image = _open(data, origin, limits)
    try:
        image.load()
    except Exception as err:  # a truncated file: OSError "image file is truncated"; others by plugin
        raise ImageError(f"{origin}: the {image.format} image cannot be decoded ({_reason(err)}); the file is "
                         "damaged or truncated: re-encode or replace it") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def _open(data: bytes, origin: str, limits: ImageLimits) -> Image.Image:
    """The lazily opened image (header read, no pixels), its sizes checked."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"{origin}: expected the encoded image's bytes, got {type(data).__name__}")
    _check_size(len(data), origin, limits)
    try:
        with warnings.catch_warnings():  # our limit is the one in force, up to Pillow's hard one
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        kind = _looks_like(data)
        if kind:
            raise ImageError(f"{origin}: {len(data)} bytes that start like a {kind} but whose header Pillow cannot "
                             "read (truncated, damaged or of zero size); re-encode or replace the image") from None
        raise ImageError(f"{origin}: {len(data)} bytes that are not an image Pillow can read (they start "
                         f"{bytes(data[:8])!r}); store PNG or JPEG bytes, or fix the row") from None
    except Image.DecompressionBombError as err:
        raise ImageError(f"{origin}: image too large to open, over Pillow's own limit of {PILLOW_PIXEL_LIMIT} "
                         f"pixels ({_reason(err)}); downscale it") from None
    except Exception as err:
        raise ImageError(f"{origin}: the image's header cannot be read ({_reason(err)}); the file is damaged: "
                         "re-encode or replace it") from None
    w, h = image.size
    if min(w, h) < limits.min_side:
        raise ImageError(f"{origin}: the {image.format} image is {w}x{h} pixels, below the smallest side of "
                         f"{limits.min_side}; drop the row or replace the image")
    if w * h > limits.max_pixels:
        raise ImageError(f"{origin}: the {image.format} image is {w}x{h} = {w * h} pixels, over the limit of "
                         f"{limits.max_pixels} (data.max_image_pixels); downscale it, or raise the limit")
    return image


def _check_size(size: int, origin: str, limits: ImageLimits) -> None:
    if size == 0:
        raise ImageError(f"{origin}: the image is empty (0 bytes); replace it, or drop the row")
    if size > limits.max_bytes:
        raise ImageError(f"{origin}: the encoded image is {size} bytes, over the limit of {limits.max_bytes} "
                         f"({limits.max_bytes / MIB:g} MiB); re-encode it smaller (JPEG) or downscale it")


def _looks_like(data: bytes) -> str | None:
    """The format an image's first bytes announce, if any."""
    head = bytes(data[:12])
    for magic, kind in _MAGIC.items():
        if head.startswith(magic):
            return kind
    return "WEBP" if head[:4] == b"RIFF" and head[8:12] == b"WEBP" else None


def _reason(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
