"""One picture of an explanation: the rig as a person sees it, 2 x 3 cameras in the nuScenes layout
(front-left, front, front-right / back-left, back, back-right).

Each selected camera shows its image twice: above, the token selector's score of every visual token
(the tokens it dropped darkened); below, where the decoder looked while answering (the answer rows'
attention over the kept tokens; dropped tokens, which the decoder never saw, dark grey). A token is
drawn over the part of the image it came from: its cell of the tile grid, mapped back through the
preprocessing's squash resize (TokenGrid). A camera the view selector did not select is dimmed, with
its probability. Every object tag of the question (cyan) and of the answer (magenta) is a marker on
its camera, selected or not. The question, the answer and what ran are written above; each heatmap's
colour scale is a bar below, with its range in numbers.

Composed with numpy and OpenCV (resize, blending, outlines) and text with PIL in matplotlib's DejaVu
Sans (any Unicode a question holds): the node draws this per explained answer, where a matplotlib
figure of twelve images costs several times more.
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from pathlib import Path

import cv2
import matplotlib
import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..objects import ObjectRef
from ..pipeline.explanation import CameraView, Explanation, TokenGrid
from ..stages.preprocess import load_image

RIG_LAYOUT = (("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT"),
              ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"))
SCORE_MAP, ATTENTION_MAP = "viridis", "inferno"
QUESTION_COLOUR, ANSWER_COLOUR = (0, 229, 255), (255, 64, 255)       # cyan, magenta (RGB)
HEAT_ALPHA = 0.5            # heatmap over image
DROPPED_SHADE = 0.3         # brightness of a token the token selector dropped
UNSELECTED_SHADE = 0.35     # brightness of a camera the view selector did not select
BACKGROUND = (24, 24, 24)
TEXT = (235, 235, 235)
MUTED = (150, 150, 150)


@dataclass(frozen=True)
class Scale:
    """A heatmap's colour scale: values in [low, high] map linearly onto the colour map."""

    name: str
    colormap: str
    low: float
    high: float
    label: str


def draw_explanation(explanation: Explanation, images: dict, width: int = 1440) -> np.ndarray:
    """The picture, RGB uint8 [H, width, 3]. `images`: camera -> what the query was given (JPEG/PNG
    bytes, a path, an HxWx3 uint8 array); every camera of the rig that is present is drawn, a missing
    one as an empty panel. A rig row with no selected camera is one image high, the others two."""
    gap, margin = 10, 12
    panel_w = (width - 2 * margin - 2 * gap) // 3
    cam_h = panel_w * 9 // 16                                  # each image's height in the panel (16:9 rig)
    fonts = _fonts(max(12, width // 90))
    scales = scales_of(explanation)
    header = _header(explanation, width - 2 * margin, fonts)
    bars = _colour_bars(scales, width - 2 * margin, fonts)
    views = {v.camera: v for v in explanation.views}
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    one_line = all(probe.textlength(camera + "  ", font=fonts["bold"]) + probe.textlength(
        _status(views.get(camera)), font=fonts["small"]) <= panel_w - 4 for row in RIG_LAYOUT for camera in row)
    layout = PanelLayout(panel_w, cam_h, fonts, scales, one_line)
    panels = [[_panel(camera, views.get(camera), images.get(camera), explanation, layout) for camera in row]
              for row in RIG_LAYOUT]
    rows_h = [max(p.shape[0] for p in row) for row in panels]
    height = margin + header.shape[0] + gap + sum(rows_h) + gap * len(rows_h) + bars.shape[0] + margin
    canvas = np.empty((height, width, 3), np.uint8)
    canvas[:] = BACKGROUND
    canvas[margin:margin + header.shape[0], margin:margin + header.shape[1]] = header
    y = margin + header.shape[0] + gap
    for row, row_h in zip(panels, rows_h):
        for c, panel in enumerate(row):
            x = margin + c * (panel_w + gap)
            canvas[y:y + panel.shape[0], x:x + panel_w] = panel
        y += row_h + gap
    canvas[y:y + bars.shape[0], margin:margin + bars.shape[1]] = bars
    return canvas


def encode_png(rgb: np.ndarray, colours: int = 0) -> bytes:
    """PNG bytes of the picture; `colours` > 0 quantizes it to a palette of that many colours first
    (a docs-sized file: a photo-heavy 1440 px picture is ~2.5 MB in full colour, ~0.6 MB at 256)."""
    if not colours:          # OpenCV's encoder: several times faster than PIL's at the same size
        ok, data = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 3])
        if not ok:
            raise ValueError("PNG encoding of the explanation picture failed")
        return data.tobytes()
    img = Image.fromarray(rgb).quantize(colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=True)
    return out.getvalue()


