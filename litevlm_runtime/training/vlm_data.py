"""The data of `litevlm train vlm`: DriveLM-format key frames with their six images and QA (read by
evaluation.data, the one DriveLM reader), QA encoded exactly as the pipeline builds its prompts, the
decoded-tile cache, and how QA are grouped into frames and view subsets per step."""

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
from ..weights.tokenizer import Tokenizer

# The prompt layout a model trained from scratch gets: camera names label the images, so a subset of
# cameras (the view selector's) still says which camera each image is.
SCRATCH_LAYOUT = "cameras"


@dataclass
class QA:
    question: str
    answer: str
    category: str


@dataclass
class Frame:
    key: str                      # "scene/frame"
    images: dict[str, Path]       # camera -> image file
    qa: list[QA] = field(default_factory=list)


def load_frames(data: Path, frames_root: Path) -> list[Frame]:
    """The key frames of a DriveLM file that have QA (read by evaluation.data, the one DriveLM
    reader), with their six image files resolved under `frames_root`."""
    frames: list[Frame] = []
    for f in drivelm.load_frames(data):
        qa = [QA(q.question.strip(), q.answer.strip(), q.category) for q in f.questions]
        if qa:
            frames.append(Frame(f"{f.scene}/{f.token}", drivelm.frame_images(frames_root, f), qa))
    if not frames:
        raise InputError(f"{data}: no key frame with QA")
    return frames


def is_closed_form(question: str, answer: str) -> bool:
    """Choice and yes/no questions: scored by exact-match accuracy, as `litevlm eval` does."""
    return derive_tags(question, answer) == (ACCURACY,)


@dataclass
class Encoded:
    prompt: list[int]                   # Pipeline.prompt_ids: template, <IMG_CONTEXT> placeholders, question
    spans: list[tuple[int, int]]        # (start, count) of each camera's visual tokens in `prompt`
    answer: list[int]                   # answer tokens followed by <|im_end|>
    qa: QA | None = None                # the source, to re-encode it with another camera subset


def encode_qa(tok: Tokenizer, system: str, tokens_per_camera: int, qa: QA,
              cameras: tuple[str, ...] = CAMERAS, layout: str = SCRATCH_LAYOUT) -> Encoded:
    prompt = build_prompt(tok, system, layout, cameras, qa.question, tokens_per_camera)
    return Encoded(list(prompt.input_ids), list(prompt.image_spans), tok.encode(qa.answer) + [tok.im_end_id], qa)


# A group's key: a frame index (all six cameras) or (frame index, camera indices) for a subset.
ALL_CAMERAS = tuple(range(len(CAMERAS)))


def frame_and_cameras(key) -> tuple[int, tuple[int, ...]]:
    return (key, ALL_CAMERAS) if isinstance(key, int) else key


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

    def _fill(self, i: int) -> None:
        tpc, s = self.tiles_per_camera, self.tile
        for j, cam in enumerate(CAMERAS):
            img = load_image(self.frames[i].images[cam], cam, (s * tpc, s))
            to_tiles_uint8(img, s, tpc, self.tiles[i, j * tpc:(j + 1) * tpc])
        self.filled[i] = True

    def fill_all(self, threads: int, progress=None) -> None:
        """Decode every frame now, on `threads` threads (the GPU path: decoding ahead of the steps)."""
        todo = [i for i in range(len(self.frames)) if not self.filled[i]]
        with ThreadPoolExecutor(max(1, threads)) as pool:
            for n, _ in enumerate(pool.map(self._fill, todo), 1):
                if progress and (n % 2000 == 0 or n == len(todo)):
                    progress(n, len(todo))

    def batch(self, keys: list) -> torch.Tensor:
        """[sum of each key's cameras * tiles_per_camera, 3, S, S] uint8; a key is a frame index
        (all cameras) or (frame index, camera indices)."""
        parts = []
        tpc = self.tiles_per_camera
        for key in keys:
            i, cams = frame_and_cameras(key)
            if not self.filled[i]:
                self._fill(i)
            if cams == ALL_CAMERAS:
                parts.append(self.tiles[i])
            else:
                parts.append(self.tiles[i].view(len(CAMERAS), tpc, *self.tiles.shape[2:])[list(cams)].flatten(0, 1))
        return torch.cat(parts)


def pixels_for(cache: TileCache, frames: list, normalize: Normalizer,
               device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Normalised float32 pixels on `device` (the uint8 tiles travel, a quarter of the bytes)."""
    return normalize(cache.batch(frames).to(device, non_blocking=True))


def split_by_views(groups: list[tuple[int, list[Encoded]]], select, fraction: float, rng: np.random.Generator,
                   encode) -> list[tuple[object, list[Encoded]]]:
    """Each QA goes, with probability `fraction`, to a prompt with only the cameras `select(question)`
    returns (what the LiteVLM pipeline will show the model) instead of all six; QA of one frame
    with the same subset share one prefix tree. Training on both keeps the six-camera prompt and
    puts the view selector's prompts in distribution."""
    out: list[tuple[object, list[Encoded]]] = []
    for frame, items in groups:
        full, subsets = [], {}
        for e in items:
            cams = tuple(CAMERAS.index(c) for c in select(e.qa.question)) if rng.random() < fraction else ALL_CAMERAS
            if cams == ALL_CAMERAS:
                full.append(e)
            else:
                subsets.setdefault(cams, []).append(encode(e.qa, tuple(CAMERAS[i] for i in cams)))
        if full:
            out.append((frame, full))
        out += [((frame, cams), subset) for cams, subset in subsets.items()]
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
                 per_visit: int = 0) -> list[tuple[int, list[Encoded]]]:
    """One pass over the frames in random order, as groups of at most `per_group` questions of one
    frame: every QA once, or (per_visit > 0) only that many random QA of each frame, so that more
    distinct images are seen for the same compute (later passes draw other questions)."""
    groups = []
    for f, items in enumerate(frames):
        order = rng.permutation(len(items))
        if per_visit:
            order = order[:per_visit]
        for i in range(0, len(order), per_group):
            groups.append((f, [items[j] for j in order[i:i + per_group]]))
    return [groups[i] for i in rng.permutation(len(groups))]
