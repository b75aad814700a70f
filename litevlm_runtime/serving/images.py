"""Camera payloads as they arrive from ROS, and their conversion to what Pipeline.answer takes.

Frames are stored undecoded: a JPEG stays bytes until a query uses it (and then the pipeline
decodes only the cameras the view selector keeps); only its header is read here, so that an image
too large or too small is refused before anything is decoded. A raw sensor_msgs/Image is converted
to RGB with OpenCV's cvtColor in any encoding of sensor_msgs/image_encodings.hpp that a camera
driver publishes: rgb/bgr/rgba/bgra and mono in 8 and 16 bit, Bayer (8 and 16 bit), YUV 4:2:2
(UYVY, YUYV) and NV12/NV21. 16-bit samples are scaled to 8 bit as cv_bridge does (255/65535) and
read in the byte order `is_bigendian` gives. Errors raise ImageError naming the camera and the
defect, which the node turns into a STATUS_BAD_IMAGE answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

import zlib
from collections.abc import Mapping

from ..errors import InputError
from ..stages.preprocess import MAX_IMAGE_PIXELS, check_image_size, open_image, scale_16_to_8

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ImageError(InputError):
    """A camera's frame cannot be used (the message names the camera): a bad_image answer."""


class LazyByCamera(Mapping):
    """camera -> a value made from `source[camera]` the first time the pipeline reads that camera,
    then kept: the view selector runs first, so only the cameras it selects are ever made."""

    def __init__(self, source: dict):
        self.source, self._made = source, {}

    def make(self, camera: str, item):
        raise NotImplementedError

    def __getitem__(self, camera: str):
        if camera not in self._made:
            self._made[camera] = self.make(camera, self.source[camera])
        return self._made[camera]

    def __contains__(self, camera) -> bool:
        return camera in self.source

    def __iter__(self):
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


class FrameKeys(LazyByCamera):
    """camera -> what identifies its frame for visual reuse: the header stamp and a CRC-32 of the
    payload (a replayed bag, or another source, may reuse stamps for other images). Only selected
    cameras are hashed (~0.1 ms per JPEG)."""

    def make(self, camera: str, frame):
        return frame.stamp_ns, zlib.crc32(frame.payload.data)


class CameraImages(LazyByCamera):
    """camera -> what Pipeline.answer takes, converted from the ROS payload when the pipeline first
    reads that camera: an unselected camera is never converted (a Bayer or YUV frame is not
    demosaiced for nothing, a broken one does not fail the query), and the conversion is timed in
    the pipeline's preprocess stage."""

    def __init__(self, payloads: dict, max_image_pixels: int = MAX_IMAGE_PIXELS):
        super().__init__(payloads)
        self.max_image_pixels = max_image_pixels

    def make(self, camera: str, payload):
        return to_pipeline_image(camera, payload, self.max_image_pixels)


@dataclass(frozen=True)
class RawEncoding:
    channels: int           # samples per pixel in a row of the message (YUV 4:2:2: 2 per pixel)
    bits: int               # per sample: 8 or 16
    to_rgb: int | None      # cv2.cvtColor code to RGB; None: the samples are RGB already
    from_rgb: int | None    # the code back, for writing test bags (None: see rgb_to_raw)
    planar_420: bool = False   # NV12/NV21: a full-size Y plane, then a half-height chroma plane


_GREY = RawEncoding(1, 8, cv2.COLOR_GRAY2RGB, cv2.COLOR_RGB2GRAY)
_GREY16 = RawEncoding(1, 16, cv2.COLOR_GRAY2RGB, cv2.COLOR_RGB2GRAY)


def _bayer(pattern: str, bits: int) -> RawEncoding:
    # OpenCV's COLOR_Bayer<RGGB>2RGB names the 2x2 cell at the image's top-left corner, as ROS
    # does (its older COLOR_BayerBG2RGB alias of the same code names the cell at (1, 1)): ROS
    # bayer_rggb8 is COLOR_BayerRGGB2RGB, checked against a hand-built mosaic in the tests.
    return RawEncoding(1, bits, getattr(cv2, f"COLOR_Bayer{pattern.upper()}2RGB"), None)


