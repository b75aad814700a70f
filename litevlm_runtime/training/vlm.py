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
alone (tests/training/test_train_vlm.py checks the loss against per-sample runs in float64). It saves the
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

Frame sets over time (SynthDrive in motion, `litevlm synth --frames K`): a QA item with "frames": K
is trained on the prompt the LiteVLM pipeline builds for it, each selected camera's K frame sets
oldest first (stages/prompt.py), with temporal token selection applied as at inference
(`--change-threshold`, packing.py); the other QA stay single-frame prompts, so a mixed set trains
both. `--time-share` sets the share of each frame visit's QA that are over time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..cameras import CAMERAS
from ..errors import InputError
from ..models.config import ModelConfig
from ..models.internvl import InternVL
from ..models.motion import MOTION_FEATURES, MotionTokens
from ..options import options_from_flat
from ..pipeline.frame_sets import FrameSet
from ..pipeline.pipeline import Pipeline
from ..pipeline.request import QueryRequest
from ..stages.motion import grey_tile, tiles_motion
from ..stages.preprocess import Normalizer
from ..stages.prompt import model_layout, write_layout
from ..stages.view_selector import load_view_selector
from ..weights.checkpoint import load_model, write_checkpoint
from ..weights.presets import preset
from ..weights.random_init import init_weights
from ..weights.tokenizer import Tokenizer, train_bpe_tokenizer
from .distributed import Dist, setup, threads_per_rank
from .packing import PackedLoss, pack, split_into_sequences
from .provenance import data_provenance, reproduce_command
from .schedule import learning_rate, learning_rate_at
from .surgery import grow_decoder, grown_layer_positions, with_decoder_layers, with_tile_size
from .vision_labels import LABELS, VisionProbe, load_vision_labels
from .vlm_data import (
    SCRATCH_LAYOUT,
    Encoded,
    Frame,
    TileCache,
    VisionFeatureCache,
    encode_qa,
    epoch_groups,
    frame_and_cameras,
    group_of,
    is_closed_form,
    load_frames,
    pixels_for,
    prefetch,
    split_by_views,
)

RECORD_FILE = "training_record.json"


# ---------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------


def held_out_accuracy(model: InternVL, tok_dir: Path, frames: list[Frame], max_questions: int,
                      seed: int, view_selector: Path | None = None, layout: str = SCRATCH_LAYOUT) -> dict:
    """Exact-match accuracy on closed-form (choice, yes/no) questions through the real Pipeline
    (the same answer path and the same match rule as `litevlm eval`); with a view selector, the
    cameras it selects instead of all six."""

    items = [(f, qa) for f in frames for qa in f.qa if is_closed_form(qa.question, qa.answer)]
    rng = np.random.default_rng(seed)
    if len(items) > max_questions:
        items = [items[i] for i in sorted(rng.choice(len(items), max_questions, replace=False))]
    if not items:
        return {"accuracy": None, "questions": 0}
    most = max(qa.frames for _, qa in items)
    settings = {"pipeline": "baseline", "max_new_tokens": 8, "prompt_layout": layout, "temporal.max_frames": most,
                "temporal.mode": "all"}
    if view_selector:
        settings |= {"views.mode": "selector", "views.selector_dir": str(view_selector)}
    # The pipeline runs on the CPU: a float32 CPU copy, whatever device the model trains on.
    pipe = Pipeline.from_model(copy.deepcopy(model).to("cpu", torch.float32), Tokenizer(tok_dir),
                               options_from_flat(settings))
    by_category: dict[str, list[int]] = {}
    for frame, qa in items:      # a QA over K frame sets is asked with them (the pipeline's prompt over time)
        sets = [FrameSet(images) for images in frame.past[len(frame.past) - qa.frames + 1:]] + [FrameSet(frame.images)]
        ans = pipe.answer(sets, QueryRequest(qa.question, max_new_tokens=8, frames=qa.frames))
        by_category.setdefault(qa.category, []).append(int(ans.text.strip() == qa.answer.strip()))
        if qa.frames > 1:        # and with the key frame set alone: what time adds (not in the totals)
            one = pipe.answer(sets[-1:], QueryRequest(qa.question, max_new_tokens=8, frames=1))
            by_category.setdefault(f"{qa.category}@1", []).append(int(one.text.strip() == qa.answer.strip()))
    hits = [h for k, v in by_category.items() if "@" not in k for h in v]
    return {"accuracy": sum(hits) / len(hits), "questions": len(hits),
            "by_category": {k: sum(v) / len(v) for k, v in sorted(by_category.items())}}


