"""The data of `litevlm train vlm`: DriveLM-format key frames with their six images and QA (read by
evaluation.data, the one DriveLM reader), QA encoded exactly as the pipeline builds its prompts, the
decoded-tile cache, and how QA are grouped into frames and view subsets per step.

Frame sets over time: a QA item with "frames": K (a motion question, docs/motion.md) is trained on
the prompt the pipeline builds for it, each camera's K frame sets oldest first (stages/prompt.py);
its frame's earlier sets are found as the evaluation finds them (evaluation.data
.frame_images_over_time) and cached like the key frame's. A group of QA sharing one prompt prefix
is keyed by its frame, its cameras and its frame sets (`group_of`)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..cameras import CAMERAS
from ..errors import InputError
from ..evaluation import data as drivelm
from ..evaluation.metrics import ACCURACY, derive_tags
from ..stages.preprocess import Normalizer, load_image, to_tiles_uint8
from ..stages.prompt import build_prompt
from ..stages.temporal import token_change
from ..weights.tokenizer import Tokenizer

# The prompt layout a model trained from scratch gets: camera names label the images, so a subset of
# cameras (the view selector's) still says which camera each image is.
SCRATCH_LAYOUT = "cameras"


@dataclass
class QA:
    question: str
    answer: str
    category: str
    frames: int = 1               # frame sets its answer is defined over (the item's "frames"; 1: the key frame)


@dataclass
class Frame:
    key: str                      # "scene/frame"
    images: dict[str, Path]       # camera -> image file
    qa: list[QA] = field(default_factory=list)
    past: list[dict[str, Path]] = field(default_factory=list)   # earlier frame sets, oldest first (K-frame QA)


def load_frames(data: Path, frames_root: Path) -> list[Frame]:
    """The key frames of a DriveLM file that have QA (read by evaluation.data, the one DriveLM
    reader), with their six image files resolved under `frames_root`, and the earlier frame sets
    their longest-spanning QA needs (the scene's sets just before the key frame, as evaluation
    finds them)."""
    frames: list[Frame] = []
    for f in drivelm.load_frames(data):
        qa = [QA(q.question.strip(), q.answer.strip(), q.category, q.frames) for q in f.questions]
        if qa:
            k = max(x.frames for x in qa)
            past = [s.paths for s in drivelm.frame_images_over_time(frames_root, f, k, None)[:-1]] if k > 1 else []
            frames.append(Frame(f"{f.scene}/{f.token}", drivelm.frame_images(frames_root, f), qa, past))
    if not frames:
        raise InputError(f"{data}: no key frame with QA")
    return frames


def is_closed_form(question: str, answer: str) -> bool:
    """Choice and yes/no questions: scored by exact-match accuracy, as `litevlm eval` does."""
    return derive_tags(question, answer) == (ACCURACY,)


@dataclass
class Encoded:
    prompt: list[int]                   # Pipeline.prompt_ids: template, <IMG_CONTEXT> placeholders, question
    spans: list[tuple[int, int]]        # (start, count) of each view's visual tokens in `prompt` (camera, frame)
    answer: list[int]                   # answer tokens followed by <|im_end|>
    qa: QA | None = None                # the source, to re-encode it with another camera subset
    frames: int = 1                     # frame sets per camera in `prompt` (the spans: camera by camera)


def encode_qa(tok: Tokenizer, system: str, tokens_per_camera: int, qa: QA,
              cameras: tuple[str, ...] = CAMERAS, layout: str = SCRATCH_LAYOUT) -> Encoded:
    """A QA on these cameras, over the frame sets its answer needs (qa.frames)."""
    prompt = build_prompt(tok, system, layout, cameras, qa.question, tokens_per_camera, frames=qa.frames)
    return Encoded(list(prompt.input_ids), list(prompt.image_spans), tok.encode(qa.answer) + [tok.im_end_id], qa,
                   qa.frames)


# A group's key: a frame index (all six cameras, the key frame), (frame index, camera indices) for a
# subset, or (frame index, camera indices, frame sets) over time.
ALL_CAMERAS = tuple(range(len(CAMERAS)))


def group_of(key) -> tuple[int, tuple[int, ...], int]:
    """(frame index, camera indices, frame sets per camera) of a group key."""
    if isinstance(key, int):
        return key, ALL_CAMERAS, 1
    return (key[0], key[1], 1) if len(key) == 2 else key


def frame_and_cameras(key) -> tuple[int, tuple[int, ...]]:
    return group_of(key)[:2]


class TileCache:
    """uint8 tiles [frames, cameras * tiles_per_camera, 3, S, S], each frame decoded and resized once,
    on first use, with the pipeline's preprocessing (so a training tile equals what
    `Pipeline.preprocess` produces). Filled lazily: a run shorter than an epoch decodes only the
    frames it sees, and decoding is spread over the run instead of stalling its start."""

    def __init__(self, frames: list[Frame], tile: int, tiles_per_camera: int = 1):
        self.frames, self.tile, self.tiles_per_camera = frames, tile, tiles_per_camera
        n = len(CAMERAS) * tiles_per_camera
        self.tiles = torch.empty(len(frames), n, 3, tile, tile, dtype=torch.uint8)
        self.filled = [False] * len(frames)
        self.past: dict[tuple[int, int], torch.Tensor] = {}   # (frame, index in Frame.past) -> its tiles

    def _decode(self, images: dict[str, Path], out: torch.Tensor) -> None:
        tpc, s = self.tiles_per_camera, self.tile
        for j, cam in enumerate(CAMERAS):
            img = load_image(images[cam], cam, (s * tpc, s))
            to_tiles_uint8(img, s, tpc, out[j * tpc:(j + 1) * tpc])

    def _fill(self, i: int) -> None:
        self._decode(self.frames[i].images, self.tiles[i])
        self.filled[i] = True

    def frame_tiles(self, i: int, back: int = 0) -> torch.Tensor:
        """[cameras * tiles_per_camera, 3, S, S] of frame i's key set (back 0) or of the set `back`
        steps before it."""
        if back == 0:
            if not self.filled[i]:
                self._fill(i)
            return self.tiles[i]
        j = len(self.frames[i].past) - back
        if j < 0:
            raise InputError(f"frame {self.frames[i].key}: no frame set {back} steps before the key frame "
                             f"({len(self.frames[i].past)} found)")
        if (i, j) not in self.past:
            self.past[(i, j)] = torch.empty_like(self.tiles[i])
            self._decode(self.frames[i].past[j], self.past[(i, j)])
        return self.past[(i, j)]

    def fill_all(self, threads: int, progress=None) -> None:
        """Decode every frame now, on `threads` threads (the GPU path: decoding ahead of the steps)."""
        todo = [i for i in range(len(self.frames)) if not self.filled[i]]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for n, _ in enumerate(pool.map(self._fill, todo), 1):
                if progress and (n % 2000 == 0 or n == len(todo)):
                    progress(n, len(todo))

    def batch(self, keys: list) -> torch.Tensor:
        """[sum of each key's views * tiles_per_camera, 3, S, S] uint8, in prompt order: a key is a
        frame index (all cameras), (frame index, camera indices), or (frame index, camera indices,
        frame sets): each camera's sets oldest first, the key frame's last."""
        parts = []
        tpc = self.tiles_per_camera
        for key in keys:
            i, cams, frames = group_of(key)
            if frames == 1 and cams == ALL_CAMERAS:
                parts.append(self.frame_tiles(i))
                continue
            by_step = [self.frame_tiles(i, back).view(len(CAMERAS), tpc, *self.tiles.shape[2:])
                       for back in range(frames - 1, -1, -1)]             # oldest first
            parts.append(torch.stack([by_step[t][c] for c in cams for t in range(frames)]).flatten(0, 1))
        return torch.cat(parts)

    def key_tiles(self, keys: list) -> list[int]:
        """Indices into `batch(keys)` of the key frame's tiles (what the vision labels describe)."""
        out, n, tpc = [], 0, self.tiles_per_camera
        for key in keys:
            _, cams, frames = group_of(key)
            for c in range(len(cams)):
                first = n + (c * frames + frames - 1) * tpc
                out += range(first, first + tpc)
            n += len(cams) * frames * tpc
        return out


class VisionFeatureCache:
    """`--freeze-vision`: the frozen vision side's visual tokens per frame set (InternViT, pixel
    shuffle, mlp1: what the pipeline's feature cache holds), computed once on first use and kept
    on the CPU; each step then runs the decoder only, and temporal token selection is decided on
    them before the step (`dropped`: the rows pack() leaves out). Decoding goes through the
    TileCache's own decoding (the pipeline's preprocessing), without keeping the pixels."""

    def __init__(self, tiles: TileCache, model, normalize: Normalizer, device: torch.device):
        self.tiles, self.model, self.normalize, self.device = tiles, model, normalize, device
        self.store: dict[tuple[int, int], torch.Tensor] = {}   # (frame, steps back) -> [tiles, tokens, D]

    def frame_features(self, i: int, back: int = 0) -> torch.Tensor:
        if (i, back) not in self.store:
            frame = self.tiles.frames[i]
            images = frame.images if back == 0 else frame.past[len(frame.past) - back]
            pixels = torch.empty_like(self.tiles.tiles[0])
            self.tiles._decode(images, pixels)
            with torch.no_grad():
                visual = self.model.encode_images(self.normalize(pixels.to(self.device)))
            self.store[(i, back)] = visual.to("cpu", torch.float32)
        return self.store[(i, back)]

    def batch(self, keys: list, device: torch.device | None = None) -> torch.Tensor:
        """[views * tiles_per_camera, tokens, D] float32, in TileCache.batch's order."""
        parts, tpc = [], self.tiles.tiles_per_camera
        for key in keys:
            i, cams, frames = group_of(key)
            by_step = [self.frame_features(i, back).view(len(CAMERAS), tpc, *self.store[(i, back)].shape[1:])
                       for back in range(frames - 1, -1, -1)]
            parts.append(torch.stack([by_step[t][c] for c in cams for t in range(frames)]).flatten(0, 1))
        return torch.cat(parts).to(device or self.device, non_blocking=True)

    def dropped(self, groups: list[tuple[object, list[Encoded]]], threshold: float) -> list[set[int]]:
        """Per group, the prompt rows of older frame sets' visual tokens that did not change against
        the newest set's at the same camera and position (stages/temporal.py): what the pipeline
        leaves out before prefill."""
        out = []
        for key, items in groups:
            gone: set[int] = set()
            k = items[0].frames
            if k > 1 and threshold > 0:
                visual = self.batch([key], torch.device("cpu"))          # [views * tiles, tokens, D]
                spans = items[0].spans
                views = visual.view(len(spans), -1, visual.shape[-1])
                for c in range(0, len(spans), k):
                    for t in range(c, c + k - 1):
                        start = spans[t][0]
                        same = (token_change(views[t], views[c + k - 1]) < threshold).nonzero().flatten()
                        gone.update(start + int(j) for j in same)
            out.append(gone)
        return out


def pixels_for(cache: TileCache, frames: list, normalize: Normalizer,
               device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Normalised float32 pixels on `device` (the uint8 tiles travel, a quarter of the bytes)."""
    return normalize(cache.batch(frames).to(device, non_blocking=True))


def split_by_views(groups: list[tuple[int, list[Encoded]]], select, fraction: float, rng: np.random.Generator,
                   encode) -> list[tuple[object, list[Encoded]]]:
    """Each QA goes, with probability `fraction`, to a prompt with only the cameras `select(question)`
    returns (what the LiteVLM pipeline will show the model) instead of all six; QA of one frame
    with the same subset share one prefix tree. Training on both keeps the six-camera prompt and
    puts the view selector's prompts in distribution. A QA over several frame sets always gets
    the selected cameras (what the LiteVLM pipeline shows a motion question; six cameras x K sets
    is K times the prompt) and a group of its own (its prompt differs from the first camera on).
    `select` None: every camera."""
    out: list[tuple[object, list[Encoded]]] = []
    for frame, items in groups:
        full, subsets = [], {}
        for e in items:
            timed = e.frames > 1
            chosen = select is not None and (timed or rng.random() < fraction)
            cams = tuple(CAMERAS.index(c) for c in select(e.qa.question)) if chosen else ALL_CAMERAS
            if cams == ALL_CAMERAS and not timed:
                full.append(e)
            else:
                same = cams == ALL_CAMERAS
                subsets.setdefault((cams, e.frames), []).append(e if same else encode(e.qa, tuple(CAMERAS[i]
                                                                                                  for i in cams)))
        if full:
            out.append((frame, full))
        out += [((frame, cams) if k == 1 else (frame, cams, k), subset) for (cams, k), subset in subsets.items()]
    return out


def prefetch(items, depth: int):
    """Iterate `items` (a generator) while a thread runs up to `depth` items ahead. Packing is
    Python on the CPU; while a GPU step runs, the main thread waits on CUDA with the GIL released,
    so the next steps are packed meanwhile. One producer keeps the order (and the random draws)."""
    ready: queue.Queue = queue.Queue(depth)

    def produce():
        try:
            for item in items:
                ready.put(item)
        except BaseException as exc:       # surfaces in the training loop, not lost on the thread
            ready.put(exc)

    threading.Thread(target=produce, daemon=True, name="pack-ahead").start()
    while True:
        item = ready.get()
        if isinstance(item, BaseException):
            raise item
        yield item


def epoch_groups(frames: list[list[Encoded]], per_group: int, rng: np.random.Generator,
                 per_visit: int = 0, time_share: float = 0.0) -> list[tuple[int, list[Encoded]]]:
    """One pass over the frames in random order, as groups of at most `per_group` questions of one
    frame: every QA once, or (per_visit > 0) only that many random QA of each frame, so that more
    distinct images are seen for the same compute (later passes draw other questions); with
    `time_share`, that share of a visit's QA (as many as there are) are QA over several frame
    sets, the rest single-frame ones. The QA of a frame are grouped before they are split by
    views: split_by_views separates prompts that differ."""
    groups = []
    for f, items in enumerate(frames):
        order = rng.permutation(len(items))
        if per_visit and time_share:
            timed = [j for j in order if items[j].frames > 1]
            still = [j for j in order if items[j].frames == 1]
            n_timed = min(len(timed), int(round(time_share * per_visit)))
            order = np.array(timed[:n_timed] + still[:per_visit - n_timed], dtype=np.int64)
        elif per_visit:
            order = order[:per_visit]
        for i in range(0, len(order), per_group):
            groups.append((f, [items[j] for j in order[i:i + per_group]]))
    return [groups[i] for i in rng.permutation(len(groups))]