# sensor_msgs/image_encodings.hpp names. "yuv422" is UYVY and "yuv422_yuy2" is YUYV (both
# deprecated there in favour of "uyvy" / "yuyv", which mean the same). 8UC1/16UC1 are
# single-channel images without a colour meaning: shown as grey, like mono8/mono16.
RAW_ENCODINGS: dict[str, RawEncoding] = {
    "rgb8": RawEncoding(3, 8, None, None),
    "bgr8": RawEncoding(3, 8, cv2.COLOR_BGR2RGB, cv2.COLOR_RGB2BGR),
    "rgba8": RawEncoding(4, 8, cv2.COLOR_RGBA2RGB, cv2.COLOR_RGB2RGBA),
    "bgra8": RawEncoding(4, 8, cv2.COLOR_BGRA2RGB, cv2.COLOR_RGB2BGRA),
    "mono8": _GREY,
    "8UC1": _GREY,
    "rgb16": RawEncoding(3, 16, None, None),
    "bgr16": RawEncoding(3, 16, cv2.COLOR_BGR2RGB, cv2.COLOR_RGB2BGR),
    "rgba16": RawEncoding(4, 16, cv2.COLOR_RGBA2RGB, cv2.COLOR_RGB2RGBA),
    "bgra16": RawEncoding(4, 16, cv2.COLOR_BGRA2RGB, cv2.COLOR_RGB2BGRA),
    "mono16": _GREY16,
    "16UC1": _GREY16,
    **{f"bayer_{p}{bits}": _bayer(p, bits) for bits in (8, 16) for p in ("rggb", "bggr", "gbrg", "grbg")},
    "yuv422": RawEncoding(2, 8, cv2.COLOR_YUV2RGB_UYVY, cv2.COLOR_RGB2YUV_UYVY),
    "uyvy": RawEncoding(2, 8, cv2.COLOR_YUV2RGB_UYVY, cv2.COLOR_RGB2YUV_UYVY),
    "yuv422_yuy2": RawEncoding(2, 8, cv2.COLOR_YUV2RGB_YUYV, cv2.COLOR_RGB2YUV_YUYV),
    "yuyv": RawEncoding(2, 8, cv2.COLOR_YUV2RGB_YUYV, cv2.COLOR_RGB2YUV_YUYV),
    "nv12": RawEncoding(1, 8, cv2.COLOR_YUV2RGB_NV12, None, planar_420=True),
    "nv21": RawEncoding(1, 8, cv2.COLOR_YUV2RGB_NV21, None, planar_420=True),
}
# Known names that are refused on purpose, with why (everything else: "unsupported").
REFUSED_ENCODINGS = {
    "8UC3": "3 channels of unknown order: publish rgb8 or bgr8",
    "8UC4": "4 channels of unknown order: publish rgba8 or bgra8",
    "32FC1": "a float image (depth?), not a camera image",
    "nv24": "not converted by OpenCV's cvtColor",
}


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
    is_bigendian: bool = False    # byte order of 16-bit samples (8-bit encodings ignore it)


def payload_from_msg(msg) -> CompressedPayload | RawPayload:
    """A sensor_msgs CompressedImage or Image (an rclpy or a rosbags message) -> its payload."""
    if hasattr(msg, "format"):
        return CompressedPayload(msg.format, bytes(msg.data))
    return RawPayload(msg.encoding, int(msg.height), int(msg.width), int(msg.step), bytes(msg.data),
                      bool(msg.is_bigendian))


def to_pipeline_image(camera: str, payload, max_image_pixels: int = MAX_IMAGE_PIXELS) -> bytes | np.ndarray:
    """JPEG/PNG bytes (signature and header checked, decoded later by the pipeline) or HxWx3 uint8 RGB."""
    if isinstance(payload, CompressedPayload):
        data = bytes(payload.data)
        if not data:
            raise ImageError(f"{camera}: empty CompressedImage")
        if "compresseddepth" in payload.format.lower():
            raise ImageError(f"{camera}: CompressedImage format {payload.format!r} is a depth image "
                             "(image_transport compressedDepth), not a camera image")
        if not (data.startswith(JPEG_MAGIC) or data.startswith(PNG_MAGIC)):
            raise ImageError(
                f"{camera}: CompressedImage (format {payload.format!r}) is neither JPEG nor PNG "
                f"(first bytes {data[:8].hex()})"
            )
        try:
            open_image(data, camera, max_image_pixels)
        except InputError as exc:
            raise ImageError(str(exc)) from None
        return data
    if isinstance(payload, RawPayload):
        return raw_to_rgb(camera, payload, max_image_pixels)
    raise ImageError(f"{camera}: unsupported payload type {type(payload).__name__}")


