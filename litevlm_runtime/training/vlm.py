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
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..cameras import CAMERAS
from ..errors import InputError
from ..models.internvl import InternVL
from ..options import options_from_flat
from ..pipeline.pipeline import Pipeline
from ..stages.preprocess import Normalizer
from ..stages.prompt import model_layout, write_layout
from ..stages.view_selector import load_view_selector
from ..weights.checkpoint import load_model, write_checkpoint
from ..weights.presets import preset
from ..weights.random_init import init_weights
from ..weights.tokenizer import Tokenizer, train_bpe_tokenizer
from .distributed import setup, threads_per_rank
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
    encode_qa,
    epoch_groups,
    frame_and_cameras,
    is_closed_form,
    load_frames,
    pixels_for,
    prefetch,
    split_by_views,
)

RECORD_FILE = "training_record.json"


# ---------------------------------------------------------------------------------------------
# Data: DriveLM v1.1 files -> key frames with their six image paths and QA
# ---------------------------------------------------------------------------------------------


















# ---------------------------------------------------------------------------------------------
# Encoding: prompts exactly as Pipeline.prompt_ids builds them, answers + <|im_end|>
# ---------------------------------------------------------------------------------------------












# ---------------------------------------------------------------------------------------------
# Packing: prefix trees side by side under one boolean mask
# ---------------------------------------------------------------------------------------------














# ---------------------------------------------------------------------------------------------
# Schedule and held-out evaluation
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
        # With a time budget the run's length is the budget: --epochs/--steps were not used.
        "command": reproduce_command(args, "vlm", skip=("epochs", "steps") if args.time_budget is not None else ()),
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
