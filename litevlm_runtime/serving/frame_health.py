"""What the node checks of every camera frame on arrival, whether or not a query will select it:
cheap header checks only (nothing is decoded on the executor thread).

  too_large(camera, msg, max_pixels,   a raw sensor_msgs/Image's width x height from its header,
            max_bytes)                 against images.max_pixels, and any frame's data length
                                       against the frame store's bound (frame_memory_mb), before
                                       its data is copied or stored
  header_defect(camera, payload, ...)  why a stored frame could not be decoded if selected: a
                                       CompressedImage that is neither JPEG nor PNG by its magic,
                                       or whose header dimensions are out of bounds; a raw Image
                                       whose encoding, step or data length is wrong. The frame
                                       is still stored (an unselected camera must not fail a
                                       query); the camera is counted undecodable on /diagnostics
"""

from __future__ import annotations

from ..errors import InputError
from ..stages.preprocess import check_image_size, open_image
from .frame_store import over_memory
from .images import JPEG_MAGIC, PNG_MAGIC, RAW_ENCODINGS, CompressedPayload, RawPayload

# The most bytes a pixel takes in any accepted encoding (rgba16/bgra16): a frame's data above
# images.max_pixels x this is refused whatever its header says (a small header over a huge buffer).
MAX_BYTES_PER_PIXEL = 8


def too_large(camera: str, msg, max_pixels: int, max_bytes: int | None = None) -> str | None:
    """Why an Image or CompressedImage message is refused before its payload is made (None: it
    fits): a raw Image's width x height above max_pixels, or its data above max_pixels x
    MAX_BYTES_PER_PIXEL bytes or above max_bytes (the frame store's per-camera bound,
    frame_memory_mb), which it could never hold."""
    if not hasattr(msg, "format"):                    # raw Image (a CompressedImage's size is in its data)
        width, height = int(msg.width), int(msg.height)
        if width * height > max_pixels:
            return (f"{camera}: image is {width}x{height} = {width * height / 1e6:.1f} Mpixel, above the limit of "
                    f"{max_pixels / 1e6:.1f} Mpixel (images.max_pixels); refused on arrival, not stored "
                    f"(sensor_msgs/Image, {msg.encoding})")
    size, limit = len(msg.data), max_pixels * MAX_BYTES_PER_PIXEL
    if size > limit:
        return (f"{camera}: frame data of {size / 1e6:.1f} MB, above images.max_pixels x {MAX_BYTES_PER_PIXEL} "
                f"bytes ({limit / 1e6:.1f} MB); refused on arrival, not stored")
    return over_memory(camera, size, max_bytes)


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
