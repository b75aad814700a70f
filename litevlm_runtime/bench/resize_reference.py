"""How far our decode + resize is from upstream InternVL's, measured against a float64 reference.

Upstream's eval transform is torchvision `Resize((S, S), BICUBIC)` on the PIL image, which is
PIL's `resize(..., BICUBIC)` of the fully decoded frame. Ours (preprocess.load_image +
to_tiles_uint8) is the same PIL resize, but of a JPEG decoded at reduced scale by libjpeg's DCT
scaling (`draft`) when the target is at most half the frame. The reference here recomputes PIL's
resampling in float64 from its definition: separable, horizontal pass first, the cubic kernel with
a = -0.5, support 2 widened by the downscale factor (the antialiasing), each pass clipped to
[0, 255] as PIL's 8-bit intermediate is, but nothing rounded.

  python -m litevlm_runtime.bench.resize_reference --frames ../shared/drivelm_sample [--limit N]

prints, per tile size and tiles per camera, the uint8 differences (max, mean, 99th percentile)
of upstream and of ours against the reference and of ours against upstream, and the decode +
resize time of ours against upstream's (median per frame, the ratio in the same run).
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..stages.preprocess import load_image, to_tiles_uint8

CONFIGS = ((448, 1), (448, 2), (224, 1), (224, 2))     # (tile side, tiles per camera)


def cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def resample_weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in]: output pixel i averages the inputs around its centre (i + 0.5) * scale with
    the cubic kernel stretched by the downscale factor, normalized to sum 1 (PIL's window:
    [centre - support + 0.5, centre + support + 0.5) truncated, clamped to the image)."""
    scale = n_in / n_out
    stretch = max(scale, 1.0)
    support = 2.0 * stretch
    weights = np.zeros((n_out, n_in))
    for i in range(n_out):
        centre = (i + 0.5) * scale
        lo, hi = max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), n_in)
        taps = cubic((np.arange(lo, hi) - centre + 0.5) / stretch)
        weights[i, lo:hi] = taps / taps.sum()
    return weights


def bicubic_resize_float64(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """HxWx3 uint8 -> height x width x 3 float64 (not rounded)."""
    x = rgb.astype(np.float64)
    across = np.clip(np.einsum("hwc,ow->hoc", x, resample_weights(x.shape[1], width), optimize=True), 0, 255)
    return np.clip(np.einsum("oh,hwc->owc", resample_weights(x.shape[0], height), across, optimize=True), 0, 255)


def tiles_of(jpeg: bytes, tile: int, tiles: int, jpeg_draft: bool) -> np.ndarray:
    """Our preprocessing of one camera: [tile, tiles * tile, 3] uint8 (the tiles side by side)."""
    img = load_image(jpeg, "CAM", (tile * tiles, tile), jpeg_draft=jpeg_draft)
    out = torch.empty(tiles, 3, tile, tile, dtype=torch.uint8)
    to_tiles_uint8(img, tile, tiles, out)
    return out.permute(2, 0, 3, 1).reshape(tile, tiles * tile, 3).numpy()


def compare(jpegs: list[bytes], tile: int, tiles: int) -> dict:
    """Differences in uint8 levels over all pixels of all frames, and times per frame in ms."""
    diffs = {"upstream-ref": [], "ours-ref": [], "ours-upstream": []}
    times = {"ours": [], "upstream": []}
    scales = set()
    for data in jpegs:
        t0 = time.perf_counter()
        ours = tiles_of(data, tile, tiles, jpeg_draft=True)
        t1 = time.perf_counter()
        upstream = tiles_of(data, tile, tiles, jpeg_draft=False)
        t2 = time.perf_counter()
        times["ours"].append((t1 - t0) * 1e3)
        times["upstream"].append((t2 - t1) * 1e3)
        probe = Image.open(io.BytesIO(data))
        full_width = probe.width
        probe.draft("RGB", (tile * tiles, tile))
        scales.add(f"1/{full_width // probe.width}")
        ref = bicubic_resize_float64(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), tile * tiles, tile)
        diffs["upstream-ref"].append(np.abs(upstream - ref).ravel())
        diffs["ours-ref"].append(np.abs(ours - ref).ravel())
        diffs["ours-upstream"].append(np.abs(ours.astype(np.int16) - upstream).ravel())
    row = {"tile": tile, "tiles": tiles, "decode_scale": ",".join(sorted(scales)), "frames": len(jpegs)}
    for name, parts in diffs.items():
        d = np.concatenate(parts).astype(np.float64)
        row[name] = (float(d.max()), float(d.mean()), float(np.percentile(d, 99)))
    row["ms"] = {k: statistics.median(v) for k, v in times.items()}
    return row


def frame_files(folder: Path, limit: int | None) -> list[Path]:
    samples = folder / "samples" if (folder / "samples").is_dir() else folder
    files = sorted(p for p in samples.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    if not files:
        raise SystemExit(f"{folder}: no JPEG frames found")
    return files[:limit] if limit else files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--frames", type=Path, required=True, help="folder of JPEG frames (DriveLM samples/CAM_X/ layout too)"
    )
    ap.add_argument("--limit", type=int, help="at most this many frames")
    args = ap.parse_args(argv)
    jpegs = [p.read_bytes() for p in frame_files(args.frames, args.limit)]
    sizes = {Image.open(io.BytesIO(d)).size for d in jpegs}
    print(f"{len(jpegs)} JPEG frames, sizes {', '.join(f'{w}x{h}' for w, h in sorted(sizes))}; "
          "uint8 levels: max / mean / p99 of |difference|")
    print(f"{'tile':>5}{'tiles':>6}{'draft':>7}  {'upstream - float64 ref':>24}  {'ours - float64 ref':>24}  "
          f"{'ours - upstream':>22}  {'ms ours':>8}{'ms upstream':>12}{'speed-up':>9}")
    for tile, tiles in CONFIGS:
        r = compare(jpegs, tile, tiles)
        cells = "  ".join(
            f"{m:7.2f} /{a:6.3f} /{p:6.2f}" for m, a, p in (r["upstream-ref"], r["ours-ref"], r["ours-upstream"])
        )
        ms = r["ms"]
        print(f"{tile:>5}{tiles:>6}{r['decode_scale']:>7}  {cells}  {ms['ours']:8.2f}{ms['upstream']:12.2f}"
              f"{ms['upstream'] / ms['ours']:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