def encode_jpeg(rgb: np.ndarray, quality: int = 85) -> bytes:
    """JPEG bytes (what the ROS topic sends: a tenth of the PNG's size, decoded anywhere)."""
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise ValueError("JPEG encoding of the explanation picture failed")
    return data.tobytes()


def write_picture(explanation: Explanation, images: dict, out: str | Path, width: int = 1440,
                  colours: int = 0) -> Path:
    out = Path(out)
    out.write_bytes(encode_png(draw_explanation(explanation, images, width), colours))
    return out


def scales_of(explanation: Explanation) -> dict[str, Scale]:
    """One scale per heatmap over all selected cameras (so that cameras compare): 0 to the largest
    value. Token scores of dropped tokens count too (they were scored)."""
    selected = [v for v in explanation.views if v.selected]
    scores = [v.token_scores for v in selected if v.token_scores is not None]
    attention = [v.attention[v.kept] for v in selected if v.attention is not None]
    high_score = max((float(s.max()) for s in scores if s.size), default=0.0)
    high_attention = max((float(a.max()) for a in attention if a.size), default=0.0)
    layers = explanation.attention_layers
    return {
        "score": Scale("score", SCORE_MAP, 0.0, high_score or 1.0,
                       "token selector score: question->token attention of its layer-0 copy (per token)"),
        "attention": Scale("attention", ATTENTION_MAP, 0.0, high_attention or 1.0,
                           f"decoder attention while answering: mean over heads, layers {layers[0]}-{layers[-1]}, "
                           f"{explanation.attention_rows} answer rows (probability per token)"),
    }


# ---------------------------------------------------------------------------------------------- parts
def _fonts(size: int) -> dict:
    path = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return {"text": ImageFont.truetype(str(path / "DejaVuSans.ttf"), size + 2),
            "bold": ImageFont.truetype(str(path / "DejaVuSans-Bold.ttf"), size + 2),
            "small": ImageFont.truetype(str(path / "DejaVuSans.ttf"), size)}


