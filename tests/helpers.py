"""Small builders shared by tests: checkpoints in the real layout and synthetic frame sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from litevlm_runtime.cameras import CAMERAS


def make_tiny_checkpoint(path: Path, preset: str = "tiny", seed: int = 0, **kw) -> Path:
    from litevlm_runtime.commands.make_checkpoint import make_checkpoint

    if not (path / "config.json").is_file():
        make_checkpoint(path, preset, seed=seed, **kw)
    return path


def random_frames(seed: int = 0, h: int = 90, w: int = 160) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam in CAMERAS}


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over a few bytes of pixel data: what a
    decompression bomb looks like to a reader of headers (a small file that decodes to gigabytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))
