"""`litevlm train vlm`: train an InternVL2.5-layout model (InternViT + mlp1 + InternLM2) from
scratch on DriveLM-format QA (SynthDrive), and write it as a checkpoint the pipeline loads.

    litevlm train vlm --data TRAIN.json --frames ROOT --out DIR [--val VAL.json] [--preset bundled]
    torchrun --nproc_per_node=N -m litevlm_runtime.cli train vlm ...   # same command, DDP (gloo on CPU)

Train and inference see the same inputs bit for bit: every frame is decoded and resized with the
pipeline's own `load_image` / `to_tiles_uint8` / `Normalizer`, and every prompt is built with the
pipeline's `prompt.build_prompt` in the model's prompt layout (so its token ids equal
`Pipeline.prompt_ids`): `cameras` for a model trained from scratch, --init's own layout when training
continues from a checkpoint; the layout is recorded in the output folder's litevlm.json. The loss
is the cross-entropy of the answer tokens and the `<|im_end|>` that stops generation.

Packing. A key frame carries many questions about the same six images, and the prompt up to the
question (system, six `<img>` blocks of visual tokens) is identical for all of them. So one training
sequence is a tree: the shared prefix once, then each question+answer as its own branch, attending
to the prefix and causally to itself, with the position ids it would have on its own. Several such
trees are packed side by side under a block-diagonal mask. The decoder's forward already takes
explicit positions, cache slots and a boolean mask (the same machinery EAGLE-2 tree verification
uses), so this needs no model change, and every branch's logits equal those of that sample run
alone (tests/test_train_vlm.py checks the loss against per-sample runs in float64). It saves the
vision encoder and the prefix of the decoder for all but one question per frame.

Frames repeat across questions and epochs: each camera's uint8 tile is decoded and resized once
and cached; only the float normalisation runs per step.

Devices. `--device auto` trains on a GPU where torch sees one (bf16 autocast, NCCL between
ranks), else on the CPU (float32, gloo). On a GPU the frames are decoded up front by a pool of
threads (PIL releases the GIL while decoding and resizing), since the GPU steps outrun one
decoding thread; packing stays on the CPU and only the packed tensors travel. `--time-budget`
fixes the training time instead of the step count: the learning-rate schedule then runs on the
fraction of the budget spent (the one way to size a run for a machine whose speed is not known
in advance, such as a lent GPU), and the record states the steps it took.

`--init DIR --decoder-layers N` grows a trained checkpoint's decoder to N layers: new layers,
interleaved after the trained ones, start as exact identities (zeroed output projections), so
training continues from the same logits (`grow_decoder`). `--save-dtype bfloat16` writes the
weights in bf16 (half the size; training keeps float32 masters, the loader reads either).

Two options serve the LiteVLM pipeline and the vision tower:
- `--view-selector DIR`: a fraction of the QA is trained on the prompt the LiteVLM pipeline will
  build, with only the cameras the (text-only) view selector picks for the question. A model
  trained on six-camera prompts alone answers worse when shown fewer cameras.
- `--vision-labels ground_truth.json`: a linear probe on every visual token learns what SynthDrive
  drew in that token's cell (`vision_labels.py`), a direct signal for the vision tower.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import queue
import shlex
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..cameras import CAMERAS
from ..weights.checkpoint import load_model, write_checkpoint
from ..commands.make_checkpoint import init_weights
from ..errors import InputError
from ..weights.integrity import sha256_file
from ..evaluation.metrics import ACCURACY, derive_tags
from ..models.internvl import InternVL
from ..stages.preprocess import Normalizer, load_image, to_tiles_uint8
from ..weights.presets import PRESETS, preset
from ..stages.prompt import build_prompt, model_layout, write_layout
from ..weights.tokenizer import Tokenizer, train_bpe_tokenizer
from .distributed import setup, threads_per_rank
from .vision_labels import LABELS, VisionProbe, load_vision_labels

CATEGORIES = ("perception", "prediction", "planning", "behavior")
RECORD_FILE = "training_record.json"
# The prompt layout a model trained from scratch gets: camera names label the images, so a subset of
# cameras (the view selector's) still says which camera each image is.
SCRATCH_LAYOUT = "cameras"


# ---------------------------------------------------------------------------------------------
# Data: DriveLM v1.1 files -> key frames with their six image paths and QA
# ---------------------------------------------------------------------------------------------


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


def resolve_image(root: Path, rel: str, camera: str) -> Path:
    """An `image_paths` entry -> a file under `root`.

    DriveLM paths are relative to its data root (`../nuscenes/samples/CAM_X/file.jpg`); SynthDrive
    writes paths relative to its output folder. Try the path as given, then with leading `..`
    parts dropped, then `samples/CAM_X/<name>` and `CAM_X/<name>` under the root.
    """
    rel_path = Path(rel)
    parts = [p for p in rel_path.parts if p not in ("..", ".")]
    candidates = [root / rel_path, root / Path(*parts) if parts else root,
                  root / "samples" / camera / rel_path.name, root / camera / rel_path.name]
    if len(parts) > 1:
        candidates.insert(2, root / Path(*parts[1:]))
    for c in candidates:
        if c.is_file():
            return c
    raise InputError(f"image {rel!r} for {camera} not found under {root}")


def load_frames(data: Path, frames_root: Path) -> list[Frame]:
    try:
        doc = json.loads(Path(data).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{data}: cannot read DriveLM JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise InputError(f"{data}: expected a DriveLM object {{scene: {{key_frames: ...}}}}")
    frames: list[Frame] = []
    for scene, scene_data in doc.items():
        key_frames = scene_data.get("key_frames") if isinstance(scene_data, dict) else None
        if not isinstance(key_frames, dict):
            raise InputError(f"{data}: scene {scene!r} has no 'key_frames' object (not DriveLM layout)")
        for frame_id, fd in key_frames.items():
            paths = fd.get("image_paths") or {}
            missing = [c for c in CAMERAS if c not in paths]
            if missing:
                raise InputError(f"{data}: frame {frame_id!r} lacks image_paths for {missing}")
            frame = Frame(f"{scene}/{frame_id}", {c: resolve_image(frames_root, paths[c], c) for c in CAMERAS})
            for category in CATEGORIES:
                for item in fd.get("QA", {}).get(category, []):
                    frame.qa.append(QA(str(item["Q"]).strip(), str(item["A"]).strip(), category))
            if frame.qa:
                frames.append(frame)
    if not frames:
        raise InputError(f"{data}: no key frame with QA")
    return frames


def with_tile_size(cfg, tile: int, keep_position_grid: bool):
    """The config with another tile size (`--tile-size`). Continuing from a checkpoint
    (keep_position_grid), the vision tower keeps its stored position-embedding grid and the model
    interpolates it to the new patch grid (bicubic, as InternViT does for any tile size it was not
    trained at): fine-tuning at a higher resolution starts from the lower-resolution weights."""
    patch = cfg.vision.patch_size
    side = tile // patch
    if tile % patch or side * cfg.downsample_ratio != int(side * cfg.downsample_ratio):
        raise InputError(f"--tile-size {tile}: must be a multiple of {int(patch / cfg.downsample_ratio)} "
                         f"(patch {patch}, pixel shuffle {cfg.downsample_ratio})")
    vision = cfg.vision if keep_position_grid else replace(cfg.vision, image_size=tile)
    return replace(cfg, vision=vision, force_image_size=tile)


def with_decoder_layers(cfg, layers: int):
    """The config with another decoder depth (`--decoder-layers`)."""
    if layers < 1:
        raise InputError(f"--decoder-layers {layers}: at least 1")
    return replace(cfg, llm=replace(cfg.llm, num_hidden_layers=layers))


def grown_layer_positions(old: int, new: int) -> list[int]:
    """Where the `old` trained layers go in a stack of `new`: spread out, the first one first, the
    new layers between and after them (3 -> 12: 0, 4, 8)."""
    return [i * new // old for i in range(old)]


def grow_decoder(model: InternVL, layers: int, seed: int) -> InternVL:
    """The same model with `layers` decoder layers: the trained layers keep their order, and new
    layers are interleaved after them that start as exact identities, so the grown model computes
    the same logits as the original before any training.

    Each new layer's residual branches end in zeroed output projections (attention `wo`,
    feed-forward `w2`; Qwen2's `o_proj`, `down_proj`), the rest is freshly initialised like a
    from-scratch layer. Why these choices:
    - zero out-projections (as LLaMA Pro's block expansion and zero-init residual branches do):
      the residual stream passes through unchanged, and the out-projections still get gradients
      (their inputs are non-zero), so the layer leaves the identity at the first step;
    - fresh inner weights rather than copies of a neighbour: several new layers follow each
      trained one, and copies of one layer would receive near-identical updates for a long time;
    - interleaved rather than appended: every depth of the residual stream gets new capacity
      (LLaMA Pro found interleaving better than stacking on top), and layer 0 stays layer 0, the
      layer the token selector is a copy of."""
    old = model.cfg.llm.num_hidden_layers
    if layers < old:
        raise InputError(f"--decoder-layers {layers}: the --init model has {old} decoder layers; "
                         "growing adds layers, it cannot remove trained ones")
    if layers == old:
        return model
    rope = getattr(model.language_model, "rope", None)      # the source's RoPE table size, if it has one
    grown = InternVL(with_decoder_layers(model.cfg, layers), max_len=None if rope is None else rope.cos.shape[0]) \
        .to(next(model.parameters()).dtype)
    init_weights(grown, seed)
    src, dst = model.language_model, grown.language_model
    keep = grown_layer_positions(old, layers)
    stack = next(name for name, m in model.named_modules() if m is src.layers) + "."
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not name.startswith(stack):          # vision tower, projector, embeddings, norm, head
                grown.state_dict()[name].copy_(t)
        for i, j in enumerate(keep):
            dst.layers[j].load_state_dict(src.layers[i].state_dict())
        for j in set(range(layers)) - set(keep):
            dst.layers[j].out_proj.weight.zero_()
            dst.layers[j].mlp_gate_up_down()[2].weight.zero_()
    return grown.train(model.training)


def is_closed_form(question: str, answer: str) -> bool:
    """Choice and yes/no questions: scored by exact-match accuracy, as `litevlm eval` does."""
    return derive_tags(question, answer) == (ACCURACY,)


# ---------------------------------------------------------------------------------------------
# Encoding: prompts exactly as Pipeline.prompt_ids builds them, answers + <|im_end|>
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Packing: prefix trees side by side under one boolean mask
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedBatch:
    ids: torch.Tensor            # [T] token ids (<IMG_CONTEXT> where visual tokens go)
    positions: torch.Tensor      # [T] RoPE positions, as each sample would have them alone
    mask: torch.Tensor           # [T, T] bool, True = may attend
    visual_rows: torch.Tensor    # [V] rows receiving visual tokens, ordered group, camera, token
    target_rows: torch.Tensor    # [N] rows whose next token is an answer token (or <|im_end|>)
    targets: torch.Tensor        # [N] those next tokens
    weights: torch.Tensor        # [N] loss weight of each target (1, or 1/answer length per sample)
    frames: list                 # each group's key, frame index or (frame, cameras) (order of the visual tokens)
    samples: int                 # QA count

    def to(self, device: torch.device) -> "PackedBatch":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PackedBatch(move(self.ids), move(self.positions), move(self.mask), move(self.visual_rows),
                           move(self.target_rows), move(self.targets), move(self.weights), self.frames, self.samples)


def common_prefix_len(seqs: list[list[int]]) -> int:
    # Vectorised: prompts are hundreds of tokens and packing runs on the CPU ahead of every step
    # (a token-by-token loop here was most of a GPU step's time).
    n = min(len(s) for s in seqs)
    first = np.asarray(seqs[0][:n])
    for s in seqs[1:]:
        differ = np.flatnonzero(first[:n] != np.asarray(s[:n]))
        if differ.size:
            n = int(differ[0])
    return n


def pack(groups: list[tuple[int, list[Encoded]]], per_sample: bool = False) -> PackedBatch:
    """groups: (frame index, encoded QA of that frame). One prefix tree per group.

    per_sample: weight each target by 1/(its answer's length), so that every QA counts the same
    in the loss (a one-token "Yes." as much as a 40-token description) instead of every token."""
    ids: list[int] = []
    pos: list[int] = []
    visual_rows: list[int] = []
    target_rows: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    blocks: list[tuple[int, int, list[int]]] = []
    for _, items in groups:
        # Each branch keeps at least its last prompt token: its logits predict the first answer token.
        shared = min(common_prefix_len([e.prompt for e in items]), min(len(e.prompt) for e in items) - 1)
        off = len(ids)
        for start, count in items[0].spans:
            if start + count > shared:
                raise ValueError("visual tokens must lie in the shared prefix")
            visual_rows.extend(range(off + start, off + start + count))
        ids += items[0].prompt[:shared]
        pos += range(shared)
        lengths = []
        for e in items:
            branch = e.prompt[shared:] + e.answer
            base = len(ids)
            first = len(e.prompt) - shared - 1          # branch index of the last prompt token
            for j in range(first, len(branch) - 1):
                target_rows.append(base + j)
                targets.append(branch[j + 1])
                weights.append(1.0 / len(e.answer) if per_sample else 1.0)
            ids += branch
            pos += range(shared, shared + len(branch))
            lengths.append(len(branch))
        blocks.append((off, shared, lengths))
    t = len(ids)
    mask = torch.zeros(t, t, dtype=torch.bool)
    for off, shared, lengths in blocks:
        mask[off:off + shared, off:off + shared] = torch.ones(shared, shared, dtype=torch.bool).tril()
        b = off + shared
        for n in lengths:
            mask[b:b + n, off:off + shared] = True
            mask[b:b + n, b:b + n] = torch.ones(n, n, dtype=torch.bool).tril()
            b += n
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return PackedBatch(as_long(ids), as_long(pos), mask, as_long(visual_rows), as_long(target_rows),
                       as_long(targets), torch.tensor(weights, dtype=torch.float64), [f for f, _ in groups], sum(len(items) for _, items in groups))


def split_into_sequences(groups: list[tuple[int, list[Encoded]]], max_tokens: int) -> list[list[tuple[int, list[Encoded]]]]:
    """Consecutive groups packed greedily into sequences of at most max_tokens (a group longer than
    that is split into several groups of the same frame)."""
    pieces = []                   # (frame, QA, the length pack() gives them)
    for frame, items in groups:
        # The packed length, kept up to date as QA join the group: the shared prefix once, plus
        # each branch (prompt beyond the prefix, answer) = all prompts and answers - (k-1) * shared.
        part: list[Encoded] = []
        shared = whole = 0
        for e in items:
            if part:
                s = min(shared, common_prefix_len([part[0].prompt, e.prompt]), len(e.prompt) - 1)
                if whole + len(e.prompt) + len(e.answer) - len(part) * s > max_tokens:
                    pieces.append((frame, part, whole - (len(part) - 1) * shared))
                    part = []
                else:
                    shared = s
            if not part:
                shared = len(e.prompt) - 1
                whole = 0
            part.append(e)
            whole += len(e.prompt) + len(e.answer)
        pieces.append((frame, part, whole - (len(part) - 1) * shared))
    sequences, current, used = [], [], 0
    for frame, items, n in pieces:
        if current and used + n > max_tokens:
            sequences.append(current)
            current, used = [], 0
        current.append((frame, items))
        used += n
    if current:
        sequences.append(current)
    return sequences


class PackedLoss(nn.Module):
    """Weighted sum of the answer-token cross-entropies of a packed batch (the module DDP wraps),
    plus, with a vision probe, `probe_weight` times the summed per-token label loss of the
    visual tokens (`vision_labels.py`)."""

    def __init__(self, model: InternVL, probe: VisionProbe | None = None, probe_weight: float = 0.0):
        super().__init__()
        self.model = model
        self.probe = probe
        self.probe_weight = probe_weight

    def forward(self, pixels: torch.Tensor, batch: PackedBatch, visual_labels: torch.Tensor | None = None) -> torch.Tensor:
        lm = self.model.language_model
        visual = self.model.encode_images(pixels)                     # [tiles, tokens_per_tile, D]
        aux = 0.0
        if self.probe is not None and visual_labels is not None:
            flat = visual.reshape(-1, visual.shape[-1])
            aux = self.probe_weight * self.probe(flat, visual_labels) / visual.shape[1]   # per tile
            self.last_probe_loss = aux.detach()        # a tensor: no device sync per sequence
        embeds = lm.embed(batch.ids)
        embeds = embeds.index_copy(0, batch.visual_rows, visual.reshape(-1, visual.shape[-1]).to(embeds.dtype))
        hidden, _, _ = lm(embeds, batch.positions, batch.mask)      # no cache: the packed trees on their own
        logits = lm.head(hidden[batch.target_rows])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # fp16/bf16 -> fp32, fp64 stays
        ce = F.cross_entropy(logits, batch.targets, reduction="none")
        return (ce * batch.weights.to(ce.dtype)).sum() + aux


def pixels_for(cache: TileCache, frames: list, normalize: Normalizer,
               device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Normalised float32 pixels on `device` (the uint8 tiles travel, a quarter of the bytes)."""
    return normalize(cache.batch(frames).to(device, non_blocking=True))


# ---------------------------------------------------------------------------------------------
# Schedule and held-out evaluation
# ---------------------------------------------------------------------------------------------


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


def cosine_decay(progress: float, peak: float, floor: float) -> float:
    """From peak at progress 0 to floor * peak at progress 1."""
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def learning_rate(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return cosine_decay((step - warmup) / max(1, total - warmup), peak, floor)


def learning_rate_at(fraction: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """The same schedule over the fraction of a time budget spent (`--time-budget`): linear warm-up
    over the first `warmup` of it, then cosine decay to floor * peak."""
    fraction = min(max(fraction, 0.0), 1.0)
    if fraction < warmup:
        return peak * max(fraction / warmup, 1e-3)
    return cosine_decay((fraction - warmup) / max(1e-9, 1 - warmup), peak, floor)


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


def held_out_accuracy(model: InternVL, tok_dir: Path, frames: list[Frame], max_questions: int,
                      seed: int, view_selector: Path | None = None, layout: str = SCRATCH_LAYOUT) -> dict:
    """Exact-match accuracy on closed-form (choice, yes/no) questions through the real Pipeline
    (the same answer path and the same match rule as `litevlm eval`); with a view selector, the
    cameras it selects instead of all six."""
    from ..options import options_from_flat
    from ..pipeline.pipeline import Pipeline

    items = [(f, qa) for f in frames for qa in f.qa if is_closed_form(qa.question, qa.answer)]
    rng = np.random.default_rng(seed)
    if len(items) > max_questions:
        items = [items[i] for i in sorted(rng.choice(len(items), max_questions, replace=False))]
    if not items:
        return {"accuracy": None, "questions": 0}
    settings = {"pipeline": "baseline", "max_new_tokens": 8, "prompt_layout": layout}
    if view_selector:
        settings |= {"views.mode": "selector", "views.selector_dir": str(view_selector)}
    # The pipeline runs on the CPU: a float32 CPU copy, whatever device the model trains on.
    pipe = Pipeline.from_model(copy.deepcopy(model).to("cpu", torch.float32), Tokenizer(tok_dir),
                               options_from_flat(settings))
    by_category: dict[str, list[int]] = {}
    for frame, qa in items:
        ans = pipe.answer(frame.images, qa.question, max_new_tokens=8)
        by_category.setdefault(qa.category, []).append(int(ans.text.strip() == qa.answer.strip()))
    hits = [h for v in by_category.values() for h in v]
    return {"accuracy": sum(hits) / len(hits), "questions": len(hits),
            "by_category": {k: sum(v) / len(v) for k, v in sorted(by_category.items())}}


# ---------------------------------------------------------------------------------------------
# Training (one process, or one of N under torchrun)
# ---------------------------------------------------------------------------------------------


def _set_threads(requested: int | None) -> None:
    """Intra-op threads per process: as asked, else the cores divided among the local ranks."""
    torch.set_num_threads(requested or threads_per_rank())


def data_provenance(data: Path) -> dict:
    """What the training data was: its hash, and the generator's settings when it left them."""
    info = {"file": str(data), "sha256": sha256_file(data)}
    for name in ("synthdrive.json", "synth.json", "meta.json"):
        meta = Path(data).parent / name
        if meta.is_file():
            try:
                info["generator"] = json.loads(meta.read_text())
            except json.JSONDecodeError:
                pass
            break
    return info


def reproduce_command(args) -> str:
    """The `litevlm train vlm` command line that repeats this run (every setting spelled out)."""
    parts = ["litevlm", "train", "vlm"]
    # With a time budget the run's length is the budget: --epochs/--steps were not used.
    unused = ("epochs", "steps") if args.time_budget is not None else ()
    for k, v in vars(args).items():
        if k in ("func", "command", "trainer") + unused or v is None or v is False:
            continue
        parts += [f"--{k.replace('_', '-')}"] + ([] if v is True else [shlex.quote(str(v))])
    return " ".join(parts)


def train(args) -> dict | None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: torch sees no CUDA GPU here (use --device cpu or auto)")
    d = setup(None if args.device == "auto" else args.device)   # a GPU per rank (NCCL), else CPU (gloo)
    rank, world = d.rank, d.world
    _set_threads(args.threads)
    try:
        return _train(args, rank, world, d.log, d.device)
    finally:
        d.close()


def _train(args, rank: int, world: int, log, device: torch.device = torch.device("cpu")) -> dict | None:
    if not 0.0 <= args.selected_views <= 1.0:
        raise InputError(f"--selected-views {args.selected_views}: a fraction, 0 to 1")
    if args.time_budget is not None and args.time_budget <= 0:
        raise InputError(f"--time-budget {args.time_budget}: minutes, more than 0")
    bf16 = args.precision == "bfloat16" or (args.precision == "auto" and device.type == "cuda")
    if bf16 and device.type != "cuda":
        raise InputError("--precision bfloat16 is for GPUs (bf16 autocast on the CPU is slower than float32)")
    save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.save_dtype]
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    frames = load_frames(args.data, args.frames)
    if args.val:
        val_frames = load_frames(args.val, args.val_frames or args.frames)
    else:
        # Hold out whole key frames (never trained on) for the periodic accuracy check.
        order = rng.permutation(len(frames))
        n_val = max(1, int(round(args.holdout * len(frames)))) if len(frames) > 1 else 0
        val_frames = [frames[i] for i in sorted(order[:n_val])]
        frames = [frames[i] for i in sorted(order[n_val:])]
    cfg_probe = preset(args.preset)
    system = cfg_probe.system_message

    # The tokenizer: byte-level BPE on the training text (rank 0 trains it, every rank reads it),
    # or the --init checkpoint's own when training continues from one.
    out = Path(args.out)
    work = Path(tempfile.mkdtemp(prefix="litevlm_vlm_"))
    tok_file = work / "tokenizer.json"
    if args.init:
        tok_file.write_bytes((Path(args.init) / "tokenizer.json").read_bytes())
        payload = [tok_file.read_text()]
    elif rank == 0:
        corpus = [system] + [f"{c}: " for c in CAMERAS]
        corpus += [t for f in frames for qa in f.qa for t in (qa.question, qa.answer)]
        train_bpe_tokenizer(corpus, args.vocab_size, tok_file)
        payload = [tok_file.read_text()]
    else:
        payload = [None]
    if world > 1:
        dist.broadcast_object_list(payload, src=0)
        tok_file.write_text(payload[0])
    tok = Tokenizer(work)
    cfg = preset(args.preset, vocab_size=tok.vocab_size)
    if args.decoder_layers:
        cfg = with_decoder_layers(cfg, args.decoder_layers)
    if args.tile_size:
        cfg = with_tile_size(cfg, args.tile_size, keep_position_grid=bool(args.init))
    tokens_per_camera = cfg.tokens_per_tile
    layout = model_layout(args.init)[0] if args.init else SCRATCH_LAYOUT

    encoded: list[list[Encoded]] = []
    skipped = 0
    for f in frames:
        items = []
        for qa in f.qa:
            e = encode_qa(tok, system, tokens_per_camera, qa, layout=layout)
            if len(e.answer) > args.max_answer_tokens + 1:
                skipped += 1
                continue
            items.append(e)
        encoded.append(items)
    n_samples = sum(len(x) for x in encoded)
    log(f"data: {n_samples} QA over {len(frames)} training frames ({skipped} skipped: answer > "
        f"{args.max_answer_tokens} tokens), {sum(len(f.qa) for f in val_frames)} QA over {len(val_frames)} "
        f"held-out frames; tokenizer vocab {tok.vocab_size}")

    if args.init:
        model = load_model(args.init)
        model.train()
        if args.tile_size:
            model.cfg = with_tile_size(model.cfg, args.tile_size, keep_position_grid=True)
        if args.decoder_layers:
            before = model.cfg.llm.num_hidden_layers
            model = grow_decoder(model, args.decoder_layers, args.seed)
            if args.decoder_layers > before:
                log(f"grew the decoder from {before} to {args.decoder_layers} layers: trained layers at "
                    f"{grown_layer_positions(before, args.decoder_layers)}, the others start as identities")
        if model.cfg != cfg:
            raise InputError(f"--init {args.init}: its config differs from --preset {args.preset}")
    else:
        model = InternVL(cfg, max_len=4096)    # RoPE for positions < 4096 (a packed branch is shorter)
        init_weights(model, args.seed)
    model.to(device)                   # float32 master weights; bf16 only inside autocast
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{device}{' (bf16 autocast)' if bf16 else ''}" if device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} threads/rank"
    log(f"model: preset {args.preset}, {n_params / 1e6:.2f} M parameters, tile {cfg.force_image_size}, "
        f"{tokens_per_camera} visual tokens per camera; world size {world}, {where}")

    def save_checkpoint() -> None:
        write_checkpoint(out, model, tok_file, dtype=save_dtype)
        write_layout(out, layout)   # the layout the prompts were built in, for every later load

    cache = TileCache(frames, cfg.force_image_size)
    decode_threads = args.decode_threads if args.decode_threads is not None else \
        ((os.cpu_count() or 1) if device.type == "cuda" else 0)
    if decode_threads:
        t0 = time.monotonic()
        cache.fill_all(decode_threads, lambda n, total: log(f"decoding frames: {n}/{total}"))
        log(f"decoded {len(frames)} frames x {len(CAMERAS)} cameras on {decode_threads} threads "
            f"in {time.monotonic() - t0:.0f} s")
    normalize = Normalizer(torch.float32, device)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    probe = labels = None
    if args.vision_labels:
        grid = int(round(tokens_per_camera ** 0.5))
        labels = load_vision_labels(args.vision_labels, [f.key.split("/")[-1] for f in frames], grid)
        torch.manual_seed(args.seed)
        probe = VisionProbe(model.mlp1[-1].out_features, labels.flatten(0, 2).float().mean(0)).to(device)
        log(f"vision labels: {len(LABELS)} per visual token ({grid}x{grid} per camera), weight {args.vision_weight}, "
            f"{float(labels.float().mean()):.4f} positive")
    select = None
    if args.view_selector:
        from ..stages.view_selector import load_view_selector
        selector = load_view_selector(args.view_selector)
        memo: dict[str, list[str]] = {}
        select = lambda q: memo[q] if q in memo else memo.setdefault(q, selector.select(q))  # noqa: E731
        log(f"view selection: {args.selected_views:.0%} of QA see only the cameras {args.view_selector} selects")
    view_rng = np.random.default_rng([args.seed, rank, 7])    # per rank: must not disturb the shared data order

    def visual_labels_for(keys: list) -> torch.Tensor | None:
        if labels is None:
            return None
        return torch.cat([labels[f][list(cams)].reshape(-1, len(LABELS))
                          for f, cams in map(frame_and_cameras, keys)]).to(device, non_blocking=True)

    loss_module = PackedLoss(model, probe, args.vision_weight)
    if world > 1:
        loss_module = DistributedDataParallel(loss_module, device_ids=[device.index] if device.type == "cuda" else None)
    params = list(model.named_parameters()) + (list(probe.named_parameters(prefix="probe")) if probe else [])
    decay = [p for n, p in params if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embedding" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))

    per_step = args.frames_per_step
    if per_step < world:
        raise InputError(f"--frames-per-step {per_step} is less than the world size {world}")
    per_frame = [min(len(x), args.questions_per_visit or len(x)) for x in encoded]
    steps_per_epoch = math.ceil(sum(math.ceil(n / args.questions_per_frame) for n in per_frame) / per_step)
    budget_s = None if args.time_budget is None else 60.0 * args.time_budget
    total = None if budget_s else (args.steps or max(1, int(round(args.epochs * steps_per_epoch))))
    warmup = max(1, int(args.warmup * (total or 1)))
    length = f"{args.time_budget:g} min" if budget_s else f"{total} steps"
    log(f"training: {length} of {per_step} frame groups (<= {args.questions_per_frame} questions each), "
        f"{steps_per_epoch} steps per epoch, lr {args.lr} warm-up "
        f"{f'{args.warmup:.0%} of the time' if budget_s else warmup}")

    per_sample = args.loss_per == "sample"

    def step_batches():
        """Per step: the global target count the loss is normalised by, and this rank's packed
        sequences. Every rank draws the same global groups (same seed) and keeps its share."""
        pending: list[tuple[int, list[Encoded]]] = []
        while True:
            while len(pending) < per_step:
                pending += epoch_groups(encoded, args.questions_per_frame, rng, args.questions_per_visit)
            groups, pending = pending[:per_step], pending[per_step:]
            mine = groups[rank::world]
            if select is not None:
                mine = split_by_views(mine, select, args.selected_views, view_rng,
                                      lambda qa, cams: encode_qa(tok, system, tokens_per_camera, qa, cams, layout))
            # The loss is a mean over the global batch: over answer tokens, or over QA (--loss-per sample).
            n_targets_global = sum(1 if per_sample else len(e.answer) for _, items in groups for e in items)
            # This rank's groups, packed into sequences of at most --max-sequence-tokens: attention
            # over a packed sequence is dense (T x T under the mask), so very long packs waste time
            # on masked-out pairs; gradients of the sequences accumulate.
            yield n_targets_global, [pack(seq, per_sample) for seq in split_into_sequences(mine, args.max_sequence_tokens)]

    # On a GPU the next steps are packed on a thread while this one runs (same order, one producer).
    batches = step_batches() if device.type == "cpu" else prefetch(step_batches(), depth=2)

    history = []
    loss_sum = tok_sum = samples_done = probe_sum = 0
    window_t0 = time.monotonic()
    window_samples = 0
    train_t0 = time.monotonic()
    last_eval: dict = {}
    eval_s = 0.0                 # held-out checks, kept out of the time budget
    spent = 0.0                  # fraction of the time budget spent, as rank 0 measured it
    for step in itertools.count():
        n_targets_global, packed = next(batches)
        lr = learning_rate(step, total, args.lr, warmup) if total else learning_rate_at(spent, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum_local = torch.zeros((), device=device)
        probe_sum_local = torch.zeros((), device=device)
        n_targets_local = n_samples_local = 0
        for i, batch in enumerate(packed):
            sync = contextlib.nullcontext() if (world == 1 or i == len(packed) - 1) else loss_module.no_sync()
            with sync:
                with amp():     # autocast covers the forward only; backward runs in the forward's dtypes
                    seq_loss = loss_module(pixels_for(cache, batch.frames, normalize, device), batch.to(device),
                                           visual_labels_for(batch.frames))
                # Normalised by the global token count, times world because DDP averages over
                # ranks: the gradient equals that of one process seeing the whole global batch.
                (seq_loss * (world / n_targets_global)).backward()
            probe_part = getattr(loss_module.module if world > 1 else loss_module, "last_probe_loss", 0.0)
            probe_sum_local += probe_part
            loss_sum_local += seq_loss.detach() - probe_part
            n_targets_local += float(batch.weights.sum())
            n_samples_local += batch.samples
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        opt.step()
        opt.zero_grad(set_to_none=True)

        # Rank 0's clock decides the budget for every rank (the sum carries it: the others add 0),
        # so that all ranks take the same learning rate and stop at the same step.
        clock = time.monotonic() - train_t0 - eval_s if rank == 0 else 0.0
        stats = torch.tensor([float(loss_sum_local), float(n_targets_local), float(n_samples_local),
                              float(probe_sum_local), clock], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        if budget_s:
            spent = stats[4].item() / budget_s
        last = spent >= 1.0 if budget_s else step + 1 == total
        loss_sum += stats[0].item()
        probe_sum += stats[3].item()
        tok_sum += stats[1].item()
        samples_done += int(stats[2].item())
        window_samples += int(stats[2].item())
        if (step + 1) % args.log_every == 0 or last:
            elapsed = time.monotonic() - window_t0
            rate = window_samples / max(elapsed, 1e-9)
            if budget_s:
                eta = max(0.0, budget_s - stats[4].item())
            else:
                eta = (time.monotonic() - train_t0 - eval_s) / (step + 1) * (total - step - 1)
            loss = loss_sum / max(tok_sum, 1)
            probe_text = f"  probe {probe_sum / max(tok_sum, 1):.4f}" if probe is not None else ""
            log(f"step {step + 1:5d}/{total or '~'}  loss {loss:.4f}{probe_text}  grad {grad_norm:.2f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {rate:.1f} samples/s  ETA {eta / 60:.1f} min")
            history.append({"step": step + 1, "loss": loss, "samples": samples_done,
                            "elapsed_s": time.monotonic() - train_t0}
                           | ({"probe_loss": probe_sum / max(tok_sum, 1)} if probe is not None else {}))
            loss_sum = tok_sum = probe_sum = 0
            window_t0, window_samples = time.monotonic(), 0
        if rank == 0 and args.eval_every and ((step + 1) % args.eval_every == 0 or last):
            model.eval()
            t0 = time.monotonic()
            save_checkpoint()   # the latest weights survive an interrupted run
            last_eval = held_out_accuracy(model, work, val_frames, args.eval_questions, args.seed, layout=layout)
            if args.view_selector:
                last_eval["selected_views"] = held_out_accuracy(model, work, val_frames, args.eval_questions,
                                                                args.seed, args.view_selector, layout)
            model.train()
            last_eval["step"] = step + 1
            history.append({"step": step + 1, "held_out": last_eval})
            cats = " ".join(f"{k} {v:.3f}" for k, v in last_eval.get("by_category", {}).items())
            acc = last_eval["accuracy"]
            sel = last_eval.get("selected_views", {}).get("accuracy")
            sel_text = "" if sel is None else f"; with selected views {sel:.4f}"
            log(f"  held-out accuracy {'n/a' if acc is None else f'{acc:.4f}'} on {last_eval['questions']} "
                f"closed-form questions ({cats}){sel_text} [{time.monotonic() - t0:.0f} s]")
            window_t0 = time.monotonic()   # keep eval time out of the samples/s figure
            eval_s += window_t0 - t0
        if last:
            break

    steps_done = step + 1
    train_s = time.monotonic() - train_t0
    if rank != 0:
        return None
    save_checkpoint()
    record = {
        "command": reproduce_command(args),
        "argv": " ".join(shlex.quote(a) for a in sys.argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "world_size": world,
        "device": str(device) if device.type == "cpu" else f"{device}: {torch.cuda.get_device_name(device)}",
        "precision": "bfloat16 autocast" if bf16 else "float32",
        "saved_dtype": args.save_dtype,
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "data": data_provenance(args.data),
        "val_data": data_provenance(args.val) if args.val else {"held_out_frames": [f.key for f in val_frames]},
        "model": {"preset": args.preset, "parameters": n_params, "config": cfg.to_dict(),
                  "tokenizer_vocab": tok.vocab_size},
        "train_qa": n_samples, "train_frames": len(frames), "skipped_long_answers": skipped,
        "steps": steps_done,
        "final": {"loss": history[-1]["loss"] if history and "loss" in history[-1] else
                  next((h["loss"] for h in reversed(history) if "loss" in h), None),
                  "held_out": last_eval, "train_seconds": round(train_s, 1),
                  "total_seconds": round(time.monotonic() - t_start, 1)},
        "history": history,
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    log(f"wrote {out} ({train_s / 60:.1f} min training); record in {out / RECORD_FILE}")
    return record


def register(subparsers) -> None:
    p = subparsers.add_parser("vlm", help="train an InternVL2.5-layout model from scratch on DriveLM-format QA",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="training QA (DriveLM v1.1 JSON)")
    p.add_argument("--frames", type=Path, required=True, help="root the image_paths are relative to")
    p.add_argument("--val", type=Path, help="held-out QA for the periodic accuracy (default: --holdout of --data's frames)")
    p.add_argument("--val-frames", type=Path, help="image root of --val (default: --frames)")
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of frames held out when no --val")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", choices=PRESETS, default="bundled")
    p.add_argument("--init", type=Path, help="continue from this checkpoint (its weights and tokenizer) instead of random weights")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--tile-size", type=int,
                   help="tile size in pixels instead of the preset's; with --init the position embedding is "
                        "interpolated from the checkpoint's grid (a higher-resolution fine-tune)")
    p.add_argument("--decoder-layers", type=int,
                   help="decoder depth instead of the preset's; with --init a shallower checkpoint is grown to it "
                        "(new layers interleaved, starting as identities)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--frames-per-step", type=int, default=8, help="frame groups per optimizer step (global)")
    p.add_argument("--questions-per-frame", type=int, default=16, help="questions per frame group (one prefix tree)")
    p.add_argument("--questions-per-visit", type=int, default=0,
                   help="random questions of each frame per pass over the data (0: all)")
    p.add_argument("--max-sequence-tokens", type=int, default=1024, help="longest packed sequence per forward")
    p.add_argument("--loss-per", choices=("token", "sample"), default="sample",
                   help="mean the loss over answer tokens, or over QA (short yes/no answers weigh as much as long ones)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-answer-tokens", type=int, default=64)
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the written weights (training keeps float32 masters; the loader reads either "
                        "into the pipeline's dtype): bfloat16 halves the folder")
    p.add_argument("--vision-labels", type=Path,
                   help="SynthDrive ground_truth.json: also train a linear probe on every visual token to predict the "
                        "objects drawn there (training only; not in the checkpoint)")
    p.add_argument("--vision-weight", type=float, default=0.2, help="weight of the vision-label loss")
    p.add_argument("--view-selector", type=Path,
                   help="view selector folder: --selected-views of the QA are trained with only the cameras it selects")
    p.add_argument("--selected-views", type=float, default=0.5, help="fraction of QA trained with selected cameras")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: a GPU per rank where torch sees one, else the CPU")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: bf16 autocast on a GPU (float32 master weights), float32 on the CPU")
    p.add_argument("--time-budget", type=float, metavar="MINUTES",
                   help="train for this many minutes (held-out checks not counted) instead of --steps/--epochs; "
                        "the learning-rate schedule follows the fraction of the budget spent")
    p.add_argument("--decode-threads", type=int,
                   help="decode all frames up front on this many threads (default: all cores on a GPU, "
                        "0 = lazily during training on the CPU)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores / local ranks)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out accuracy checks (0: off)")
    p.add_argument("--eval-questions", type=int, default=200)

    def run(args) -> int:
        train(args)
        return 0

    p.set_defaults(func=run)