def _wrap(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        trial = f"{line} {word}".strip()
        if line and draw.textlength(trial, font=font) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return lines + [line] if line else lines


def _header(e: Explanation, width: int, fonts: dict) -> np.ndarray:
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_h = fonts["text"].size + 6
    kept = sum(int(v.kept.sum()) for v in e.views if v.selected)
    total = sum(v.kept.size for v in e.views if v.selected)
    ran = (f"view selector: {len(e.cameras)} of {len(e.views)} cameras ({e.view_reason}); token selector: "
           f"{kept} of {total} visual tokens kept; while answering, {100 * e.visual_share:.1f}% of the decoder's "
           f"attention went to visual tokens (the rest to text)")
    blocks = [("Q: ", e.question, QUESTION_COLOUR, fonts["bold"]), ("A: ", e.answer or "(empty)", ANSWER_COLOUR,
                                                                     fonts["bold"]), ("", ran, MUTED, fonts["small"])]
    if e.malformed:
        blocks.append(("", "malformed tags ignored: " + "; ".join(f"{m.text} ({m.reason})" for m in e.malformed),
                       MUTED, fonts["small"]))
    lines = []
    for prefix, text, colour, font in blocks:
        for i, line in enumerate(_wrap(probe, prefix + text, font, width)):
            lines.append((line, colour if prefix else TEXT if font is not fonts["small"] else MUTED, font))
    img = Image.new("RGB", (width, line_h * len(lines) + 4), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for i, (line, colour, font) in enumerate(lines):
        draw.text((0, i * line_h), line, fill=colour, font=font)
    return np.asarray(img)


def heatmap(values: np.ndarray, grid: TokenGrid, scale: Scale, width: int, height: int) -> np.ndarray:
    """Per-token values [tokens] -> RGB [height, width] of the scale's colour map, one block per token
    cell (nearest: the token grid mapped onto the image through the squash resize, TokenGrid)."""
    t = np.clip((np.asarray(values, np.float32) - scale.low) / max(scale.high - scale.low, 1e-12), 0.0, 1.0)
    colours = _lut(scale.colormap)[grid.image((t * 255).astype(np.uint8))]       # [side, tiles*side, 3]
    return cv2.resize(colours, (width, height), interpolation=cv2.INTER_NEAREST)


def heatmap_overlay(photo: np.ndarray, grid: TokenGrid, kept: np.ndarray, scale: Scale, values: np.ndarray,
                    dropped_colour: bool) -> np.ndarray:
    """The heatmap of `values` blended over photo [H, W, 3] uint8. Tokens not `kept`: their colour
    darkened (dropped_colour: they were scored), or the photo darkened without colour (the decoder
    never saw them)."""
    h, w = photo.shape[:2]
    out = cv2.addWeighted(photo, 1 - HEAT_ALPHA, heatmap(values, grid, scale, w, h), HEAT_ALPHA, 0)
    keep = cv2.resize(grid.image(np.asarray(kept, np.uint8)), (w, h), interpolation=cv2.INTER_NEAREST)
    dark = cv2.convertScaleAbs(out if dropped_colour else photo, alpha=DROPPED_SHADE)
    return np.where(keep[:, :, None].astype(bool), out, dark)


@functools.lru_cache(maxsize=8)
def _lut(name: str) -> np.ndarray:
    """A matplotlib colour map as a [256, 3] uint8 table."""
    return (matplotlib.colormaps[name](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)


def _markers(img: np.ndarray, objects: list[tuple[ObjectRef, tuple[int, int, int]]], font) -> np.ndarray:
    """Object markers on one drawn image (tags are in objects.TAG_FRAME, scaled to the image);
    off-image centres are drawn on its border."""
    h, w = img.shape[:2]
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    r = max(6, w // 45)
    for obj, colour in objects:
        x, y = obj.pixel(w, h)                      # the tag's frame -> this drawn image
        x, y = min(max(x, 0), w - 1), min(max(y, 0), h - 1)
        draw.ellipse((x - r - 1, y - r - 1, x + r + 1, y + r + 1), outline=(0, 0, 0), width=5)   # a dark rim
        draw.ellipse((x - r, y - r, x + r, y + r), outline=colour, width=3)
        for dx, dy in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            draw.line((x + dx * r, y + dy * r, x + dx * 2 * r, y + dy * 2 * r), fill=colour, width=3)
        draw.text((x + r + 3, y - 2 * r - font.size // 2), obj.object_id, fill=colour, font=font, stroke_width=3,
                  stroke_fill=(0, 0, 0))
    return np.asarray(pil)


def _status(view: CameraView | None) -> str:
    """What a camera's label says after its name: the view selector's probability and score, and the
    visual tokens kept (or that it was not selected)."""
    if view is None:
        return "not in the rig's options"
    p = "" if view.view_probability is None else f"p {view.view_probability:.2f}  "
    return f"{p}score {view.view_score:.2f}  " + (f"kept {int(view.kept.sum())}/{view.kept.size}" if view.selected
                                                  else "not selected")


@dataclass(frozen=True)
class PanelLayout:
    """What every camera panel of one picture shares."""
    width: int                  # a panel's width in pixels
    cam_h: int                  # the height of each image in it
    fonts: dict                 # _fonts()
    scales: dict                # the picture's colour scales (scales_of)
    one_line: bool = True       # the label on one line; two where the picture is too narrow


def _panel(camera: str, view: CameraView | None, source, e: Explanation, layout: PanelLayout) -> np.ndarray:
    """A camera's label (its name and status on one line, or on two where a narrow picture has no room
    for one), then its image(s): two for a selected camera (token scores above, attention below), one
    dimmed for an unselected one."""
    w, cam_h, fonts, scales, one_line = layout.width, layout.cam_h, layout.fonts, layout.scales, layout.one_line
    selected = view is not None and view.selected
    label_h, inner = (fonts["small"].size + 10) * (1 if one_line else 2), 4
    pil = Image.new("RGB", (w, label_h + cam_h + (cam_h + inner if selected else 0)), BACKGROUND)
    draw = ImageDraw.Draw(pil)
    draw.text((2, 2), camera, fill=TEXT if selected else MUTED, font=fonts["bold"])
    at = (2 + draw.textlength(camera + "  ", font=fonts["bold"]), 4) if one_line else (2, fonts["bold"].size + 8)
    draw.text(at, _status(view), fill=TEXT if selected else MUTED, font=fonts["small"])
    panel = np.asarray(pil).copy()
    if source is None:
        return panel
    photo = np.asarray(load_image(source, camera, (w, cam_h)))         # JPEGs decode at reduced scale
    photo = cv2.resize(photo, (w, cam_h), interpolation=cv2.INTER_AREA)
    objects = [(o, QUESTION_COLOUR) for o in e.question_objects if o.camera == camera] + \
              [(o, ANSWER_COLOUR) for o in e.answer_objects if o.camera == camera]
    if not selected:
        dim = cv2.convertScaleAbs(photo, alpha=UNSELECTED_SHADE)
        panel[label_h:label_h + cam_h] = _markers(dim, objects, fonts["small"])
        return panel
    grid = e.grid
    if view.token_scores is not None:
        upper = heatmap_overlay(photo, grid, view.kept, scales["score"], view.token_scores, dropped_colour=True)
    else:     # no token selector ran: every token kept, nothing scored
        upper = photo
    lower = heatmap_overlay(photo, grid, view.kept, scales["attention"], view.attention, dropped_colour=False)
    panel[label_h:label_h + cam_h] = _markers(upper, objects, fonts["small"])
    panel[label_h + cam_h + inner:] = _markers(lower, objects, fonts["small"])
    return panel


def _colour_bars(scales: dict, width: int, fonts: dict) -> np.ndarray:
    """The two colour scales side by side (what the colours of the upper and lower images mean, with
    their range in numbers), then the legend of the markers and shades."""
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    half, bar_h, small = width // 2 - 20, 14, fonts["small"]
    line_h = small.size + 4
    titles = [_wrap(probe, ("Upper images: " if s.name == "score" else "Lower images: ") + s.label, small, half)
              for s in (scales["score"], scales["attention"])]
    block_h = max(len(t) for t in titles) * line_h + bar_h + line_h + 6
    legend = ["p: the view selector's probability for the camera; score: fused with its keyword map (what was "
              "thresholded). Darkened tokens: dropped by the token selector; dimmed camera: not selected.",
              "Markers: objects tagged in the question (cyan) and in the answer (magenta), at their pixel centre."]
    legend_lines = [line for text in legend for line in _wrap(probe, text, small, width)]
    img = Image.new("RGB", (width, block_h + 6 + line_h * len(legend_lines)), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for i, (scale, title) in enumerate(zip((scales["score"], scales["attention"]), titles)):
        x = i * (half + 40)
        for j, line in enumerate(title):
            draw.text((x, j * line_h), line, fill=TEXT, font=small)
        y = len(title) * line_h + 2
        strip = np.repeat(_lut(scale.colormap)[np.linspace(0, 255, half).astype(int)][None], bar_h, axis=0)
        img.paste(Image.fromarray(strip), (x, y))
        for frac in (0.0, 0.5, 1.0):
            tick = f"{scale.low + frac * (scale.high - scale.low):.3g}"
            tx = x + frac * half - frac * draw.textlength(tick, font=small)
            draw.text((tx, y + bar_h + 2), tick, fill=TEXT, font=small)
    for j, line in enumerate(legend_lines):
        draw.text((0, block_h + 6 + j * line_h), line, fill=MUTED, font=small)
    return np.asarray(img)
