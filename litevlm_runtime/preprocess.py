"""Camera image -> normalized tiles, uint8 until the last step.

Decode (JPEG/PNG bytes, a file, or an HxWx3 uint8 array) -> resize to `tiles` tiles of S x S side
by side (bicubic, as InternVL's preprocessing) -> uint8 tiles written into the arena -> one in-place
float conversion and ImageNet normalization over all selected tiles together.

JPEG decoding uses libjpeg's DCT scaling (PIL `draft`) to decode straight at the smallest scale
that is still >= the target size: a 1600x900 frame for a 896x448 target decodes at 1/1, but for a
448x448 tile it decodes at 1/2, which halves the decode time without visible loss before resize.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from .errors import InputError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ImageInput = "bytes | str | Path | np.ndarray | PIL.Image.Image"


def load_image(image, camera: str, target: tuple[int, int]) -> Image.Image:
    """Any accepted image input -> RGB PIL image (decoded at reduced scale where JPEG allows)."""
    try:
        if isinstance(image, Image.Image):
            img = image
        elif isinstance(image, np.ndarray):
            arr = image
            if arr.dtype != np.uint8:
                raise InputError(f"{camera}: image array must be uint8, got {arr.dtype}")
            if arr.ndim == 2:
                arr = np.repeat(arr[:, :, None], 3, axis=2)
            if arr.ndim != 3 or arr.shape[2] not in (3, 4) or arr.shape[0] < 2 or arr.shape[1] < 2:
                raise InputError(f"{camera}: image array must be HxWx3 (or HxW), got shape {arr.shape}")
            img = Image.fromarray(np.ascontiguousarray(arr[:, :, :3]))
        elif isinstance(image, (bytes, bytearray, memoryview)):
            if len(image) == 0:
                raise InputError(f"{camera}: empty image data")
            img = Image.open(io.BytesIO(bytes(image)))
        elif isinstance(image, (str, Path)):
            if not Path(image).is_file():
                raise InputError(f"{camera}: image file {image} does not exist")
            img = Image.open(image)
        else:
            raise InputError(f"{camera}: unsupported image type {type(image).__name__}")
        if img.format == "JPEG":
            img.draft("RGB", target)
        img = img.convert("RGB")
        img.load()
        return img
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"{camera}: cannot decode image ({exc})") from None


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
