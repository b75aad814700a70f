"""What the node checks of every camera frame on arrival, whether or not a query will select it:
cheap header checks only (nothing is decoded on the executor thread).

  too_large(camera, msg, max_pixels)   a raw sensor_msgs/Image's width x height from its header,
                                       against images.max_pixels, before its data is copied or
                                       stored: the frame store would otherwise hold a 192 MB
                                       8000x8000 rgb8 frame for each of `frame_history` slots
  header_defect(camera, payload, ...)  why a stored frame could not be decoded if selected: a
                                       CompressedImage that is neither JPEG nor PNG by its magic,
                                       or whose header dimensions are out of bounds; a raw Image
                                       whose encoding, step or data length is wrong. The frame
                                       is still stored (an unselected camera must not fail a
                                       query); the camera is counted undecodable on /diagnostics
"""

from __future__ import annotations

from ..errors import InputError
from ..preprocess import check_image_size, open_image
from .images import JPEG_MAGIC, PNG_MAGIC, RAW_ENCODINGS, CompressedPayload, RawPayload


def too_large(camera: str, msg, max_pixels: int) -> str | None:
    """Why a raw Image message is refused before its payload is made (None: it fits)."""
    if hasattr(msg, "format"):                        # CompressedImage: its size is in the data's header
        return None
    width, height = int(msg.width), int(msg.height)
    if width * height <= max_pixels:
        return None
    return (f"{camera}: image is {width}x{height} = {width * height / 1e6:.1f} Mpixel, above the limit of "
            f"{max_pixels / 1e6:.1f} Mpixel (images.max_pixels); refused on arrival, not stored "
            f"(sensor_msgs/Image, {msg.encoding})")


def header_defect(camera: str, payload, max_pixels: int) -> str | None:
    """Why this frame would be bad_image if a query selected it, from its header (None: fine)."""
    if isinstance(payload, CompressedPayload):
        data = payload.data
        if not (data.startswith(JPEG_MAGIC) or data.startswith(PNG_MAGIC)):
            return f"{camera}: CompressedImage is neither JPEG nor PNG (first bytes {data[:8].hex()})"
        try:
            open_image(data, camera, max_pixels)       # header only: PIL reads the size, decodes nothing
        except InputError as exc:
            return str(exc)
        return None
    if isinstance(payload, RawPayload):
        enc = RAW_ENCODINGS.get(payload.encoding)
        if enc is None:
            return f"{camera}: Image encoding {payload.encoding!r} unsupported"
        try:
            check_image_size(camera, payload.width, payload.height, max_pixels)
        except InputError as exc:
            return str(exc)
        rows = payload.height * 3 // 2 if enc.planar_420 else payload.height
        if payload.step < payload.width * enc.channels * enc.bits // 8 or len(payload.data) != payload.step * rows:
            return f"{camera}: Image data has {len(payload.data)} bytes for step {payload.step} x {rows} rows"
        return None
    return f"{camera}: unsupported payload {type(payload).__name__}"