def raw_to_rgb(camera: str, p: RawPayload, max_image_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    enc = RAW_ENCODINGS.get(p.encoding)
    if enc is None:
        why = REFUSED_ENCODINGS.get(p.encoding, "unsupported")
        raise ImageError(f"{camera}: Image encoding {p.encoding!r}: {why} (supported: {', '.join(RAW_ENCODINGS)})")
    try:
        check_image_size(camera, p.width, p.height, max_image_pixels)
    except InputError as exc:
        raise ImageError(f"{exc} (sensor_msgs/Image, {p.encoding})") from None
    if (enc.channels == 2 or enc.planar_420) and p.width % 2:
        raise ImageError(f"{camera}: Image encoding {p.encoding} needs an even width, got {p.width}")
    if enc.planar_420 and p.height % 2:
        raise ImageError(f"{camera}: Image encoding {p.encoding} needs an even height, got {p.height}")
    row_bytes = p.width * enc.channels * enc.bits // 8
    rows = p.height * 3 // 2 if enc.planar_420 else p.height
    if p.step < row_bytes:
        raise ImageError(f"{camera}: Image step {p.step} < width {p.width} x {enc.channels} channels"
                         f" x {enc.bits // 8} bytes ({p.encoding})")
    if len(p.data) != p.step * rows:
        raise ImageError(f"{camera}: Image data has {len(p.data)} bytes, expected step x "
                         f"{'height x 3/2' if enc.planar_420 else 'height'} = {p.step * rows}")
    samples = np.frombuffer(p.data, dtype=np.uint8).reshape(rows, p.step)[:, :row_bytes]
    if enc.bits == 16:
        samples = samples.view(">u2" if p.is_bigendian else "<u2").astype(np.uint16)
    pixels = np.ascontiguousarray(samples.reshape(rows, p.width, enc.channels).squeeze(2) if enc.channels == 1
                                  else samples.reshape(rows, p.width, enc.channels))
    rgb = pixels if enc.to_rgb is None else cv2.cvtColor(pixels, enc.to_rgb)
    return scale_16_to_8(rgb) if enc.bits == 16 else rgb


def raw_encoding(name: str) -> RawEncoding:
    if name not in RAW_ENCODINGS:
        raise InputError(f"raw encoding {name!r} unsupported (supported: {', '.join(RAW_ENCODINGS)})")
    return RAW_ENCODINGS[name]


def rgb_to_raw(rgb: np.ndarray, encoding: str) -> bytes:
    """HxWx3 uint8 RGB -> the rows (no padding, little-endian) of a sensor_msgs/Image in
    `encoding`: what `bag make --raw` writes. The inverse of raw_to_rgb up to the encoding's
    loss (chroma subsampling, Bayer sampling, grey)."""
    enc = raw_encoding(encoding)
    h, w = rgb.shape[:2]
    if (enc.channels == 2 or enc.planar_420) and w % 2 or enc.planar_420 and h % 2:
        raise InputError(f"raw encoding {encoding}: needs an even width{' and height' if enc.planar_420 else ''}, "
                         f"got {w}x{h}")
    rgb = np.ascontiguousarray(rgb)
    if enc.planar_420:
        # OpenCV converts RGB to planar I420 (Y, then U, then V) but not to NV12/NV21: interleave
        # its two chroma planes by hand into the one plane NV12 (U, V) / NV21 (V, U) carry.
        y, u, v = np.split(cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV_I420).reshape(-1), [h * w, h * w * 5 // 4])
        first, second = (u, v) if encoding == "nv12" else (v, u)
        return y.tobytes() + np.stack([first, second], axis=1).tobytes()
    if encoding.startswith("bayer_"):
        # No OpenCV function makes a mosaic: keep, at each pixel, the one colour its cell names.
        pattern = encoding[len("bayer_"):len("bayer_") + 4]
        out = np.empty((h, w), np.uint8)
        for k, colour in enumerate(pattern):
            dy, dx = divmod(k, 2)
            out[dy::2, dx::2] = rgb[dy::2, dx::2, "rgb".index(colour)]
    else:
        out = rgb if enc.from_rgb is None else cv2.cvtColor(rgb, enc.from_rgb)
    if enc.bits == 16:
        out = out.astype("<u2") * 257      # 8 -> 16 bit over the full range (x 65535/255)
    return np.ascontiguousarray(out).tobytes()
