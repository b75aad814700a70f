"""Small builders shared by tests: checkpoints in the real layout and synthetic frame sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from litevlm_runtime.cameras import CAMERAS


def make_tiny_checkpoint(path: Path, preset: str = "tiny", seed: int = 0, **kw) -> Path:
    from litevlm_runtime.weights.random_init import make_checkpoint

    if not (path / "config.json").is_file():
        make_checkpoint(path, preset, seed=seed, **kw)
    return path


def lively_checkpoint_of(root: Path, preset: str, seed: int = 1, std: float = 0.1) -> Path:
    """A `preset` checkpoint in root/lively with std-`std` weights, so that greedy answers depend on
    the input (the random init's small weights answer the same token whatever the frames)."""
    from litevlm_runtime.weights.checkpoint import load_model, write_checkpoint
    from litevlm_runtime.weights.random_init import init_weights

    base = make_tiny_checkpoint(root / "base", preset)
    model = load_model(base)
    init_weights(model, seed=seed, std=std)
    write_checkpoint(root / "lively", model, base / "tokenizer.json")
    return root / "lively"


def random_frames(seed: int = 0, h: int = 90, w: int = 160) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {cam: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for cam in CAMERAS}


def options(**settings):
    """PipelineOptions from settings, `__` for the dots of their names:
    options(max_new_tokens=4, tokens__mode="layer0", tokens__keep_ratio=0.5)."""
    from litevlm_runtime.options import options_from_flat

    return options_from_flat({k.replace("__", "."): v for k, v in settings.items()})


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height over a few bytes of pixel data: what a
    decompression bomb looks like to a reader of headers (a small file that decodes to gigabytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + chunk(b"IEND", b""))


ROS2_PRIMITIVES = {"bool", "byte", "char", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
                   "uint32", "int64", "uint64", "string", "wstring"}


def ros2_msgdef(msgtype: str, extra: dict[str, str] | None = None) -> str:
    """The concatenated ROS 2 message definition of `msgtype` ("pkg/msg/Name") as rosbag2 and
    MCAP store it: its .msg text, then each type it uses after a line of '=' and "MSG: pkg/Name".
    Texts come from `extra` ("pkg/msg/Name" -> text) or the installed share/<pkg>/msg/<Name>.msg."""
    import re
    import sys

    extra = extra or {}
    seen: list[str] = []
    texts: dict[str, str] = {}

    def visit(name: str) -> None:
        if name in texts:
            return
        pkg, _, short = name.split("/")
        text = extra.get(name) or (Path(sys.prefix) / "share" / pkg / "msg" / f"{short}.msg").read_text()
        texts[name] = text
        seen.append(name)
        for line in text.splitlines():
            field = line.split("#")[0].split()
            if len(field) < 2 or "=" in field[1]:
                continue                                    # blank, comment or constant
            base = re.sub(r"(\[.*\]|<=\d+)$", "", field[0])
            if base in ROS2_PRIMITIVES or base.startswith(("string<", "wstring<")):
                continue
            dep_pkg, _, dep = base.rpartition("/")
            visit(f"{dep_pkg or pkg}/msg/{dep}")

    visit(msgtype)
    parts = [texts[msgtype]]
    for name in seen[1:]:
        pkg, _, short = name.split("/")
        parts.append("=" * 80 + f"\nMSG: {pkg}/{short}\n" + texts[name])
    return "\n".join(parts)


def relative_error(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64 (the tests' one measure of a tensor's distance)."""
    import torch

    with torch.no_grad():
        return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