# ---------------------------------------------------------------------------------------------
# Training (one process, or one of N under torchrun)
# ---------------------------------------------------------------------------------------------


def _set_threads(requested: int | None) -> None:
    """Intra-op threads per process: as asked, else the cores divided among the local ranks."""
    torch.set_num_threads(requested or threads_per_rank())


def train(args) -> dict | None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: torch sees no CUDA GPU here (use --device cpu or auto)")
    d = setup(None if args.device == "auto" else args.device)   # a GPU per rank (NCCL), else CPU (gloo)
    _set_threads(args.threads)
    try:
        # The run's own folder (its tokenizer.json, copied into the checkpoint): gone when the run ends.
        with tempfile.TemporaryDirectory(prefix="litevlm_vlm_") as work:
            return _train(args, d, Path(work))
    finally:
        d.close()


def _train(args, d: Dist, work: Path) -> dict | None:
    """Prepare the data, the tokenizer, the model and its optimizer; optimize; rank 0 writes the
    checkpoint and the training record. Every rank runs these steps in this order, and the
    seeded RNGs are drawn in it: keep the order, and the same seed gives the same run."""
    bf16 = _check_flags(args, d.device)
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)      # the data order: the same on every rank
    data = _prepare_data(args, d, rng, work)
    model = _build_model(args, data.cfg, d, bf16)
    inputs = _step_inputs(args, data.frames, data.cfg, model, d)
    select = _view_selection(args, d.log)
    view_rng = np.random.default_rng([args.seed, d.rank, 7])    # per rank: must not disturb the shared data order
    loss_module = d.wrap(PackedLoss(model, inputs.probe, args.vision_weight, args.change_threshold,
                                    frozen_vision=args.freeze_vision))
    run = _Run(args, d, data, model, loss_module, _optimizer(args, model, inputs.probe), _run_length(args, data, d),
               inputs, (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext)
    batches = _step_batches(args, data, d, run.length.per_step, rng, select, view_rng, inputs.features)
    # On a GPU the next steps are packed on a thread while this one runs (same order, one producer).
    if d.device.type != "cpu":
        batches = prefetch(batches, depth=2)
    progress, last_eval, steps_done = _optimize(run, batches)
    if d.rank != 0:
        return None
    run.save_checkpoint()
    return _write_record(run, bf16, progress, last_eval, steps_done, t_start)


def _check_flags(args, device: torch.device) -> bool:
    """Refuse settings that cannot work before anything runs; returns whether to train in bf16 autocast."""
    if not 0.0 <= args.selected_views <= 1.0:
        raise InputError(f"--selected-views {args.selected_views}: a fraction, 0 to 1")
    if args.freeze_vision and args.vision_labels:
        raise InputError("--vision-labels trains a probe on the vision side, which --freeze-vision keeps as it is")
    if args.time_budget is not None and args.time_budget <= 0:
        raise InputError(f"--time-budget {args.time_budget}: minutes, more than 0")
    bf16 = args.precision == "bfloat16" or (args.precision == "auto" and device.type == "cuda")
    if bf16 and device.type != "cuda":
        raise InputError("--precision bfloat16 is for GPUs (bf16 autocast on the CPU is slower than float32)")
    return bf16


@dataclass
class _Data:
    """The run's data, prepared once, the same on every rank."""
    frames: list[Frame]                # training key frames
    val_frames: list[Frame]            # held-out key frames (never trained on)
    work: Path                         # the run's own folder: its tokenizer.json
    tok: Tokenizer
    cfg: ModelConfig                   # the model's, with the tokenizer's vocabulary
    system: str                        # the system message of the prompt
    layout: str                        # the prompt layout the model is trained (and later asked) in
    encoded: list[list[Encoded]]       # per training frame, its QA with answers within --max-answer-tokens
    skipped: int                       # QA left out: answer longer than --max-answer-tokens

    def encode(self, qa, cameras) -> Encoded:
        """One QA on these cameras only (the prompt the view selector's pipeline builds)."""
        return encode_qa(self.tok, self.system, self.cfg.tokens_per_tile, qa, cameras, self.layout)


def _prepare_data(args, d: Dist, rng: np.random.Generator, work: Path) -> _Data:
    frames = load_frames(args.data, args.frames)
    if args.val:
        val_frames = load_frames(args.val, args.val_frames or args.frames)
    else:
        # Hold out whole key frames (never trained on) for the periodic accuracy check.
        order = rng.permutation(len(frames))
        n_val = max(1, int(round(args.holdout * len(frames)))) if len(frames) > 1 else 0
        val_frames = [frames[i] for i in sorted(order[:n_val])]
        frames = [frames[i] for i in sorted(order[n_val:])]
    system = preset(args.preset).system_message
    tok = _tokenizer(args, frames, system, work, d)
    cfg = preset(args.preset, vocab_size=tok.vocab_size)
    if args.decoder_layers:
        cfg = with_decoder_layers(cfg, args.decoder_layers)
    if args.tile_size:
        cfg = with_tile_size(cfg, args.tile_size, keep_position_grid=bool(args.init))
    layout = model_layout(args.init)[0] if args.init else SCRATCH_LAYOUT

    encoded: list[list[Encoded]] = []
    skipped = 0
    if not args.view_selector and any(qa.frames > 1 for f in frames for qa in f.qa):
        d.log("frame sets over time without --view-selector: a K-frame QA's prompt holds all six cameras x K sets")
    for f in frames:
        items = []
        for qa in f.qa:
            e = encode_qa(tok, system, cfg.tokens_per_tile, qa, layout=layout)
            if len(e.answer) > args.max_answer_tokens + 1:
                skipped += 1
                continue
            items.append(e)
        encoded.append(items)
    d.log(f"data: {sum(len(x) for x in encoded)} QA over {len(frames)} training frames ({skipped} skipped: answer > "
          f"{args.max_answer_tokens} tokens), {sum(len(f.qa) for f in val_frames)} QA over {len(val_frames)} "
          f"held-out frames; tokenizer vocab {tok.vocab_size}")
    return _Data(frames, val_frames, work, tok, cfg, system, layout, encoded, skipped)


def _tokenizer(args, frames: list[Frame], system: str, work: Path, d: Dist) -> Tokenizer:
    """Byte-level BPE on the training text (rank 0 trains it, every rank reads it), or the --init
    checkpoint's own when training continues from one; written to work/tokenizer.json."""
    tok_file = work / "tokenizer.json"
    if args.init:
        tok_file.write_bytes((Path(args.init) / "tokenizer.json").read_bytes())
        payload = [tok_file.read_text()]
    elif d.rank == 0:
        corpus = [system] + [f"{c}: " for c in CAMERAS]
        corpus += [t for f in frames for qa in f.qa for t in (qa.question, qa.answer)]
        train_bpe_tokenizer(corpus, args.vocab_size, tok_file)
        payload = [tok_file.read_text()]
    else:
        payload = [None]
    if d.world > 1:
        dist.broadcast_object_list(payload, src=0)
        tok_file.write_text(payload[0])
    return Tokenizer(work)


def _build_model(args, cfg: ModelConfig, d: Dist, bf16: bool) -> InternVL:
    """Random weights (seeded), or --init's checkpoint (grown to --decoder-layers), on the device
    in float32: the master weights (bf16 only inside autocast)."""
    if args.init:
        model = load_model(args.init)
        model.train()
        if args.tile_size:
            model.cfg = with_tile_size(model.cfg, args.tile_size, keep_position_grid=True)
        if args.decoder_layers:
            before = model.cfg.llm.num_hidden_layers
            model = grow_decoder(model, args.decoder_layers, args.seed)
            if args.decoder_layers > before:
                d.log(f"grew the decoder from {before} to {args.decoder_layers} layers: trained layers at "
                      f"{grown_layer_positions(before, args.decoder_layers)}, the others start as identities")
        if model.cfg != cfg:
            raise InputError(f"--init {args.init}: its config differs from --preset {args.preset}")
    else:
        model = InternVL(cfg, max_len=4096)    # RoPE for positions < 4096 (a packed branch is shorter)
        init_weights(model, args.seed)
    if args.motion and model.motion is None:
        torch.manual_seed(args.seed)
        model.motion = MotionTokens(args.motion, cfg.llm.hidden_size)
        d.log(f"motion network: {MOTION_FEATURES} flow numbers per cell -> {args.motion} -> {cfg.llm.hidden_size}, "
              "its output zero until it trains")
    model.to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{d.device}{' (bf16 autocast)' if bf16 else ''}" if d.device.type == "cuda" else \
        f"cpu, {torch.get_num_threads()} threads/rank"
    d.log(f"model: preset {args.preset}, {n_params / 1e6:.2f} M parameters, tile {cfg.force_image_size}, "
          f"{cfg.tokens_per_tile} visual tokens per camera; world size {d.world}, {where}")
    return model


class _StepInputs:
    """A packed batch's tensors on the training device: the normalised tiles of its frames' cameras
    (each tile decoded and resized once, then cached; only the normalisation runs per step) and,
    with --vision-labels, the probe's labels of their visual tokens."""

    def __init__(self, cache: TileCache, device: torch.device, labels: torch.Tensor | None = None,
                 probe: VisionProbe | None = None, features: VisionFeatureCache | None = None, motion_grid: int = 0):
        """labels: uint8 [frames, cameras, grid * grid, len(LABELS)] (load_vision_labels);
        features: --freeze-vision's cache of the vision tower's output (then given instead of pixels);
        motion_grid: a model with a motion network: its token grid's side (0: none)."""
        self.cache, self.device, self.labels, self.probe, self.features = cache, device, labels, probe, features
        self.normalize = Normalizer(torch.float32, device)
        self.motion_grid = motion_grid
        self.motion_store: dict[tuple[int, int], torch.Tensor] = {}    # (frame, camera) -> [tokens, features]

    def __call__(self, batch) -> tuple:
        """(pixels, the batch on the device, visual labels or None, the labelled tiles or None) of a
        PackedBatch: the labels describe the key frames' tiles (an older frame set has none)."""
        labels, tiles = self.visual_labels(batch.frames), None
        if labels is not None and any(group_of(k)[2] > 1 for k in batch.frames):
            tiles = torch.tensor(self.cache.key_tiles(batch.frames), dtype=torch.long, device=self.device)
        inputs = self.features.batch(batch.frames) if self.features is not None else \
            pixels_for(self.cache, batch.frames, self.normalize, self.device)
        return inputs, batch.to(self.device), labels, tiles, self.motion(batch.frames)

    def motion(self, keys: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a model with a motion network: (the batch's tiles that are a camera's newest set in a
        prompt over frame sets [M], their cells' flow from the set before [M, tokens, features]), as
        the pipeline computes them (pipeline.with_motion); None where the batch has none."""
        if not self.motion_grid:
            return None
        tiles, feats, n, tpc = [], [], 0, self.cache.tiles_per_camera
        for key in keys:
            i, cams, frames = group_of(key)
            for pos, c in enumerate(cams):
                if frames > 1:
                    if (i, c) not in self.motion_store:
                        grey = [[grey_tile(t) for t in self.cache.frame_tiles(i, back)[c * tpc:(c + 1) * tpc]]
                                for back in (0, 1)]
                        self.motion_store[(i, c)] = tiles_motion(grey[0], grey[1], self.motion_grid)
                    first = n + (pos * frames + frames - 1) * tpc
                    tiles.append(torch.arange(first, first + tpc))
                    feats.append(self.motion_store[(i, c)].view(tpc, -1, MOTION_FEATURES))
            n += len(cams) * frames * tpc
        if not tiles:
            return None
        return torch.cat(tiles).to(self.device), torch.cat(feats).to(self.device)

    def visual_labels(self, keys: list) -> torch.Tensor | None:
        """[visual tokens of the batch's key-frame tiles, len(LABELS)], in the batch's tile order."""
        if self.labels is None:
            return None
        return torch.cat([self.labels[f][list(cams)].reshape(-1, len(LABELS))
                          for f, cams in map(frame_and_cameras, keys)]).to(self.device, non_blocking=True)


def _step_inputs(args, frames: list[Frame], cfg: ModelConfig, model: InternVL, d: Dist) -> _StepInputs:
    """The tile cache (filled up front by a pool of threads on a GPU, whose steps outrun one
    decoding thread) and, with --vision-labels, the labels and the probe that learns them."""
    cache = TileCache(frames, cfg.force_image_size)
    features = None
    if args.freeze_vision:
        model.vision_model.requires_grad_(False)
        model.mlp1.requires_grad_(False)
        features = VisionFeatureCache(cache, model, Normalizer(torch.float32, d.device), d.device)
        d.log("vision side frozen (InternViT and mlp1): its visual tokens are computed once per frame set and "
              "cached; the decoder trains, and older frame sets' unchanged tokens are left out of the sequences")
    decode_threads = args.decode_threads if args.decode_threads is not None else \
        ((os.cpu_count() or 1) if d.device.type == "cuda" and not args.freeze_vision else 0)
    if decode_threads:
        t0 = time.monotonic()
        cache.fill_all(decode_threads, lambda n, total: d.log(f"decoding frames: {n}/{total}"))
        d.log(f"decoded {len(frames)} frames x {len(CAMERAS)} cameras on {decode_threads} threads "
              f"in {time.monotonic() - t0:.0f} s")
    grid = cfg.tokens_per_side
    motion_grid = grid if model.motion is not None else 0
    if not args.vision_labels:
        return _StepInputs(cache, d.device, features=features, motion_grid=motion_grid)
    labels = load_vision_labels(args.vision_labels, [f.key.split("/")[-1] for f in frames], grid)
    torch.manual_seed(args.seed)
    probe = VisionProbe(model.mlp1[-1].out_features, labels.flatten(0, 2).float().mean(0)).to(d.device)
    d.log(f"vision labels: {len(LABELS)} per visual token ({grid}x{grid} per camera), weight {args.vision_weight}, "
          f"{float(labels.float().mean()):.4f} positive")
    return _StepInputs(cache, d.device, labels, probe, features, motion_grid)


def _view_selection(args, log):
    """With --view-selector: question -> the cameras the selector picks (memoised), else None."""
    if not args.view_selector:
        return None
    selector = load_view_selector(args.view_selector)
    memo: dict[str, list[str]] = {}
    log(f"view selection: {args.selected_views:.0%} of QA see only the cameras {args.view_selector} selects")
    return lambda q: memo[q] if q in memo else memo.setdefault(q, selector.select(q))


def _optimizer(args, model: InternVL, probe: VisionProbe | None) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases, norms and embeddings. The motion network (--motion) learns at
    --motion-lr-scale times the rate (`lr_scale`): it starts from zero beside a trained decoder."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]     # (--freeze-vision: not the ViT)
    params += list(probe.named_parameters(prefix="probe")) if probe else []
    motion = [p for n, p in params if n.startswith("motion.")]
    params = [(n, p) for n, p in params if not n.startswith("motion.")]
    decay = [p for n, p in params if p.ndim >= 2 and "embedding" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embedding" not in n)]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if motion:
        groups.append({"params": motion, "weight_decay": 0.0, "lr_scale": args.motion_lr_scale})
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


@dataclass
class _Length:
    """How long the run is: `total` steps, or a time budget (then the learning-rate schedule runs
    on the fraction of the budget spent)."""
    per_step: int                      # frame groups per optimizer step (global)
    total: int | None                  # steps; None with a time budget
    warmup: int                        # steps of warm-up (with a time budget: --warmup is a fraction of it)
    budget_s: float | None
    peak_lr: float
    warmup_fraction: float

    def learning_rate(self, step: int, spent: float) -> float:
        if self.total:
            return learning_rate(step, self.total, self.peak_lr, self.warmup)
        return learning_rate_at(spent, self.peak_lr, self.warmup_fraction)

    def is_last(self, step: int, spent: float) -> bool:
        return spent >= 1.0 if self.budget_s else step + 1 == self.total


def _run_length(args, data: _Data, d: Dist) -> _Length:
    per_step = args.frames_per_step
    if per_step < d.world:
        raise InputError(f"--frames-per-step {per_step} is less than the world size {d.world}")
    per_frame = [min(len(x), args.questions_per_visit or len(x)) for x in data.encoded]
    steps_per_epoch = math.ceil(sum(math.ceil(n / args.questions_per_frame) for n in per_frame) / per_step)
    budget_s = None if args.time_budget is None else 60.0 * args.time_budget
    total = None if budget_s else (args.steps or max(1, int(round(args.epochs * steps_per_epoch))))
    warmup = max(1, int(args.warmup * (total or 1)))
    length = f"{args.time_budget:g} min" if budget_s else f"{total} steps"
    d.log(f"training: {length} of {per_step} frame groups (<= {args.questions_per_frame} questions each), "
          f"{steps_per_epoch} steps per epoch, lr {args.lr} warm-up "
          f"{f'{args.warmup:.0%} of the time' if budget_s else warmup}")
    return _Length(per_step, total, warmup, budget_s, args.lr, args.warmup)


def _step_batches(args, data: _Data, d: Dist, per_step: int, rng: np.random.Generator, select,
                  view_rng: np.random.Generator, features: VisionFeatureCache | None = None):
    """Per step: the global target count the loss is normalised by, and this rank's packed
    sequences. Every rank draws the same global groups (same seed) and keeps its share. With a
    frozen vision side (`features`), older frame sets' unchanged visual tokens are left out of
    the sequences (temporal token selection decided on the cached features)."""
    per_sample = args.loss_per == "sample"
    pending: list[tuple[int, list[Encoded]]] = []
    while True:
        while len(pending) < per_step:
            pending += epoch_groups(data.encoded, args.questions_per_frame, rng, args.questions_per_visit,
                                    args.time_share)
        groups, pending = pending[:per_step], pending[per_step:]
        mine = groups[d.rank::d.world]
        # (also without a view selector: QA over several frame sets get groups of their own)
        mine = split_by_views(mine, select, args.selected_views, view_rng, data.encode)
        # The loss is a mean over the global batch: over answer tokens, or over QA (--loss-per sample).
        n_targets_global = sum(1 if per_sample else len(e.answer) for _, items in groups for e in items)
        # This rank's groups, packed into sequences of at most --max-sequence-tokens: attention
        # over a packed sequence is dense (T x T under the mask), so very long packs waste time
        # on masked-out pairs; gradients of the sequences accumulate.
        seqs = split_into_sequences(mine, args.max_sequence_tokens)
        if features is not None:
            yield n_targets_global, [pack(seq, per_sample, features.dropped(seq, args.change_threshold))
                                     for seq in seqs]
        else:
            yield n_targets_global, [pack(seq, per_sample) for seq in seqs]


@dataclass
class _Run:
    """What the optimization loop works with, built once by `_train`."""
    args: argparse.Namespace
    d: Dist
    data: _Data
    model: InternVL
    loss_module: torch.nn.Module       # PackedLoss (model + probe), DDP-wrapped under torchrun
    opt: torch.optim.Optimizer
    length: _Length
    inputs: _StepInputs
    amp: Callable[[], contextlib.AbstractContextManager]   # the forward's autocast (bf16 on a GPU) or none

    def save_checkpoint(self) -> None:
        out = Path(self.args.out)
        save_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.args.save_dtype]
        write_checkpoint(out, self.model, self.data.work / "tokenizer.json", dtype=save_dtype)
        write_layout(out, self.data.layout)   # the layout the prompts were built in, for every later load


def _optimization_step(run: _Run, n_targets_global: int, packed: list) -> tuple[list[float], float]:
    """Forward and backward over this rank's packed sequences (gradients accumulate; DDP
    all-reduces on the last one), clip, step. Returns this rank's sums [answer loss, targets,
    samples, probe loss] and the gradient norm before clipping."""
    world, device = run.d.world, run.d.device
    loss_sum_local = torch.zeros((), device=device)
    probe_sum_local = torch.zeros((), device=device)
    n_targets_local = n_samples_local = 0
    for i, batch in enumerate(packed):
        sync = contextlib.nullcontext() if (world == 1 or i == len(packed) - 1) else run.loss_module.no_sync()
        with sync:
            with run.amp():     # autocast covers the forward only; backward runs in the forward's dtypes
                seq_loss = run.loss_module(*run.inputs(batch))
            # Normalised by the global token count, times world because DDP averages over
            # ranks: the gradient equals that of one process seeing the whole global batch.
            (seq_loss * (world / n_targets_global)).backward()
        probe_part = getattr(run.loss_module.module if world > 1 else run.loss_module, "last_probe_loss", 0.0)
        probe_sum_local += probe_part
        loss_sum_local += seq_loss.detach() - probe_part
        n_targets_local += float(batch.weights.sum())
        n_samples_local += batch.samples
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.args.clip))
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return [float(loss_sum_local), float(n_targets_local), float(n_samples_local), float(probe_sum_local)], grad_norm


class _Progress:
    """The sums since the last log line, the history the record keeps, and the clocks (held-out
    checks are kept out of the time budget and of the samples/s figure)."""

    def __init__(self, log, has_probe: bool):
        self.log, self.has_probe = log, has_probe
        self.history: list[dict] = []
        self.loss_sum = self.tok_sum = self.samples_done = self.probe_sum = 0
        self.window_t0 = time.monotonic()
        self.window_samples = 0
        self.train_t0 = time.monotonic()
        self.eval_s = 0.0

    def training_clock(self) -> float:
        """Seconds of training so far, held-out checks excluded."""
        return time.monotonic() - self.train_t0 - self.eval_s

    def add(self, stats: torch.Tensor) -> None:
        """stats: the global [answer loss, targets, samples, probe loss, clock] of one step."""
        self.loss_sum += stats[0].item()
        self.probe_sum += stats[3].item()
        self.tok_sum += stats[1].item()
        self.samples_done += int(stats[2].item())
        self.window_samples += int(stats[2].item())

    def report(self, step: int, length: _Length, stats: torch.Tensor, grad_norm: float, lr: float) -> None:
        """The log line and history entry of the steps since the last one; starts a new window."""
        elapsed = time.monotonic() - self.window_t0
        rate = self.window_samples / max(elapsed, 1e-9)
        if length.budget_s:
            eta = max(0.0, length.budget_s - stats[4].item())
        else:
            eta = self.training_clock() / (step + 1) * (length.total - step - 1)
        loss = self.loss_sum / max(self.tok_sum, 1)
        probe_text = f"  probe {self.probe_sum / max(self.tok_sum, 1):.4f}" if self.has_probe else ""
        self.log(f"step {step + 1:5d}/{length.total or '~'}  loss {loss:.4f}{probe_text}  grad {grad_norm:.2f}  "
                 f"lr {lr:.2e}  {rate:.1f} samples/s  ETA {eta / 60:.1f} min")
        self.history.append({"step": step + 1, "loss": loss, "samples": self.samples_done,
                             "elapsed_s": time.monotonic() - self.train_t0}
                            | ({"probe_loss": self.probe_sum / max(self.tok_sum, 1)} if self.has_probe else {}))
        self.loss_sum = self.tok_sum = self.probe_sum = 0
        self.window_t0, self.window_samples = time.monotonic(), 0

    def held_out_done(self, t0: float) -> None:
        """A held-out check that began at t0 has ended: its time counts neither as training nor in samples/s."""
        self.window_t0 = time.monotonic()
        self.eval_s += self.window_t0 - t0


def _optimize(run: _Run, batches) -> tuple[_Progress, dict, int]:
    """The training loop: (progress with its history, the last held-out result, steps taken)."""
    args, d = run.args, run.d
    progress = _Progress(d.log, run.inputs.probe is not None)
    last_eval: dict = {}
    spent = 0.0                  # fraction of the time budget spent, as rank 0 measured it
    for step in itertools.count():
        n_targets_global, packed = next(batches)
        lr = run.length.learning_rate(step, spent)
        for g in run.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        local, grad_norm = _optimization_step(run, n_targets_global, packed)
        # Rank 0's clock decides the budget for every rank (the sum carries it: the others add 0),
        # so that all ranks take the same learning rate and stop at the same step.
        clock = progress.training_clock() if d.rank == 0 else 0.0
        stats = torch.tensor([*local, clock], dtype=torch.float64, device=d.device)
        if d.world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        if run.length.budget_s:
            spent = stats[4].item() / run.length.budget_s
        last = run.length.is_last(step, spent)
        progress.add(stats)
        if (step + 1) % args.log_every == 0 or last:
            progress.report(step, run.length, stats, grad_norm, lr)
        if d.rank == 0 and args.eval_every and ((step + 1) % args.eval_every == 0 or last):
            t0 = time.monotonic()
            last_eval = _held_out_check(run, step)
            progress.history.append({"step": step + 1, "held_out": last_eval})
            progress.held_out_done(t0)
        if last:
            return progress, last_eval, step + 1


def _held_out_check(run: _Run, step: int) -> dict:
    """Save the checkpoint (the latest weights survive an interrupted run), then held-out accuracy
    through the pipeline: on six cameras, and with --view-selector on the cameras it selects."""
    args, model, data = run.args, run.model, run.data
    model.eval()
    t0 = time.monotonic()
    run.save_checkpoint()
    result = held_out_accuracy(model, data.work, data.val_frames, args.eval_questions, args.seed, layout=data.layout)
    if args.view_selector:
        result["selected_views"] = held_out_accuracy(model, data.work, data.val_frames, args.eval_questions,
                                                     args.seed, args.view_selector, data.layout)
    model.train()
    result["step"] = step + 1
    cats = " ".join(f"{k} {v:.3f}" for k, v in result.get("by_category", {}).items())
    acc = result["accuracy"]
    sel = result.get("selected_views", {}).get("accuracy")
    sel_text = "" if sel is None else f"; with selected views {sel:.4f}"
    run.d.log(f"  held-out accuracy {'n/a' if acc is None else f'{acc:.4f}'} on {result['questions']} "
              f"closed-form questions ({cats}){sel_text} [{time.monotonic() - t0:.0f} s]")
    return result


def _write_record(run: _Run, bf16: bool, progress: _Progress, last_eval: dict, steps_done: int,
                  t_start: float) -> dict:
    """The provenance record beside the checkpoint: the command that reproduces the run, its
    settings, data hashes, model, the loss history and the last held-out result."""
    args, d, data, history = run.args, run.d, run.data, progress.history
    out = Path(args.out)
    train_s = time.monotonic() - progress.train_t0
    record = {
        # With a time budget the run's length is the budget: --epochs/--steps were not used.
        "command": reproduce_command(args, "vlm", skip=("epochs", "steps") if args.time_budget is not None else ()),
        "argv": " ".join(shlex.quote(a) for a in sys.argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "world_size": d.world,
        "device": str(d.device) if d.device.type == "cpu" else f"{d.device}: {torch.cuda.get_device_name(d.device)}",
        "precision": "bfloat16 autocast" if bf16 else "float32",
        "saved_dtype": args.save_dtype,
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__,
        "data": data_provenance(args.data),
        "val_data": data_provenance(args.val) if args.val else {"held_out_frames": [f.key for f in data.val_frames]},
        "model": {"preset": args.preset, "parameters": sum(p.numel() for p in run.model.parameters()),
                  "config": data.cfg.to_dict(), "tokenizer_vocab": data.tok.vocab_size},
        "train_qa": sum(len(x) for x in data.encoded), "train_frames": len(data.frames),
        "skipped_long_answers": data.skipped,
        "steps": steps_done,
        "final": {"loss": next((h["loss"] for h in reversed(history) if "loss" in h), None),
                  "held_out": last_eval, "train_seconds": round(train_s, 1),
                  "total_seconds": round(time.monotonic() - t_start, 1)},
        "history": history,
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    d.log(f"wrote {out} ({train_s / 60:.1f} min training); record in {out / RECORD_FILE}")
    return record
