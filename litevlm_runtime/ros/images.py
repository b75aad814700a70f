"""Camera payloads as they arrive from ROS, and their conversion to what Pipeline.answer takes.

Plain Python (numpy only). Frames are stored undecoded: a JPEG stays bytes until a query uses it
(and then the pipeline decodes only the cameras the view selector keeps); a raw image is only
wrapped, not copied. Conversion errors raise ImageError naming the camera and the defect, which
the node turns into a STATUS_BAD_IMAGE answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RAW_ENCODINGS = ("rgb8", "bgr8", "mono8")
JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ImageError(ValueError):
    pass


@dataclass(frozen=True)
class CompressedPayload:
    format: str      # sensor_msgs/CompressedImage.format, e.g. "jpeg", "rgb8; jpeg compressed bgr8"
    data: bytes


@dataclass(frozen=True)
class RawPayload:
    encoding: str    # sensor_msgs/Image.encoding
    height: int
    width: int
    step: int        # bytes per row (may include padding)
    data: bytes


def to_pipeline_image(camera: str, payload) -> bytes | np.ndarray:
    """JPEG/PNG bytes (checked by signature, decoded later by the pipeline) or HxWx3 uint8 RGB."""
    if isinstance(payload, CompressedPayload):
        data = bytes(payload.data)
        if not data:
            raise ImageError(f"{camera}: empty CompressedImage")
        if not (data.startswith(JPEG_MAGIC) or data.startswith(PNG_MAGIC)):
            raise ImageError(
                f"{camera}: CompressedImage (format {payload.format!r}) is neither JPEG nor PNG "
                f"(first bytes {data[:8].hex()})"
            )
        return data
    if isinstance(payload, RawPayload):
        return raw_to_rgb(camera, payload)
    raise ImageError(f"{camera}: unsupported payload type {type(payload).__name__}")


def raw_to_rgb(camera: str, p: RawPayload) -> np.ndarray:
    if p.encoding not in RAW_ENCODINGS:
        raise ImageError(f"{camera}: Image encoding {p.encoding!r} unsupported (use one of {', '.join(RAW_ENCODINGS)})")
    channels = 1 if p.encoding == "mono8" else 3
    if p.height <= 0 or p.width <= 0:
        raise ImageError(f"{camera}: Image has size {p.width}x{p.height}")
    if p.step < p.width * channels:
        raise ImageError(f"{camera}: Image step {p.step} < width {p.width} x {channels} channels")
    if len(p.data) != p.step * p.height:
        raise ImageError(f"{camera}: Image data has {len(p.data)} bytes, expected step x height = {p.step * p.height}")
    rows = np.frombuffer(p.data, dtype=np.uint8).reshape(p.height, p.step)
    pixels = rows[:, : p.width * channels].reshape(p.height, p.width, channels)
    if p.encoding == "rgb8":
        return pixels
    if p.encoding == "bgr8":
        return np.ascontiguousarray(pixels[:, :, ::-1])
    return np.repeat(pixels, 3, axis=2)      # mono8 -> grey RGB
