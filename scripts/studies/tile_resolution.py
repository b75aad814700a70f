"""How much the tiles the model sees depend on the size a scene was rendered at.

    .venv/bin/python scripts/studies/tile_resolution.py --sets DIR_480x270 DIR_800x450 DIR_1600x900 [--tile 224]

The sets are SynthDrive renders of the same seed and scenes at several sizes (`litevlm synth
--seed S --scenes N --width W --height H`), the last one the reference. For every camera image it
makes the tile three ways and prints the mean absolute difference to the reference's tile (uint8
levels): the pipeline's own preprocessing (`preprocess.load_image`, which decodes JPEGs at a
reduced DCT scale where the target allows, then bicubic resize), a full-size decode then the same
resize (what the DCT scaling adds), and the reference image first resized to the smaller render's
size (what is left is the renderer: aliased polygons and lines of whole-pixel widths).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from litevlm_runtime.stages.preprocess import load_image


def tile(img: Image.Image, size: int) -> np.ndarray:
    return np.asarray(img.resize((size, size), Image.BICUBIC), dtype=np.float64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", nargs="+", type=Path, required=True, help="render folders; the last is the reference")
    p.add_argument("--tile", type=int, default=224)
    args = p.parse_args()
    names = sorted(q.relative_to(args.sets[-1]) for q in (args.sets[-1] / "samples").rglob("*.jpg"))
    s = args.tile
    rows = []
    for folder in args.sets[:-1]:
        pipeline, full, renderer = [], [], []
        for name in names:
            small, ref = folder / name, args.sets[-1] / name
            ref_tile = tile(load_image(ref, "ref", (s, s)), s)
            pipeline.append(np.abs(tile(load_image(small, "cam", (s, s)), s) - ref_tile).mean())
            small_full = Image.open(small).convert("RGB")
            ref_full = Image.open(ref).convert("RGB")
            full.append(np.abs(tile(small_full, s) - tile(ref_full, s)).mean())
            renderer.append(
                np.abs(tile(small_full, s) - tile(ref_full.resize(small_full.size, Image.BICUBIC), s)).mean()
            )
        with Image.open(folder / names[0]) as im:
            size = f"{im.width}x{im.height}"
        rows.append((size, np.mean(pipeline), np.mean(full), np.mean(renderer)))
    with Image.open(args.sets[-1] / names[0]) as im:
        ref_size = f"{im.width}x{im.height}"
    print(f"{len(names)} camera images, {s} px tiles, mean |tile - tile of the {ref_size} render| in uint8 levels")
    print("| render | pipeline preprocessing | full decode + resize | reference resized to the render first |")
    print("|---|---|---|---|")
    for size, a, b, c in rows:
        print(f"| {size} | {a:.2f} | {b:.2f} | {c:.2f} |")


if __name__ == "__main__":
    main()
