"""Camera image -> normalized tiles, uint8 until the last step.

Decode (JPEG/PNG bytes, a file, or an HxWx3 uint8 array) -> resize to `tiles` tiles of S x S side
by side (bicubic, as InternVL's preprocessing) -> uint8 tiles written into the arena -> one in-place
float conversion and ImageNet normalization over all selected tiles together.

Limits, one rule for every kind of input (bytes, file, array, PIL image, raw ROS image): the size is
known before any pixel is decoded (PIL reads only the header on open), and an image outside
[MIN_IMAGE_SIDE, max_image_pixels] is refused there with an InputError naming the camera.

JPEG decoding uses libjpeg's DCT scaling (PIL `draft`) to decode straight at the smallest scale
that is still >= the target size: a 1600x900 frame for a 896x448 target decodes at 1/1, but for a
448x448 tile it decodes at 1/2 (and at 1/4 for a 224 tile), which halves the decode time or better.
It is not what upstream InternVL does (full decode, then PIL bicubic): on the 54 nuScenes frames
the mean difference is 0.4 uint8 levels at one 448 tile per camera (max 18, p99 2) and 0.7 at one
224 tile (max 34, p99 6), at edges; none where the frame decodes at 1/1 (`python -m
litevlm_runtime.bench.resize_reference` prints the table). `jpeg_draft=False` decodes in full.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from ..errors import InputError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ImageInput = "bytes | str | Path | np.ndarray | PIL.Image.Image"

# 16 Mpixel (4096 x 4096): twice the largest automotive cameras (8.3 Mpixel, 3840 x 2160), a 48 MB
# RGB frame once decoded, and under a second for the slowest decoder (PNG) on one core here. A
# 12000 x 12000 PNG (144 Mpixel) is refused from its header.
MAX_IMAGE_PIXELS = 4096 * 4096
# 2 x 2: the smallest image that every encoding carries in full colour (one Bayer 2x2 cell, one
# YUV 4:2:2 pixel pair, one NV12 chroma sample). The same for JPEG/PNG, arrays and raw images.
MIN_IMAGE_SIDE = 2
_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")


def check_image_size(camera: str, width: int, height: int, max_image_pixels: int = MAX_IMAGE_PIXELS) -> None:
    if width < MIN_IMAGE_SIDE or height < MIN_IMAGE_SIDE:
        raise InputError(f"{camera}: image is {width}x{height} pixels; at least "
                         f"{MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} is needed", camera=camera)
    if width * height > max_image_pixels:
        raise InputError(
            f"{camera}: image is {width}x{height} = {width * height / 1e6:.1f} Mpixel, above the "
            f"limit of {max_image_pixels / 1e6:.1f} Mpixel (images.max_pixels); refused before decoding",
            camera=camera,
        )


def describe(exc: Exception) -> str:
    """An exception's message for a user: PIL puts the repr of the file object into some of its
    messages ("<_io.BytesIO object at 0x7f..>"), which says nothing and differs run to run."""
    return _OBJECT_REPR.sub("the data", str(exc)) or type(exc).__name__


def open_image(source, camera: str, max_image_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """JPEG/PNG/... bytes or a file path -> a PIL image of which only the header has been read,
    its size checked. PIL's own decompression-bomb limit (Image.MAX_IMAGE_PIXELS, checked inside
    Image.open) applies on top of max_image_pixels: an image above it is refused the same way."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise InputError(f"{camera}: empty image data", camera=camera)
        fp, head = io.BytesIO(data), data[:8]
    else:
        path = Path(source)
        if not path.is_file():
            raise InputError(f"{camera}: image file {path} does not exist", camera=camera)
        with path.open("rb") as f:
            head = f.read(8)
        fp = path
    try:
        with warnings.catch_warnings():
            # PIL warns above Image.MAX_IMAGE_PIXELS (89 Mpixel) and raises above twice that:
            # both mean "refuse" here, the same way (a warning would only be printed).
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(fp)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InputError(f"{camera}: refused before decoding: {describe(exc)}", camera=camera) from None
    except UnidentifiedImageError:
        raise InputError(f"{camera}: cannot decode image (not an image format PIL reads; "
                         f"first bytes {head.hex()})", camera=camera) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"{camera}: cannot decode image ({describe(exc)})", camera=camera) from None
    check_image_size(camera, img.width, img.height, max_image_pixels)
    return img


def scale_16_to_8(samples: np.ndarray) -> np.ndarray:
    """16-bit samples -> uint8 by 255/65535, rounded (cv_bridge's rule for 16 -> 8 bit): the full
    16-bit range maps onto the full 8-bit range."""
    return cv2.convertScaleAbs(samples, alpha=255.0 / 65535.0)


def _rgb(img: Image.Image) -> Image.Image:
    if img.mode.startswith("I;16"):
        # PIL's own I;16 -> RGB conversion clips at 255 (a 16-bit PNG, e.g. image_transport's
        # "mono16; png compressed mono16", would come out white): scale instead.
        return Image.fromarray(scale_16_to_8(np.asarray(img).astype(np.uint16))).convert("RGB")
    return img.convert("RGB")


def load_image(image, camera: str, target: tuple[int, int], max_image_pixels: int = MAX_IMAGE_PIXELS,
               jpeg_draft: bool = True) -> Image.Image:
    """Any accepted image input -> RGB PIL image (decoded at reduced scale where JPEG allows,
    unless jpeg_draft is False). The size is checked against [MIN_IMAGE_SIDE, max_image_pixels]
    before decoding."""
    if isinstance(image, Image.Image):
        check_image_size(camera, image.width, image.height, max_image_pixels)
        img = image
    elif isinstance(image, np.ndarray):
        arr = image
        if arr.dtype != np.uint8:
            raise InputError(f"{camera}: image array must be uint8, got {arr.dtype}", camera=camera)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
            raise InputError(f"{camera}: image array must be HxWx3 (or HxW), got shape {arr.shape}", camera=camera)
        check_image_size(camera, arr.shape[1], arr.shape[0], max_image_pixels)
        if arr.shape[2] == 1:
            arr = np.repeat(arr, 3, axis=2)
        return Image.fromarray(np.ascontiguousarray(arr[:, :, :3]))
    elif isinstance(image, (bytes, bytearray, memoryview, str, Path)):
        img = open_image(image, camera, max_image_pixels)
    else:
        raise InputError(f"{camera}: unsupported image type {type(image).__name__}", camera=camera)
    try:
        if img.format == "JPEG" and jpeg_draft:
            img.draft("RGB", target)
        img = _rgb(img)
        img.load()
        return img
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(f"{camera}: cannot decode image ({describe(exc)})", camera=camera) from None


def to_tiles_uint8(img: Image.Image, tile: int, tiles: int, out: torch.Tensor) -> None:
    """Resize to (tiles*tile) x tile and write the tiles, left to right, into out [tiles, 3, S, S] uint8."""
    resized = img.resize((tile * tiles, tile), Image.BICUBIC)
    arr = torch.from_numpy(np.array(resized))                # [S, tiles*S, 3] uint8
    out.copy_(arr.view(tile, tiles, tile, 3).permute(1, 3, 0, 2))


class Normalizer:
    """uint8 [N, 3, S, S] -> float [N, 3, S, S] normalized in place in a preallocated buffer."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.scale = (1.0 / (255.0 * torch.tensor(IMAGENET_STD))).view(1, 3, 1, 1).to(device, dtype)
        self.shift = (torch.tensor(IMAGENET_MEAN) / torch.tensor(IMAGENET_STD)).view(1, 3, 1, 1).to(device, dtype)

    def __call__(self, pixels_u8: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Into `out` (the pipeline's preallocated buffer), or a new tensor (training)."""
        if out is None:
            out = pixels_u8.to(self.scale.dtype)
        else:
            out.copy_(pixels_u8)          # uint8 -> float happens here, on the device, in place
        return out.mul_(self.scale).sub_(self.shift)
